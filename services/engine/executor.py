"""The executor core of one engine instance: scheduler + paged KV pool + model + sampler + detokenizer.

Design: ``step()`` is the whole engine loop (as in nano-vllm / SGLang's offline Engine): drain the intake
(requests and aborts queued by other threads under a lock), ``schedule()`` one flat batch (decodes first,
then chunked prefills; see scheduler.py), run the copy-on-write page copies it asks for, one model forward,
sample the sequences whose last uncomputed token was computed, and postprocess (append the token,
incremental detokenization, stop tokens/strings, EOS, max_tokens; on finish release the pages: full pages
into the radix cache, committed tokens + pages into the session cache when the request has a session).

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
from services.engine.intra_op import set_thread_count
from services.engine.kv import KVManager, PageAllocator, SessionResidency
from services.engine.kv.manager import cdiv
from services.engine.kv.port import KvPort
from services.engine.model.batch import AttnBatch, KVCache
from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaForCausalLM
from services.engine.model.compiled import compile_model
from services.engine.model.cuda_graphs import DEFAULT_MAX_CONTEXT as DEFAULT_GRAPH_CONTEXT
from services.engine.model.cuda_graphs import DecodeGraphs
from services.engine.model.loader import allocate_kv_cache, load_model
from services.engine.model.decode_gemm import load_decode_gemm
from services.engine.model.packed import can_pack
from services.engine.model.fused_ops import load_fused_ops
from services.engine.model.paged_attn import load_kernel
from services.engine.model.prefill_attn import applies as prefill_applies, isas as prefill_isas, load_prefill_kernel
from services.engine.model.registry import lookup
from services.engine.sampling import Sampler
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.memory import default_kv_cache_bytes
from services.engine.sequence import Sequence, SequenceStatus
from talaria.tokenizer import IncrementalDecoder, Tokenizer
from services.engine.session_chains import SessionChains
from services.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams, Usage
from talaria.attribution import Phase, PhaseClock, attribution_clock, phase_start
from talaria.cost_curve import CostCurve
from talaria.ewma import ewma
from talaria.hashing import cache_salt, model_salt, tenant_salt

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024  # a cold engine's KV share of its arena when not configured
log = logging.getLogger(__name__)


class StopStringBuffer:
    """Generated text with stop-string handling: ``feed`` returns the text that can be released.

    Text that could be the beginning of a stop string is held back (unless ``final``); when a stop string
    completes, the text is truncated before it (after it with ``include``: vLLM's
    ``include_stop_str_in_output``), the rest is dropped, ``hit`` is reported and ``matched`` names it.
    """

    __slots__ = ("stops", "text", "released", "include", "matched")

    def __init__(self, stops: tuple[str, ...] = (), include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.released = 0
        self.include = include
        self.matched = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        self.text += delta
        text, start = self.text, self.released
        if self.stops:
            longest = max(len(s) for s in self.stops)
            search_from = max(0, start - longest + 1)
            hits = [(i, s) for i, s in ((text.find(s, search_from), s) for s in self.stops) if i >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda h: (h[0], -len(h[1])))
                cut = max(at + len(self.matched) if self.include else at, start)
                self.text = text[:cut]
                self.released = cut
                return text[start:cut], True
            if not final:
                hold = 0
                for s in self.stops:
                    for k in range(min(len(s) - 1, len(text) - start), hold, -1):
                        if text.endswith(s[:k]):
                            hold = k
                            break
                self.released = len(text) - hold
                return text[start : self.released], False
        self.released = len(text)
        return text[start:], False


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


@dataclass(slots=True)
class _RequestState:
    """Per-request output state kept by the executor (the scheduler owns the Sequence)."""

    seq: Sequence
    decoder: IncrementalDecoder
    text: StopStringBuffer
    finished: bool = False


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


SMALL_STEP_TOKENS = 64  # a step this small is decode (or a tiny prefill): see Engine._step_threads
DETERMINISTIC_SPLIT_KEYS = 256  # deterministic mode: keys per chunk of the fixed attention split (paged_attn.cpp Split; a multiple of 16)

class Engine:
    """One model's runtime: scheduler, KV manager, model and sampler, driven by :meth:`step`.

    ``model``/``kv_cache``/``tokenizer``/``page_allocator`` let a caller that owns device memory (the cold
    pool's arena, services/engine/substrate) bind this runtime onto existing tensors instead of loading and
    allocating; ``kv_cache`` then fixes the page count (and no CUDA graphs are captured: the memory moves)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        lone_prefill_tokens: int = 0,
        session_cache_entries: int = 256,
        session_cache_pages: int | None = None,
        model_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        model: tuple[LlamaForCausalLM, ModelConfig] | None = None,
        kv_cache: KVCache | None = None,
        tokenizer: Tokenizer | None = None,
        page_allocator: PageAllocator | None = None,
        packed_weights: bool | None = None, decode_gemm: str = "auto",
        compile_mode: str = "off",
        paged_decode: str = "auto",
        fused_ops: str = "auto",
        small_step_threads: int | None = None, intra_op_threads: int | None = None,
        prefill_attention: str = "auto",
        cuda_graphs: str = "auto", cuda_graph_max_context: int = DEFAULT_GRAPH_CONTEXT,
        max_model_len: int | None = None,
        deterministic: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id or self.model_dir.name
        self.device = torch.device(device)
        self.model, self.config = model if model is not None else load_model(self.model_dir, device=self.device, dtype=dtype)
        self.dtype = next(self.model.parameters()).dtype
        self._pack(packed_weights, own_model=model is None, decode_gemm=decode_gemm)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(self.model_dir)
        self.vocab_size = self.config.vocab_size
        self.page_size = page_size
        cfg = self.config
        self.num_pages = self._kv_pages(num_pages, kv_cache, kv_cache_bytes, max_num_seqs)
        self.kv_cache = kv_cache if kv_cache is not None else allocate_kv_cache(cfg, self.num_pages, page_size, self.device, self.dtype)
        self.max_context = min(cfg.attention_span, self.num_pages * page_size, max_model_len or cfg.attention_span)  # max_model_len: a cap
        # CPU kernels, each flag says whether it is on: model/paged_attn.py, fused_ops.py, prefill_attn.py
        self.paged_decode, self.fused_ops, self.prefill_attention = (
            self._paged_decode(paged_decode), self._fused_ops(fused_ops), self._prefill_attention(prefill_attention))
        self.deterministic = self._deterministic(deterministic)
        self._log_kernels()
        self.intra_op_threads, self.small_step_threads = self._threads(intra_op_threads), self._small_threads(small_step_threads)
        # compiled layer parts (model/compiled.py): off / auto (kept where a start-up measurement shows they pay) / on;
        # decode steps replayed as CUDA graphs (model/cuda_graphs.py): own weights and KV pool only
        self.compile_verdict = compile_model(self.model, self.kv_cache, self.device, compile_mode, max_num_batched_tokens)
        self.decode_graphs = self._decode_graphs(cuda_graphs, model is None and kv_cache is None, max_num_seqs, cuda_graph_max_context)
        self.eos_token_ids = frozenset(cfg.eos_token_id) | frozenset(self.tokenizer.eos_token_ids)
        self.salt = model_salt(self.model_id)
        self.kv = KVManager(
            self.num_pages, page_size, salt=self.salt, clock=clock,
            session_entries=session_cache_entries, session_max_pages=session_cache_pages, allocator=page_allocator,
        )
        self.residency = SessionResidency(self.kv, self.model_id)  # where each session's KV is (any thread)
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   lone_prefill_tokens=lone_prefill_tokens)
        self.sampler = Sampler(self.device)
        self._clock = clock
        self._intake_lock = threading.Lock()
        self._pending: list[EngineRequest] = []
        self._pending_aborts: list[str] = []
        self._live_ids: set[str] = set()  # queued or in flight (guarded by _intake_lock)
        self._step_lock = threading.RLock()
        self._requests: dict[str, _RequestState] = {}
        self._stats_lock = threading.Lock()
        self._gen_ids = itertools.count()
        self.num_tokens_generated = self.num_steps = 0
        self._prefill_per_token = self._decode_step = 0.0
        # prefill seconds per token by context position, decode-step seconds by batch size
        self.prefill_curve = CostCurve(0.0)
        self.decode_curve = CostCurve(0.0)
        self.step_samples: deque[tuple[str, float, float]] = deque(maxlen=256)  # (curve, size, seconds) fed
        self.host_kv = None  # host KV tier (host_kv.HostKV), see attach_host_kv
        self.session_chains = SessionChains()  # the hash chains each session left (end_session)


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
        return self._prefill_per_token

    def restoring_sequences(self) -> list[Sequence]:
        """Sequences held by the host KV tier while their prefix is restored (executor thread)."""
        return self.host_kv.restoring_sequences() if self.host_kv is not None else []

    def pending_requests(self) -> list[EngineRequest]:
        """Requests queued by ``add_request`` and not yet admitted by a step (a copy; any thread)."""
        with self._intake_lock:
            return list(self._pending)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
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
                try:
                    sampled = self._execute(sched)
                except BaseException:
                    self.scheduler.forward_failed(sched)  # its pages are never published as a prefix
                    raise
                self.scheduler.forward_done()  # the KV it wrote may be published for calls sharing the prefix
                self._record_timing(sched, time.perf_counter() - t0)
                outputs += self._postprocess(sched, sampled)
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
            sp = req.sampling
            dec = self.tokenizer.incremental_decoder(req.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens)
            self._requests[req.request_id] = _RequestState(seq, dec, StopStringBuffer(sp.stop, sp.include_stop_str_in_output))
            self.sampler.add(req.request_id, req.sampling, req.prompt_token_ids)
            if self.host_kv is not None:
                seq.phases.enter(Phase.RESTORE, attribution_clock())  # restore (or its lookup) until it joins
                if self.host_kv.begin_restore(seq):
                    continue  # its prefix is being restored off this thread; it joins the batch when its pages are in
                seq.phases.enter(Phase.ENGINE_QUEUE, attribution_clock())
            self.scheduler.add(seq)

        outputs = []
        for rid in aborts:
            st = self._requests.get(rid)
            if st is not None and not st.finished:
                outputs.append(self._finish(st, FinishReason.ABORT, [], ""))
        return outputs

    # ------------------------------------------------------------------ forward
    def _execute(self, sched: SchedulerOutput) -> list[int | Exception]:
        """Run copies + one forward; returns the sampled token per ``sample`` entry, in batch order."""
        P = self.page_size
        kv = self.kv_cache
        for op in sched.copies:
            s, d = op.src * P, op.dst * P
            for layer in range(len(kv.k)):
                kv.k[layer][d : d + op.num_rows].copy_(kv.k[layer][s : s + op.num_rows])
                kv.v[layer][d : d + op.num_rows].copy_(kv.v[layer][s : s + op.num_rows])
        flat, cu_q, context_lens, block_tables = self._flat_batch(sched)
        T = cu_q[-1]
        self._step_threads(T)
        rows = [i for i, sc in enumerate(sched.scheduled) if sc.sample]
        # one host tensor (ids | positions | slots | sampled rows), one transfer to the device
        flat += [cu_q[i + 1] - 1 for i in rows]
        step = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        batch = AttnBatch(cu_q, context_lens, block_tables, step[2 * T : 3 * T])
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(batch, T) if graphs is not None else None
        with torch.inference_mode():
            if bucket is not None:
                hidden = graphs.run(bucket, step[: 3 * T], batch)
            else:
                hidden = self.model.forward(step[:T], step[T : 2 * T], batch, kv)
            if not rows:
                return []
            logits = self.model.compute_logits(hidden.index_select(0, step[3 * T :]))
            seqs = [sched.scheduled[i].seq for i in rows]
            return self._sample(logits, seqs)

    def _small_threads(self, n: int | None) -> int | None:
        if n is not None and n < 1:
            raise ValueError(f"small_step_threads must be >= 1, got {n}")
        return n if self.device.type == "cpu" else None

    @staticmethod
    def _threads(n: int | None) -> int:
        """The team every step runs with (``_step_threads`` sets it on the stepping thread): ``n``, else the
        constructing thread's count (``build_engine`` sets the configured one there just before)."""
        n = n if n is not None else torch.get_num_threads()
        if n < 1:
            raise ValueError(f"intra_op_threads must be >= 1, got {n}")
        return n

    def _step_threads(self, tokens: int) -> None:
        """Give the stepping thread its own intra-op thread count: ``intra_op_threads``, or ``small_step_threads``
        for a step of at most SMALL_STEP_TOKENS tokens (a decode step is ~150 short parallel regions, each
        ending at a team barrier, where a prefill chunk's regions are long).

        Why every step and not once at start-up: ``torch.set_num_threads`` on one thread also sets the default
        of every thread that never called it. The host KV tier's and the transfer scheduler's workers set 1
        for themselves (their copies run single-threaded), so an executor thread that relied on the default ran
        every step with one thread (the default stack's decode at 0.69x of the same stack with the
        host KV tier off). Once this thread has set its own count, others' calls no longer change it, so this
        is one ``get_num_threads`` a step (``intra_op.set_thread_count``). Mutates torch's thread count for the
        calling thread (and the default of threads that never ran a parallel op)."""
        want = self.intra_op_threads
        if self.small_step_threads is not None and tokens <= SMALL_STEP_TOKENS:
            want = self.small_step_threads
        set_thread_count(want)

    def _phases_scheduled(self, sched: SchedulerOutput, now: float) -> None:
        """Move the phase clocks the schedule changed — preempted calls lose time from ``now`` until
        they have recomputed what they had (their next token); newly admitted ones start their prefill.
        Mutates: the scheduled and preempted sequences' ``phases``."""
        for rid in sched.preempted:
            st = self._requests.get(rid)
            if st is not None and st.seq.phases is not None:
                st.seq.phases.enter(Phase.PREEMPTED, now)
        for sc in sched.scheduled:
            ph = sc.seq.phases
            if ph is not None and ph.phase is Phase.ENGINE_QUEUE:
                ph.enter(Phase.PREFILL, now)

    def _flat_batch(self, sched: SchedulerOutput) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """The step's flat token axis as one int list ``ids + positions + slots`` (each ``T`` long), plus
        ``cu_q``, context lengths and block tables (see model/batch.py). Reads the sequences, mutates nothing."""
        P = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q = [0]
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        for sc in sched.scheduled:
            seq, start, end = sc.seq, sc.start, sc.start + sc.num_new_tokens
            pages = seq.pages
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            if end - start == 1:
                slots.append(pages[start // P] * P + start % P)
            else:
                slots += [pages[p // P] * P + p % P for p in range(start, end)]
            cu_q.append(len(ids))
            context_lens.append(end)
            block_tables.append(pages[: cdiv(end, P)])
        return ids + positions + slots, cu_q, context_lens, block_tables

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        """One token per row; a row whose sampling fails gets its exception instead, so one sequence's bad
        parameters end that sequence only. The batched call is tried first; only when it fails
        are the rows sampled one by one (each request's generator draws once either way)."""
        try:
            return list(self.sampler.sample(logits, [s.request_id for s in seqs], [s.sampling for s in seqs]))
        except Exception:  # noqa: BLE001 - isolate the failing rows below
            pass
        out: list[int | Exception] = []
        for i, s in enumerate(seqs):
            try:
                out.append(self.sampler.sample(logits[i : i + 1], [s.request_id], [s.sampling])[0])
            except Exception as e:  # noqa: BLE001 - this sequence fails, the batch goes on
                out.append(e)
        return out

    # ------------------------------------------------------------------ postprocess
    def _postprocess(self, sched: SchedulerOutput, sampled: list[int | Exception]) -> list[RequestOutput]:
        """Per sampled sequence: append, detokenize, stop checks. A failure in any of these (or in its
        sampling) ends that sequence with an error output; the others are unaffected."""
        outputs: list[RequestOutput] = []
        seqs = [sc.seq for sc in sched.scheduled if sc.sample]
        now = attribution_clock()
        for seq, tok in zip(seqs, sampled):
            st = self._requests[seq.request_id]
            try:
                if isinstance(tok, Exception):
                    raise tok
                outputs.append(self._advance(st, tok))
                if not st.finished and seq.phases is not None:
                    seq.phases.enter(Phase.DECODE, now)  # a token exists: it decodes from the end of this step
            except Exception as e:  # noqa: BLE001 - one sequence's failure is its own
                if not st.finished:
                    out = self._finish(st, FinishReason.ERROR, [], "")
                    outputs.append(replace(out, error=f"{type(e).__name__}: {e}"))
        if self.sampler.wants_logprobs:
            outputs = [replace(o, logprobs=self.sampler.pop_logprobs(o.request_id)) for o in outputs]
        return outputs

    def _advance(self, st: _RequestState, tok: int) -> RequestOutput:
        """Append one sampled token to the sequence, release its text, finish it on a stop or a limit.
        Mutates: the sequence, its decoder and stop buffer; on finish, see ``_finish``."""
        seq, sp = st.seq, st.seq.sampling
        seq.append_token(tok)
        self.num_tokens_generated += 1
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
            return self._finish(st, FinishReason.STOP, [tok], st.text.feed(st.decoder.flush(), final=True)[0])
        text, hit_stop = st.text.feed(st.decoder.step([tok]))
        if hit_stop:
            return replace(self._finish(st, FinishReason.STOP, [tok], text), stop_reason=st.text.matched)
        if seq.num_completion_tokens >= sp.max_tokens or seq.num_tokens >= self.max_context:
            more, hit_stop = st.text.feed(st.decoder.flush(), final=True)
            out = self._finish(st, FinishReason.STOP if hit_stop else FinishReason.LENGTH, [tok], text + more)
            return replace(out, stop_reason=st.text.matched) if hit_stop else out
        return RequestOutput(seq.request_id, [tok], text)

    def _finish(self, st: _RequestState, reason: FinishReason, new_ids: list[int], text: str) -> RequestOutput:
        seq = st.seq
        st.finished = True
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
        self.sampler.remove(seq.request_id)
        del self._requests[seq.request_id]
        with self._intake_lock:
            self._live_ids.discard(seq.request_id)
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens, min(seq.num_restored_tokens, seq.num_cached_tokens))
        attribution = seq.phases.stop(attribution_clock()) if seq.phases is not None else None
        return RequestOutput(seq.request_id, new_ids, text, True, reason, usage, attribution=attribution)

    def rebind_model(self, model: LlamaForCausalLM) -> None:
        """Serve with ``model`` from now on (the cold pool rebinds its parameter views onto moved weights):
        the CPU kernels this engine chose (``paged_decode``, ``fused_ops``) go with it. Mutates ``self.model``
        and the new model's kernel attributes; the caller holds no step in flight."""
        model.paged_decode = self.model.paged_decode
        model.prefill_attention = self.model.prefill_attention
        model.split_keys = self.model.split_keys
        model.use_fused_ops(self.model.fused_ops)
        self.model = model
        self.decode_graphs = None  # captured against the old weights

    def _decode_graphs(self, mode: str, own: bool, max_num_seqs: int, max_context: int) -> DecodeGraphs | None:
        """``cuda_graphs``: ``auto`` captures the decode graphs (model/cuda_graphs.py) on a CUDA device when this
        engine owns its weights and KV pool and the layers are not compiled; ``off`` (or any other case) runs
        every step eagerly. Returns the graphs or None; capturing writes slot 0 of the (still empty) pool."""
        if mode not in ("auto", "off"):
            raise ValueError(f"cuda_graphs must be 'auto' or 'off', got {mode!r}")
        if mode == "off" or self.device.type != "cuda" or not own or self.model.dense is not None or not self.model.graph_layers:
            return None
        return DecodeGraphs(self.model, self.kv_cache, max_batch=max_num_seqs,
                            max_context=min(max_context, self.max_context), say=log.info)

    def _paged_decode(self, mode: str) -> bool:
        """Give the model the CPU paged decode kernel (``model/paged_attn.py``) for ``mode`` ``auto`` on a CPU
        (built on first use, cached; None if it cannot be built: gather + SDPA stays) or take it away
        (``off``, or any other device). Sets ``self.model.paged_decode``; returns whether the kernel is on."""
        if mode not in ("auto", "off"):
            raise ValueError(f"paged_decode must be 'auto' or 'off', got {mode!r}")
        kernel = load_kernel() if mode == "auto" and self.device.type == "cpu" else None
        self.model.paged_decode = kernel
        return kernel is not None

    def _deterministic(self, on: bool) -> bool:
        """Batch- and prefix-invariant numerics (config ``deterministic``): every attention query, prefill or
        decode, by the paged decode kernel in fixed chunks of ``DETERMINISTIC_SPLIT_KEYS`` keys
        (``llama._invariant_group``), so a greedy call's tokens do not depend on what shares its steps, on
        whether its prefix was cached or restored, or on the thread count; and a packed model's linears in tiles
        of at most 16 rows through the decode GEMM (``PackedLinear.tiled``: its rows do not depend on the row
        count, oneDNN's bf16 rows do at some shapes). float32 matmuls depend on the row count at every shape (MKL
        picks other kernels by row count), so float32 is refused. Needs the CPU kernel. Sets
        ``self.model.split_keys`` and every packed linear's ``tiled``; returns ``on``. Raises ValueError where it
        cannot hold."""
        self.model.split_keys = 0
        for p in self._packed_linears():
            p.tiled = on
        if not on:
            return False
        if self.device.type != "cpu" or not self.paged_decode:
            raise ValueError("deterministic needs a CPU engine with the paged decode kernel (paged_decode: auto, and it must build)")
        if self.dtype != torch.bfloat16:
            raise ValueError(f"deterministic needs bfloat16 (float32 CPU matmuls change a row's sums with the row count); dtype is {self.dtype}")
        self.model.split_keys = DETERMINISTIC_SPLIT_KEYS
        return True

    def _packed_linears(self) -> list:
        """The model's prepacked linears (model/packed.py), none if it is not packed. Reads only."""
        m = self.model
        if not m.is_packed:
            return []
        out = [m.lm_head_packed]
        for layer in m.model.layers:
            out += [getattr(o, a) for o, a in ((layer.self_attn, "qkv_packed"), (layer.self_attn, "o_packed"))]
            out += [getattr(layer.mlp, a) for a in ("gate_up_packed", "down_packed") if hasattr(layer.mlp, a)]
        return [p for p in out if p is not None]

    def _pack(self, packed_weights: bool | None, own_model: bool, decode_gemm: str = "auto") -> None:
        """Prepack the CPU linears (model/packed.py; mutates the model): None = where measured to pay (bf16 on
        CPU) and only for a model this engine loaded itself (an arena-bound model's weights are rewritten in place).
        ``decode_gemm`` ``auto``: packed linears also get the decode-step kernel where the CPU has AVX-512 BF16
        (model/decode_gemm.py); ``off``: oneDNN for every step. Sets ``self.decode_gemm``: whether the (now) packed
        model runs it, read from the model, so a model packed before it came here is reported as it is."""
        if decode_gemm not in ("auto", "off"):
            raise ValueError(f"decode_gemm must be 'auto' or 'off', got {decode_gemm!r}")
        if packed_weights is None:
            packed_weights = own_model and can_pack(self.device, self.dtype)
        if packed_weights and not self.model.is_packed:
            self.model.pack_weights(load_decode_gemm() if decode_gemm == "auto" and self.device.type == "cpu" else None)
        self.decode_gemm = self.model.is_packed and self.model.lm_head_packed.gemm is not None  # what the model runs

    def _log_kernels(self) -> None:
        """On a CPU, log once which path each kernel takes (operators ask which ISA serves). Mutates nothing."""
        if self.device.type != "cpu":
            return
        pa = self.model.prefill_attention
        log.info("%s CPU kernels: paged decode %s, fused ops %s, prefill attention %s, decode GEMM %s", self.model_id,
                 "on" if self.paged_decode else "off (gather + SDPA)", "on" if self.fused_ops else "off (eager)",
                 self.prefill_isa if pa is not None else "off (ATen flash)", "on" if self.decode_gemm else "off (oneDNN)")

    def kernels(self) -> tuple[tuple[str, str], ...]:
        """(kernel, what runs) for the heartbeat: on a CPU each C++ kernel is ``on`` or ``off (<the
        fallback> ...)`` with the build error when the extension did not build; on CUDA one ``device`` row.
        Reads only."""
        if self.device.type != "cpu":
            return (("device", f"{self.device.type} (ATen / SDPA kernels)"),)
        from services.engine.model.paged_attn import build_error

        err = build_error()
        why = f"; build failed: {err}" if err else ""
        pa = self.model.prefill_attention is not None
        return (
            ("paged_decode", "on" if self.paged_decode else f"off (gather + SDPA{why})"),
            ("fused_ops", "on" if self.fused_ops else f"off (eager ops{why})"),
            ("prefill_attention", f"on ({self.prefill_isa})" if pa else f"off (ATen flash{why or '; not applicable to this CPU, dtype or head dim'})"),
            ("decode_gemm", "on" if self.decode_gemm else f"off (oneDNN{why})"),
        )

    def _prefill_attention(self, mode: str) -> bool:
        """Give the model the CPU prefill attention kernel (``model/prefill_attn.py``) for ``mode`` ``auto`` on a
        CPU with AMX-BF16 or AVX-512 BF16 (the fastest it has) serving a bf16 model with head dim 64 (else ATen's flash kernel stays), or take it
        away (``off``). Sets ``self.model.prefill_attention``; returns whether the kernel is on."""
        if mode not in ("auto", "off"):
            raise ValueError(f"prefill_attention must be 'auto' or 'off', got {mode!r}")
        usable = mode == "auto" and prefill_applies(self.device, self.dtype, self.config.head_dim)
        available = prefill_isas() if usable else []
        kernel = load_prefill_kernel(available[0]) if available else None
        self.model.prefill_attention = kernel
        self.prefill_isa = available[0] if kernel is not None else None
        return kernel is not None

    def _fused_ops(self, mode: str) -> bool:
        """Give the model the fused elementwise CPU ops (``model/fused_ops.py``) for ``mode`` ``auto`` on a
        CPU (the paged-attention extension, built on first use; eager ops if it cannot be built) or take
        them away (``off``, or any other device). Mutates the model's modules; returns whether they are on."""
        if mode not in ("auto", "off"):
            raise ValueError(f"fused_ops must be 'auto' or 'off', got {mode!r}")
        ops = load_fused_ops() if mode == "auto" and self.device.type == "cpu" else None
        self.model.use_fused_ops(ops)
        return ops is not None

    def _kv_pages(self, num_pages: int | None, kv_cache: KVCache | None, kv_cache_bytes: int | None, max_num_seqs: int) -> int:
        """The KV pool's page count: the given cache's, else ``num_pages``, else what ``kv_cache_bytes`` (or
        the machine-sized budget of ``memory.py``, capped at ``max_num_seqs`` full contexts) holds."""
        cfg, page_size = self.config, self.page_size
        if kv_cache is not None:
            num_pages = kv_cache.k[0].shape[0] // page_size
        if num_pages is None:
            page_bytes = lookup(cfg.architecture).kv_shape(cfg).page_bytes(page_size, self.dtype.itemsize)
            budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_cache_bytes(self.device)
            num_pages = budget // page_bytes
            if kv_cache_bytes is None:  # no explicit size: no more than max_num_seqs full contexts
                num_pages = min(num_pages, max_num_seqs * cdiv(cfg.attention_span, page_size))
                log.info("KV pool sized to the machine: %d pages (%.0f MiB; engine.kv_cache_mb sets it)", num_pages, num_pages * page_bytes / 2**20)
        if num_pages < 1:
            raise ValueError(f"KV pool too small: {num_pages} pages")
        return int(num_pages)

    # ------------------------------------------------------------------ introspection
    def _record_timing(self, sched: SchedulerOutput, dt: float) -> None:
        a = 0.2  # 0.0 = not measured yet
        if all(sc.is_decode for sc in sched.scheduled):
            self._decode_step = ewma(self._decode_step or None, dt, a)
        else:
            self._prefill_per_token = ewma(self._prefill_per_token or None, dt / max(sched.num_batched_tokens, 1), a)
        self._record_curves(sched, dt)

    def _record_curves(self, sched: SchedulerOutput, dt: float) -> None:
        """A decode-only step measures the decode step at its batch size; a step that prefills
        measures the prefill cost per token at the token-weighted mean position of its prefill chunks, after
        the decode share predicted for its decodes. Mutates: the curves and ``step_samples``."""
        decodes = sum(1 for sc in sched.scheduled if sc.is_decode)
        pre = [sc for sc in sched.scheduled if not sc.is_decode]
        if not pre:
            self.decode_curve.observe(decodes, dt)
            self.step_samples.append(("decode", float(decodes), dt))
            return
        tokens = sum(sc.num_new_tokens for sc in pre)
        pos = sum(sc.num_new_tokens * (sc.start + sc.num_new_tokens / 2) for sc in pre) / tokens
        rest = dt - (self.decode_curve.value(decodes) if decodes else 0.0)
        if rest <= 0:
            return  # the step was no slower than its decodes alone: it does not identify the prefill cost
        per_token = rest / tokens
        self.prefill_curve.observe(pos, per_token)
        self.step_samples.append(("prefill", pos, per_token))

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
            session_pages=kv.num_session_pages, prefix_hit_rate=kv.hit_rate, tokens_generated=self.num_tokens_generated,
            num_preemptions=sch.num_preemptions, num_steps=self.num_steps, max_context=self.max_context,
            models=(ModelStats(self.model_id, True, True, False, self.max_context, running, waiting, profile=costs,
                               max_token_bytes=getattr(self.tokenizer, "max_token_bytes", 0)),),
            sessions=tuple(sessions), profile=costs, host_kv=hk is not None,
            kv_restore_verify_failures=hk.counters["restore_verify_failures"] if hk is not None else 0,
            kernels=self.kernels(),
            host_kv_counters=((self.model_id, tuple(hk.counters.items())),) if hk is not None else (),
        )

    def cost_stats(self) -> CostStats:
        """Measured prefill / decode / restore costs (0.0 = not measured yet)."""
        rpt = self.host_kv.restore_per_token.value if self.host_kv is not None else 0.0
        return CostStats(self._prefill_per_token, self._decode_step, rpt,
                         prefill_by_context=tuple(self.prefill_curve.points()), decode_by_batch=tuple(self.decode_curve.points()))

    def session_info(self, session_id: str) -> SessionInfo | None:
        """Where the session's KV is: on the device (its cached entry), else in the host store, else None."""
        return self.residency.where(session_id)

    def kv_port(self) -> KvPort:
        """What a host KV tier needs of this engine (``kv/port.py``): its KV manager, its pool and the pool's
        page layout, and its measured prefill cost. Pure: builds the port, mutates nothing."""
        cfg = self.config
        shape = (2, cfg.num_hidden_layers, self.page_size, cfg.num_key_value_heads, cfg.head_dim)
        return KvPort(self.model_id, self.kv, self.kv_cache, shape, self.dtype, lambda: self._prefill_per_token, self.model_dir)

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

    def end_session(self, session_id: str, tenant: str = "", token_ids: Sequence[int] = ()) -> int:
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
