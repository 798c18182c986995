"""The executor contract the engine service programs against (no torch, no I/O).

Both executors implement :class:`Executor`: the hot ``executor.Engine`` (a catalog of one model) and the cold
``cold.ColdEngine`` (several catalog models, one active). The service never probes an executor with
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.engine.types import EngineRequest, RequestOutput


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
    tokenizer: Any  # services.engine.tokenizer.Tokenizer
    vocab_size: int
    max_context: int

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


# ---------------------------------------------------------------------------------------------- the protocol
class Executor(Protocol):
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

    def stats(self) -> dict[str, Any]:
        """The snapshot taken after the latest step (never waits for a step)."""

    def session_info(self, session_id: str) -> dict[str, Any] | None: ...

    def flush_cache(self) -> int: ...

    def attach_retention(self, book) -> None:
        """Session caches evict by predicted return (``kv.retention.RetentionBook``; issue 14)."""

    def open_model(self, model: str) -> None:
        """Load a catalog model and ask for it to become active (raises UnsupportedOperationError)."""

    def close_model(self, model: str) -> None:
        """Unload an idle model (raises ModelBusyError / UnsupportedOperationError)."""

    def take_switch_records(self) -> Sequence[Any]:
        """Switch records not handed out yet (a hot executor has none)."""

    def recent_switch_records(self, n: int) -> Sequence[Any]: ...

    def take_round_summaries(self) -> Sequence[Any]:
        """Closed slot-scheduler rounds not handed out yet (none without the slot scheduler)."""
