"""The loop of one engine instance: intake, the scheduler and the KV manager, composed with a model runner,
an output processor and a meter.

Design: ``step()`` is the whole engine loop (as in nano-vllm / SGLang's offline Engine): drain the intake
(requests and aborts queued by other threads under a lock), ``schedule()`` one flat batch (decodes first,
then chunked prefills; see scheduler.py), have the model runner run the copy-on-write page copies it asks
for and one forward (``model_runner.ModelRunner.execute``), have the output processor sample the sequences
whose last uncomputed token was computed and postprocess them (``output_processor.OutputProcessor``: append
the token, incremental detokenization, stop tokens/strings, EOS, max_tokens), and feed the step's time to the
meter (``meter.Meter``). On finish the loop releases the pages (``Engine._release``, called back by the output
processor): full pages into the radix cache, committed tokens + pages into the session cache when the request
has a session. The parts and why the engine is split this way: the design notes atop those modules; the
settings every part reads: ``settings.EngineSettings``.

Cached prefix pages are never recomputed: the first computed token of an admitted request is its first
non-cached token; when the whole prompt is cached the last prompt token is recomputed into a private page
(the block manager copies the shared page's rows first), so no request ever writes into a page it shares.

Threads: ``add_request``/``abort``/``stats``/``session_info``/``has_unfinished`` may be called from any
thread; ``step``/``generate``/``flush_cache`` serialize on a step lock. ``stats``/``session_info`` build
their typed answers (``api.EngineStats`` / ``api.SessionInfo``) when called, from counters and a session
table the step keeps, so they never wait for a forward and nothing is copied after every step.
"""

from __future__ import annotations


import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from services.engine.api import (  # noqa: F401 - the error classes are part of this module's interface
    ContextLengthError,
    CostStats,
    DuplicateRequestError,
    EngineStats,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingError,
    ModelInfo,
    ModelStats,
    SessionInfo,
    UnknownModelError,
)
from services.engine.kv import KVManager, PageAllocator, SessionResidency
from services.engine.kv.port import KvPort
from services.engine.meter import Meter
from services.engine.model.batch import KVCache
from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaForCausalLM
from services.engine.model_runner import ModelRunner
from services.engine.output_processor import OutputProcessor
from services.engine.sampling import Sampler
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.sequence import Sequence, SequenceStatus
from services.engine.session_chains import SessionChains
from services.engine.settings import EngineSettings
from services.engine.types import EngineRequest, RequestOutput, SamplingParams
from talaria.attribution import Phase, PhaseClock, attribution_clock, phase_start
from talaria.hashing import cache_salt, model_salt, tenant_salt
from talaria.tokenizer import Tokenizer

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024  # a cold engine's KV share of its arena when not configured
log = logging.getLogger(__name__)


def validate_request(req: EngineRequest, max_context: int, vocab_size: int) -> None:
    """Intake checks — the only ones: every executor front calls this, the service does not repeat them
    (raises InvalidRequestError subclasses carrying status, code and the offending field)."""
    sp = req.sampling
    n = len(req.prompt_token_ids)
    if n == 0:
        raise EmptyPromptError(f"request {req.request_id!r}: empty prompt")
    if sp.max_tokens < 1:
        raise InvalidSamplingError(f"max_tokens must be at least 1, got {sp.max_tokens}", "max_tokens")
    if not 0.0 <= sp.temperature <= 2.0:
        raise InvalidSamplingError(f"temperature must be within [0, 2], got {sp.temperature}", "temperature")
    if not 0.0 < sp.top_p <= 1.0:
        raise InvalidSamplingError(f"top_p must be within (0, 1], got {sp.top_p}", "top_p")
    if sp.top_k < 0:
        raise InvalidSamplingError(f"top_k must be >= 0, got {sp.top_k}", "top_k")
    if n + sp.max_tokens > max_context:
        raise ContextLengthError(n, sp.max_tokens, max_context, req.model)
    bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "prompt")
    if any(not 0 <= t < vocab_size for t, _ in sp.logit_bias):
        raise InvalidRequestError(f"logit_bias names a token id outside the vocabulary (size {vocab_size})", "logit_bias")
    for name in ("ttft_target_s", "tpot_target_s"):  # per-call token deadline hints (0 = configured)
        v = getattr(req, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 3600.0):
            raise InvalidRequestError(f"{name} must be a number of seconds within [0, 3600], got {v!r}", name)


