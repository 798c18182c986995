"""The executor contract the engine service programs against (no torch, no I/O).

Both executors implement :class:`Executor`: the hot ``executor.Engine`` (a catalog of one pinned model) and the
cold ``cold.ColdEngine`` (several catalog models, one active). Only the cold engine also implements
:class:`ModelPool` (open/close models, switch records, slot rounds, held-open slots), and ``Executor.pool()``
hands it out: the hot engine answers None instead of stubbing what it cannot do. ``services/engine/main.py``
builds each engine as the protocol it must satisfy, so the type checker (``python -m mypy``) verifies both. The service never probes an executor with
``hasattr`` and never maps errors by class name: every refusal is an :class:`ExecutorError` carrying its HTTP
status, error code and offending request field. The shape follows the backend protocol of DESIGN.md, so a
GPU execution engine (e.g. SGLang's ``Engine``: token-id generate with session parameters, memory
release/resume by tag, flush, KV export/import, weight staging) can sit behind it later.

Thread model: ``add_request``/``abort``/``has_unfinished``/``stats``/``session_info``/``serves``/``info`` and
the ``*_records``/``take_*`` methods are safe from any thread and never wait for a step; ``step`` runs on the
executor thread only; ``flush_cache``/``open_model``/``close_model`` wait for the running step (call them off
the service loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from services.engine.kv.session_residency import KvLocation as KvLocation, Residency as Residency  # part of this contract (re-exported)

from services.engine.types import EngineRequest, RequestOutput

if TYPE_CHECKING:
    from services.engine.kv.retention import RetentionBook
    from services.engine.slots.types import RoundSummary
    from services.engine.substrate.switch import SwitchRecord


# ---------------------------------------------------------------------------------------------- errors
class ExecutorError(Exception):
    """A refusal with the status the caller sees (OpenAI-style error body: ``code``, ``param``)."""

    status = 500
    code = "engine_error"
    param = ""


class InvalidRequestError(ExecutorError, ValueError):
    """A request the executor refuses at intake (never retried: it can never succeed)."""

    status = 400
    code = "invalid_value"

    def __init__(self, message: str, param: str = "") -> None:
        super().__init__(message)
        if param:
            self.param = param


class EmptyPromptError(InvalidRequestError):
    param = "prompt"


class InvalidSamplingError(InvalidRequestError):
    pass


class ContextLengthError(InvalidRequestError):
    status = 413
    code = "context_length_exceeded"
    param = "prompt"

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int, model: str = "") -> None:
        self.prompt_tokens, self.max_tokens, self.max_context = prompt_tokens, max_tokens, max_context
        of = f" of model '{model}'" if model else ""
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
            f"exceeds the context limit of {max_context} tokens{of}"
        )


class DuplicateRequestError(InvalidRequestError):
    status = 409
    code = "duplicate_request"


class UnknownModelError(InvalidRequestError):
    """The call or control op names a model this instance does not have loaded."""

    status = 404
    code = "model_not_found"
    param = "model"


class ModelBusyError(ExecutorError, RuntimeError):
    """A model cannot be closed while it has unfinished calls."""

    status = 409
    code = "model_busy"


class UnsupportedOperationError(ExecutorError):
    """A control operation this executor does not offer (a hot instance cannot open or close models)."""

    status = 400
    code = "unsupported"


# ---------------------------------------------------------------------------------------------- types
@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the service needs to accept a call for a model, active or not."""

    model_id: str
    tokenizer: Any  # talaria.tokenizer.Tokenizer
    vocab_size: int
    max_context: int

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        ids: list[int] = self.tokenizer.apply_chat_template(messages, **kwargs)
        return ids