def run_to_completion(
    engine: Any, ids: list[str], prompts_token_ids: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None,
    model: str = "",
) -> list[list[int]]:
    """Queue one request per prompt on ``engine`` (an Engine or a ColdEngine), step it until they all
    finish, and return their tokens in order. Other work in flight is stepped along with them."""
    params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts_token_ids)
    if len(params) != len(prompts_token_ids):
        raise ValueError("one SamplingParams per prompt")
    for rid, prompt, sp in zip(ids, prompts_token_ids, params):
        engine.add_request(EngineRequest(rid, list(prompt), sp, model=model))
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.request_id in results:
                results[out.request_id] += out.new_token_ids
                if out.finished:
                    pending.discard(out.request_id)
    return [results[rid] for rid in ids]


class Engine:
    """One model's runtime, driven by :meth:`step`: the loop that owns intake, the scheduler and the KV
    manager, and the three parts it is composed of: ``runner`` (``model_runner.ModelRunner``: model, KV pool
    tensors, kernels, one forward), ``outputs`` (``output_processor.OutputProcessor``: sampling, detokenizing,
    stops, request outputs) and ``meter`` (``meter.Meter``: measured step costs).

    ``settings`` (``settings.EngineSettings``) is the engine's configuration; keyword ``overrides`` replace
    single fields of it (tests and tools: ``Engine(path, page_size=4, num_pages=64)``). ``model``/``kv_cache``/
    ``tokenizer``/``page_allocator`` let a caller that owns device memory (the cold pool's arena,
    services/engine/substrate) bind this runtime onto existing tensors instead of loading and allocating;
    ``kv_cache`` then fixes the page count (and no CUDA graphs are captured: the memory moves)."""

    def __init__(
        self,
        model_dir: str | Path,
        settings: EngineSettings | None = None,
        *,
        model_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        model: tuple[LlamaForCausalLM, ModelConfig] | None = None,
        kv_cache: KVCache | None = None,
        tokenizer: Tokenizer | None = None,
        page_allocator: PageAllocator | None = None,
        **overrides: Any,
    ) -> None:
        s = self.settings = (settings or EngineSettings()).with_overrides(**overrides)
        self.model_dir = Path(model_dir)
        self.model_id = model_id or self.model_dir.name
        # the tokenizer before the runner: the runner sizes the KV pool from the memory left after the weights
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(self.model_dir)
        self.runner = ModelRunner(self.model_dir, s, model_id=self.model_id, model=model, kv_cache=kv_cache)
        r = self.runner
        self.device, self.dtype, self.config, self.kv_cache = r.device, r.dtype, r.config, r.kv_cache  # fixed for life
        self.vocab_size = self.config.vocab_size
        self.page_size, self.num_pages, self.max_context = s.page_size, r.num_pages, r.max_context
        self.salt = model_salt(self.model_id)
        self.kv = KVManager(
            self.num_pages, s.page_size, salt=self.salt, clock=clock,
            session_entries=s.session_cache_entries, session_max_pages=s.session_cache_pages, allocator=page_allocator,
        )
        self.residency = SessionResidency(self.kv, self.model_id)  # where each session's KV is (any thread)
        self.scheduler = Scheduler(self.kv, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                                   lone_prefill_tokens=s.lone_prefill_tokens)
        eos = frozenset(self.config.eos_token_id) | frozenset(self.tokenizer.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, Sampler(self.device), eos, self.max_context, self._release)
        self.meter = Meter()
        self._clock = clock
        self._intake_lock = threading.Lock()
        self._pending: list[EngineRequest] = []
        self._pending_aborts: list[str] = []
        self._live_ids: set[str] = set()  # queued or in flight (guarded by _intake_lock)
        self._step_lock = threading.RLock()
        self._gen_ids = itertools.count()
        self.num_steps = 0
        self.host_kv = None  # host KV tier (host_kv.HostKV), see attach_host_kv
        self.session_chains = SessionChains()  # the hash chains each session left (end_session)

    @property
    def model(self) -> LlamaForCausalLM:
        """The model the runner serves with now (``rebind_model`` replaces it). Reads only."""
        return self.runner.model

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a call unless it ignores EOS (the config's and the tokenizer's). Reads only."""
        return self.outputs.eos_token_ids

    # ------------------------------------------------------------------ the catalog (of one model)
    def serves(self, model: str) -> bool:
        return model == self.model_id

    def info(self, model: str) -> ModelInfo:
        if model != self.model_id:
            raise UnknownModelError(f"this instance serves only {self.model_id!r}, not {model!r}")
        return ModelInfo(self.model_id, self.tokenizer, self.vocab_size, self.max_context)

    def pool(self) -> None:
        """None: one pinned model, no switches or rounds (``api.ModelPool`` is the cold engine's)."""
        return None

    # ------------------------------------------------------------------ intake (any thread)
    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue ``req``; it is admitted at the next ``step()``. Raises InvalidRequestError."""
        validate_request(req, self.max_context, self.vocab_size)
        self.add_validated(req)

    def add_validated(self, req: EngineRequest) -> None:
        """Queue ``req``, already validated against this engine's model limits by its caller (a cold engine
        validates a call once, at its own intake, then hands it to the model's shell here). Raises
        DuplicateRequestError."""
        with self._intake_lock:
            if req.request_id in self._live_ids:
                raise DuplicateRequestError(f"request id {req.request_id!r} is already in flight")
            self._live_ids.add(req.request_id)
            self._pending.append(req)

    def abort(self, request_id: str) -> None:
        """Cancel a queued or running request; its final output (``ABORT``) comes from the next step."""
        with self._intake_lock:
            if request_id in self._live_ids:
                self._pending_aborts.append(request_id)

    def has_unfinished(self) -> bool:
        with self._intake_lock:
            return bool(self._live_ids)

    @property
    def prefill_per_token(self) -> float:
        """Measured prefill seconds per token (0.0 = not measured yet; any thread)."""
        return self.meter.prefill_per_token

    def restoring_sequences(self) -> list[Sequence]:
        """Sequences held by the host KV tier while their prefix is restored (executor thread)."""
        return self.host_kv.restoring_sequences() if self.host_kv is not None else []

    def pending_requests(self) -> list[EngineRequest]:
        """Requests queued by ``add_request`` and not yet admitted by a step (a copy; any thread)."""
        with self._intake_lock:
            return list(self._pending)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One engine step: host-tier restores that landed join, the intake is drained, one schedule runs
        (forward on the runner, sampling and outputs on the output processor, its cost into the meter).
        Mutates everything the step owns (executor thread; serialized with the other step-lock holders)."""
        with self._step_lock:
            hk = self.host_kv
            if hk is not None:
                hk.poll()  # checkpoint pins back; restores advance (reserve pages, publish landed ones)
                for seq in hk.take_ready():  # restored (or declined): joins the batch now
                    if seq.phases is not None:
                        seq.phases.enter(Phase.ENGINE_QUEUE, attribution_clock())
                    self.scheduler.add(seq)
            outputs = self._drain_intake()

            t_sched = attribution_clock()
            sched = self.scheduler.schedule()
            self._phases_scheduled(sched, t_sched)
            if not sched.is_empty:
                t0 = time.perf_counter()
                seqs = [sc.seq for sc in sched.scheduled if sc.sample]  # the rows the runner returns logits for
                try:
                    logits = self.runner.execute(sched)
                    sampled: list[int | Exception] = []
                    if logits is not None:
                        with torch.inference_mode():
                            sampled = self.outputs.sample(logits, seqs)
                except BaseException:
                    self.scheduler.forward_failed(sched)  # its pages are never published as a prefix
                    raise
                self.scheduler.forward_done()  # the KV it wrote may be published for calls sharing the prefix
                self.meter.record(sched, time.perf_counter() - t0)
                outputs += self.outputs.process(seqs, sampled)
            elif hk is not None and hk.num_restoring and not outputs:
                hk.wait_restore(0.005)  # nothing to run but restores in flight: wait for one, do not spin
            self.num_steps += 1
            return outputs

    def generate(
        self, prompts_token_ids: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run the given prompts to completion (with anything else in flight) and return their tokens."""
        ids = [f"generate-{next(self._gen_ids)}" for _ in prompts_token_ids]
        return run_to_completion(self, ids, prompts_token_ids, sampling)

    # ------------------------------------------------------------------ intake drain
    def _drain_intake(self) -> list[RequestOutput]:
        """Admit the queued requests (sequence, output state, host restore or the scheduler's queue) and end the
        aborted ones. Mutates the intake queues, the output processor and the scheduler (executor thread)."""
        with self._intake_lock:
            new, self._pending = self._pending, []
            aborts, self._pending_aborts = self._pending_aborts, []
        for req in new:
            seq = Sequence(req.request_id, req.prompt_token_ids, req.sampling, req.session_id)
            seq.salt = tenant_salt(self.salt, req.tenant)  # tenants never share a hash chain
            seq.trace_context = req.trace_context
            seq.phases = req.phases if req.phases is not None else PhaseClock(phase_start(req.arrival_time, self._clock, attribution_clock()))
            seq.priority, seq.queue_at = req.priority, req.arrival_time - req.latency_sensitivity_s
            if req.cache_salt:  # vLLM's cache_salt, within the tenant's chains
                seq.salt = cache_salt(seq.salt, req.cache_salt)
            self.outputs.add(req, seq)
            if self.host_kv is not None:
                seq.phases.enter(Phase.RESTORE, attribution_clock())  # restore (or its lookup) until it joins
                if self.host_kv.begin_restore(seq):
                    continue  # its prefix is being restored off this thread; it joins the batch when its pages are in
                seq.phases.enter(Phase.ENGINE_QUEUE, attribution_clock())
            self.scheduler.add(seq)

        outputs = []
        for rid in aborts:
            out = self.outputs.abort(rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def _release(self, seq: Sequence) -> None:
        """A request finished (the output processor calls this before building its final output): a call that
        ended while restoring holds no pages; otherwise its session pages are checkpointed to the host tier
        and its pages released into the caches; its session's chains and residency are recorded, and it leaves
        the live table. Mutates the scheduler, the KV manager's caches, the host tier and the intake table."""
        if self.host_kv is not None and self.host_kv.cancel_restore(seq.request_id):
            seq.status = SequenceStatus.FINISHED  # ended while restoring: it holds no pages
        else:
            if self.host_kv is not None and seq.session_id:
                self.host_kv.checkpoint(seq)  # pins the pages; copies them now (write-through) or marks them dirty
            self.scheduler.finish(seq, cache=True)
        if seq.session_id:
            n = seq.num_computed_tokens // self.page_size
            self.session_chains.record(seq.session_id, self.kv.extend_hashes(seq.hashes, seq.token_ids[: n * self.page_size], seq.salt)[:n])
            self.residency.record(seq.session_id)
        with self._intake_lock:
            self._live_ids.discard(seq.request_id)

    def _phases_scheduled(self, sched: SchedulerOutput, now: float) -> None:
        """Move the phase clocks the schedule changed — preempted calls lose time from ``now`` until
        they have recomputed what they had (their next token); newly admitted ones start their prefill.
        Mutates: the scheduled and preempted sequences' ``phases``."""
        for rid in sched.preempted:
            st = self.outputs.requests.get(rid)
            if st is not None and st.seq.phases is not None:
                st.seq.phases.enter(Phase.PREEMPTED, now)
        for sc in sched.scheduled:
            ph = sc.seq.phases
            if ph is not None and ph.phase is Phase.ENGINE_QUEUE:
                ph.enter(Phase.PREFILL, now)

    # ------------------------------------------------------------------ the runner's, for the engine's users
    def kernels(self) -> tuple[tuple[str, str], ...]:
        """(kernel, what runs) for the heartbeat (``ModelRunner.kernels``). Reads only."""
        return self.runner.kernels()

    def rebind_model(self, model: LlamaForCausalLM) -> None:
        """Serve with ``model`` from now on (the cold pool rebinds its parameter views onto moved weights;
        ``ModelRunner.rebind_model``). Mutates the runner; the caller holds no step in flight."""
        self.runner.rebind_model(model)

    # ------------------------------------------------------------------ introspection
    def device_sessions(self) -> list[SessionInfo]:
        """Sessions whose committed KV is in the session cache now (any thread)."""
        return self.residency.device()

    def stats(self) -> EngineStats:
        """Built now from the live counters (any thread; never waits for a step): each value is read once,
        so values may be from either side of a step boundary."""
        kv, sch, hk = self.kv, self.scheduler, self.host_kv
        with self._intake_lock:
            pending, unfinished = len(self._pending), len(self._live_ids)
        running = sch.num_running
        waiting = sch.num_waiting + pending + (hk.num_restoring if hk is not None else 0)
        sessions = self.residency.sessions()
        costs = self.cost_stats()  # a hot instance's one model: its costs are the instance's
        return EngineStats(
            model_id=self.model_id, num_running=running, num_waiting=waiting, num_unfinished=unfinished,
            kv_pages_total=kv.num_pages, kv_pages_free=kv.num_free_pages, radix_pages=kv.num_radix_pages,
            session_pages=kv.num_session_pages, prefix_hit_rate=kv.hit_rate, tokens_generated=self.outputs.num_tokens_generated,
            num_preemptions=sch.num_preemptions, num_steps=self.num_steps, max_context=self.max_context,
            models=(ModelStats(self.model_id, True, True, False, self.max_context, running, waiting, profile=costs,
                               max_token_bytes=getattr(self.tokenizer, "max_token_bytes", 0)),),
            sessions=tuple(sessions), profile=costs, host_kv=hk is not None,
            kv_restore_verify_failures=hk.counters["restore_verify_failures"] if hk is not None else 0,
            kernels=self.kernels(),
            host_kv_counters=((self.model_id, tuple(hk.counters.items())),) if hk is not None else (),
        )

    def cost_stats(self) -> CostStats:
        """Measured prefill / decode / restore costs (0.0 = not measured yet): the meter's and the host tier's."""
        return self.meter.cost_stats(self.host_kv.restore_per_token.value if self.host_kv is not None else 0.0)

    def session_info(self, session_id: str) -> SessionInfo | None:
        """Where the session's KV is: on the device (its cached entry), else in the host store, else None."""
        return self.residency.where(session_id)

    def kv_port(self) -> KvPort:
        """What a host KV tier needs of this engine (``kv/port.py``): its KV manager, its pool and the pool's
        page layout, and its measured prefill cost. Pure: builds the port, mutates nothing."""
        cfg = self.config
        shape = (2, cfg.num_hidden_layers, self.page_size, cfg.num_key_value_heads, cfg.head_dim)
        meter = self.meter
        return KvPort(self.model_id, self.kv, self.kv_cache, shape, self.dtype, lambda: meter.prefill_per_token, self.model_dir)

    def attach_host_kv(self, host_kv) -> None:
        """Use a host KV tier (``services.engine.host_kv.HostKV``): checkpoint session pages when calls end
        (write-through) or when they are about to leave the device (write-back: the KV manager's
        ``pressure_hook``, the switch barrier), restore prefixes from it when calls arrive."""
        with self._step_lock:
            self.host_kv = host_kv
            self.kv.pressure_hook = host_kv.relieve_pressure if host_kv is not None else None
            self.residency.attach_host(host_kv.index if host_kv is not None else None, host_kv.available if host_kv is not None else None)

    def attach_retention(self, book) -> None:
        """Evict session entries by predicted return (``kv.retention.RetentionBook``)."""
        with self._step_lock:
            self.kv.retention = book

    def drain_checkpoints(self, timeout: float | None = None) -> bool:
        """Switch barrier (Talaria Appendix B): wait until every outstanding device->host checkpoint copy
        has completed (or been abandoned) and its pages are unpinned. Call before releasing the KV region.
        Returns False if ``timeout`` passed first."""
        with self._step_lock:
            return self.host_kv.drain(timeout) if self.host_kv is not None else True

    def release_device_kv(self, timeout: float | None = None) -> bool:
        """The cold switch barrier: returns once no checkpoint still reads the device pages (the store writes may
        go on, ``HostKV.release_device``) and no restore is in flight. Returns False if ``timeout`` passed first."""
        with self._step_lock:
            return self.host_kv.release_device(timeout) if self.host_kv is not None else True

    def flush_cache(self) -> int:
        """Drop all cached prefixes and session entries not in use; with a write-back host tier their dirty
        sessions are written back first (the pages leave the device; the pins go when the copies are
        gathered). Returns pages freed now."""
        with self._step_lock:
            if self.host_kv is not None:
                self.host_kv.write_back(None, "flush")
            return self.kv.flush()

    def end_session(self, session_id: str, tenant: str = "", token_ids: Seq[int] = ()) -> int:
        """The session ended. Drops its session-cache entry and the radix pages of its chains (every
        branch its calls left, ``session_chains``) that nothing else extends (shared prefixes stay), and queues
        the release of the same chains in the kvstore. ``token_ids``: the session's tokens when the device entry
        is gone already. Idempotent. Returns pages freed."""
        with self._step_lock:
            device_toks = self.kv.session_tokens(session_id)
            toks = list(device_toks) if device_toks is not None else list(token_ids)
            n = len(toks) // self.page_size
            chains = self.session_chains.pop(session_id)
            chains.append(self.kv.extend_hashes([], toks[: n * self.page_size], tenant_salt(self.salt, tenant))[:n])
            chains = [c for c in reversed(chains) if c]  # newest first: its tail frees the fork for older ones
            freed = self.kv.drop_session(session_id, chains)
            if self.host_kv is not None:
                self.host_kv.release_session(session_id, chains)
            self.residency.record(session_id)
            return freed

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def check_integrity(self) -> None:
        with self._step_lock:
            self.scheduler.check_integrity()