# Where a session's KV is (``where``: ``KvLocation.DEVICE`` -- the session cache holds ``committed_tokens``,
# ``HOST`` -- restorable from the host KV store, ``MISSING`` -- checkpointed into a store that restarted or is
# unreachable): the contract's name for the KV residency owner's answer (``kv/session_residency.py``).
SessionInfo = Residency


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One catalog model of the instance (a hot instance has exactly one, loaded and active)."""

    model: str
    loaded: bool
    active: bool
    staged: bool
    max_context: int
    num_running: int
    num_waiting: int
    slot_wait_s: float = 0.0  # cold pool with rounds: predicted seconds until this model can take a call (0: its slot admits now)
    profile: CostStats | None = None  # this model's own measured costs (None: not measured here yet)
    max_token_bytes: int = 0  # the tokenizer's bound on text bytes per token (Tokenizer.max_token_bytes; 0: unknown)


@dataclass(frozen=True, slots=True)
class CostStats:
    """Measured costs (0.0 = not measured yet): seconds per prefill token, per decode step, per restored
    token (host KV), and per switch by ``talaria.switch_path.SwitchPath`` (cold pool)."""

    prefill_per_token: float = 0.0
    decode_step: float = 0.0
    restore_per_token: float = 0.0
    switch_by_path: Mapping[Any, float] = field(default_factory=dict)
    prefill_by_context: tuple[tuple[int, float, int], ...] = ()  # learned curve (at, seconds, samples)
    decode_by_batch: tuple[tuple[int, float, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SlotStats:
    """The slot scheduler's overload report (Talaria §3.4; cold pool with ``slot_scheduler``)."""

    deadline_risk: bool
    shortfall_s: float
    round_remaining_s: float
    infeasible: tuple[str, ...]
    rounds: int = 0
    mode: str = "rounds"  # "rounds" | "token_deadlines": the cold-pool scheduler in force
    attainment: float = 1.0  # per-token deadlines met since the epoch began (tracked in both modes)
    ttft_attainment: float = 1.0  # first tokens within their TTFT target
    gap_p99_s: float = 0.0  # p99 inter-token gap
    slot_wait_s: tuple[tuple[str, float], ...] = ()  # (model, predicted s until its switch starts); "" = any other


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What ``Executor.stats()`` returns: built when asked (heartbeat time), never waiting for a step."""

    model_id: str
    num_running: int
    num_waiting: int  # queued, waiting for pages or a slot, or restoring from the host store
    num_unfinished: int
    kv_pages_total: int
    kv_pages_free: int
    radix_pages: int
    session_pages: int
    prefix_hit_rate: float
    tokens_generated: int
    num_preemptions: int
    num_steps: int
    max_context: int
    models: tuple[ModelStats, ...] = ()
    sessions: tuple[SessionInfo, ...] = ()  # device first, then host / missing
    profile: CostStats = CostStats()
    host_kv: bool = False  # a host KV tier is attached
    staging_slack_bytes: int = 0
    num_switches: int = 0
    slots: SlotStats | None = None
    kv_restore_verify_failures: int = 0  # restored pages that failed their checksum (recomputed), since start
    transfer_stream_bytes: int = 0  # partial_layers: bytes the transfer scheduler streamed (weights)
    transfer_kv_bytes: int = 0  # ... and moved for KV restores under the kappa floor
    kernels: tuple[tuple[str, str], ...] = ()  # (kernel, what runs) -- see executor.Engine.kernels()
    # the host KV tier's counters per model (``host_kv.COUNTERS``: checkpoints, bytes, the CPU seconds its
    # threads took, restores, ...), cumulative since the tier started: the engine's /metrics exports them
    host_kv_counters: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()

    @property
    def kv_usage(self) -> float:
        return (self.kv_pages_total - self.kv_pages_free) / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def kv_pages_used(self) -> int:
        return self.kv_pages_total - self.kv_pages_free


# ---------------------------------------------------------------------------------------------- the protocols
class Executor(Protocol):
    """What every executor does: serve calls for the models it holds, report its state, manage sessions."""

    def serves(self, model: str) -> bool:
        """Whether calls for ``model`` are accepted now."""

    def info(self, model: str) -> ModelInfo:
        """Tokenizer and limits of a served model (raises UnknownModelError)."""

    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue (raises InvalidRequestError subclasses); admitted at a later step."""

    def abort(self, request_id: str) -> None:
        """Cancel; the call's final ``ABORT`` output comes from a later step."""

    def step(self) -> list[RequestOutput]:
        """One schedule + forward + sample + postprocess (executor thread only)."""

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats:
        """Built when called, from any thread (never waits for a step)."""

    def session_info(self, session_id: str) -> SessionInfo | None:
        """Where the session's KV is (device, host, missing), or None when this instance never held it."""

    def flush_cache(self) -> int: ...

    def end_session(self, session_id: str, tenant: str = "", token_ids: Sequence[int] = ()) -> int:
        """Drop the session's device entry and the radix pages only it holds, and release its kvstore
        entries (shared prefixes stay). ``token_ids``: its tokens when no device entry remains. Returns pages freed."""

    def attach_retention(self, book: RetentionBook) -> None:
        """Session caches evict by predicted return (``kv.retention.RetentionBook``)."""

    def pool(self) -> ModelPool | None:
        """The model-pool side of this executor (a cold engine: itself), or None for one pinned model."""


class ModelPool(Protocol):
    """What a pool of several catalog models adds (the cold engine): models opened and closed on request,
    switches between them, and the slot scheduler's rounds and held-open slots."""

    def open_model(self, model: str) -> None:
        """Load a catalog model and ask for it to become active."""

    def close_model(self, model: str) -> None:
        """Unload an idle model (raises ModelBusyError / UnknownModelError)."""

    def take_switch_records(self) -> Sequence[SwitchRecord]:
        """Switch records not handed out yet."""

    def recent_switch_records(self, n: int) -> Sequence[SwitchRecord]: ...

    def take_round_summaries(self) -> Sequence[RoundSummary]:
        """Closed slot-scheduler rounds not handed out yet (none without the slot scheduler)."""

    def idle_wait_s(self) -> float:
        """Seconds the step loop may sleep (unless a call arrives) although work is queued: a cold slot held open
        for expected returns (``slots/hold.py``). 0: step again at once."""
