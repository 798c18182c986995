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
thread; ``step``/``generate``/``flush_cache`` serialize on a step lock. ``stats``/``session_info`` read a
snapshot refreshed after every step, so they never wait for a forward.
"""

from __future__ import annotations


import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from services.engine.api import (  # noqa: F401 - the error classes are part of this module's interface
    ContextLengthError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingError,
    ModelInfo,
    UnknownModelError,
    UnsupportedOperationError,
)
from services.engine.kv.manager import KVManager, cdiv
from services.engine.kv.allocator import PageAllocator
from services.engine.model.batch import AttnBatch, KVCache
from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaForCausalLM
from services.engine.model.loader import allocate_kv_cache, load_model
from services.engine.sampling import Sampler
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.sequence import Sequence
from services.engine.tokenizer import IncrementalDecoder, Tokenizer
from services.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams, Usage
from talaria.ewma import ewma
from talaria.hashing import model_salt, tenant_salt

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


class StopStringBuffer:
    """Generated text with stop-string handling: ``feed`` returns the text that can be released.

    Text that could be the beginning of a stop string is held back (unless ``final``); when a stop string
    completes, the text is truncated before it, the rest is dropped and ``hit`` is reported.
    """

    __slots__ = ("stops", "text", "released")

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.released = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        self.text += delta
        text, start = self.text, self.released
        if self.stops:
            longest = max(len(s) for s in self.stops)
            search_from = max(0, start - longest + 1)
            hits = [i for i in (text.find(s, search_from) for s in self.stops) if i >= 0]
            if hits:
                cut = max(min(hits), start)
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


class Engine:
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
        session_cache_entries: int = 256,
        session_cache_pages: int | None = None,
        model_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        model: tuple[LlamaForCausalLM, ModelConfig] | None = None,
        kv_cache: KVCache | None = None,
        tokenizer: Tokenizer | None = None,
        page_allocator: PageAllocator | None = None,
    ) -> None:
        # ``model``/``kv_cache``/``tokenizer``/``page_allocator`` let a caller that owns device memory (the
        # cold pool's arena, services/engine/substrate) bind this runtime onto existing tensors instead of
        # loading and allocating; ``kv_cache`` then fixes the page count.
        self.model_dir = Path(model_dir)
        self.model_id = model_id or self.model_dir.name
        self.device = torch.device(device)
        self.model, self.config = model if model is not None else load_model(self.model_dir, device=self.device, dtype=dtype)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(self.model_dir)
        self.vocab_size = self.config.vocab_size
        self.page_size = page_size
        cfg = self.config
        if kv_cache is not None:
            num_pages = kv_cache.k[0].shape[0] // page_size
        if num_pages is None:
            page_bytes = 2 * cfg.num_hidden_layers * page_size * cfg.num_key_value_heads * cfg.head_dim * self.dtype.itemsize
            budget = kv_cache_bytes if kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
            num_pages = budget // page_bytes
            if kv_cache_bytes is None:  # no explicit size: no more than max_num_seqs full contexts
                num_pages = min(num_pages, max_num_seqs * cdiv(cfg.attention_span, page_size))
        if num_pages < 1:
            raise ValueError(f"KV pool too small: {num_pages} pages")
        self.num_pages = int(num_pages)
        self.kv_cache = kv_cache if kv_cache is not None else allocate_kv_cache(cfg, self.num_pages, page_size, self.device, self.dtype)
        self.max_context = min(cfg.attention_span, self.num_pages * page_size)
        self.eos_token_ids = frozenset(cfg.eos_token_id) | frozenset(self.tokenizer.eos_token_ids)
        self.salt = model_salt(self.model_id)
        self.kv = KVManager(
            self.num_pages, page_size, salt=self.salt, clock=clock,
            session_entries=session_cache_entries, session_max_pages=session_cache_pages, allocator=page_allocator,
        )
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.sampler = Sampler(self.device)
        self._clock = clock

        self._intake_lock = threading.Lock()
        self._pending: list[EngineRequest] = []
        self._pending_aborts: list[str] = []
        self._live_ids: set[str] = set()  # queued or in flight (guarded by _intake_lock)
        self._step_lock = threading.RLock()
        self._requests: dict[str, _RequestState] = {}
        self._session_info: dict[str, dict[str, Any]] = {}
        self._gen_ids = itertools.count()
        self.num_tokens_generated = 0
        self.num_steps = 0
        self._prefill_per_token = 0.0
        self._decode_step = 0.0
        self._snapshot: dict[str, Any] = {}
        self.host_kv = None  # host KV tier (host_kv.HostKV), see attach_host_kv
        self._refresh_snapshot()


    # ------------------------------------------------------------------ the catalog (of one model)
    def serves(self, model: str) -> bool:
        return model == self.model_id

    def info(self, model: str) -> ModelInfo:
        if model != self.model_id:
            raise UnknownModelError(f"this instance serves only {self.model_id!r}, not {model!r}")
        return ModelInfo(self.model_id, self.tokenizer, self.vocab_size, self.max_context)

    def open_model(self, model: str) -> None:
        raise UnsupportedOperationError("a hot instance serves one pinned model: it cannot open another")

    def close_model(self, model: str) -> None:
        raise UnsupportedOperationError("a hot instance serves one pinned model: it cannot close it")

    def take_switch_records(self) -> list:
        return []

    def recent_switch_records(self, n: int) -> list:
        return []

    def take_round_summaries(self) -> list:
        return []

    # ------------------------------------------------------------------ intake (any thread)
    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue ``req``; it is admitted at the next ``step()``. Raises InvalidRequestError."""
        validate_request(req, self.max_context, self.vocab_size)
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

    def pending_requests(self) -> list[EngineRequest]:
        """Requests queued by ``add_request`` and not yet admitted by a step (a copy; any thread)."""
        with self._intake_lock:
            return list(self._pending)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        with self._step_lock:
            if self.host_kv is not None:
                self.host_kv.poll()  # transfer pins of finished device->host checkpoint copies
            outputs = self._drain_intake()

            sched = self.scheduler.schedule()
            if not sched.is_empty:
                t0 = time.perf_counter()
                sampled = self._execute(sched)
                self._record_timing(sched, time.perf_counter() - t0)
                outputs += self._postprocess(sched, sampled)
            self.num_steps += 1
            self._refresh_snapshot()
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
            seq.salt = tenant_salt(self.salt, req.tenant)  # issue 17: tenants never share a hash chain
            seq.trace_context = req.trace_context
            dec = self.tokenizer.incremental_decoder(req.prompt_token_ids)
            self._requests[req.request_id] = _RequestState(seq, dec, StopStringBuffer(req.sampling.stop))
            self.sampler.add(req.request_id, req.sampling, req.prompt_token_ids)
            if self.host_kv is not None:
                seq.num_restored_tokens = self.host_kv.before_admit(seq) * self.page_size  # host prefix -> radix cache
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
        rows = [i for i, sc in enumerate(sched.scheduled) if sc.sample]
        # one host tensor (ids | positions | slots | sampled rows), one transfer to the device
        flat += [cu_q[i + 1] - 1 for i in rows]
        step = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        batch = AttnBatch(cu_q, context_lens, block_tables, step[2 * T : 3 * T])
        with torch.inference_mode():
            hidden = self.model.forward(step[:T], step[T : 2 * T], batch, kv)
            if not rows:
                return []
            logits = self.model.compute_logits(hidden.index_select(0, step[3 * T :]))
            seqs = [sched.scheduled[i].seq for i in rows]
            return self._sample(logits, seqs)

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
        parameters end that sequence only (issue 18). The batched call is tried first; only when it fails
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
        sampling) ends that sequence with an error output; the others are unaffected (issue 18)."""
        outputs: list[RequestOutput] = []
        seqs = [sc.seq for sc in sched.scheduled if sc.sample]
        for seq, tok in zip(seqs, sampled):
            st = self._requests[seq.request_id]
            try:
                if isinstance(tok, Exception):
                    raise tok
                outputs.append(self._advance(st, tok))
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
            return self._finish(st, FinishReason.STOP, [tok], text)
        if seq.num_completion_tokens >= sp.max_tokens or seq.num_tokens >= self.max_context:
            more, hit_stop = st.text.feed(st.decoder.flush(), final=True)
            return self._finish(st, FinishReason.STOP if hit_stop else FinishReason.LENGTH, [tok], text + more)
        return RequestOutput(seq.request_id, [tok], text)

    def _finish(self, st: _RequestState, reason: FinishReason, new_ids: list[int], text: str) -> RequestOutput:
        seq = st.seq
        st.finished = True
        if self.host_kv is not None and seq.session_id:
            self.host_kv.checkpoint(seq)  # pins the pages, copies them to the kvstore asynchronously
        self.scheduler.finish(seq, cache=True)

        if seq.session_id:
            self._record_session(seq.session_id)
        self.sampler.remove(seq.request_id)
        del self._requests[seq.request_id]
        with self._intake_lock:
            self._live_ids.discard(seq.request_id)
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens, min(seq.num_restored_tokens, seq.num_cached_tokens))
        return RequestOutput(seq.request_id, new_ids, text, True, reason, usage)

    def _record_session(self, session_id: str) -> None:
        entry = self.kv.sessions.peek(session_id)
        if entry is None:
            self._session_info.pop(session_id, None)
            return
        self._session_info[session_id] = {
            "session_id": session_id,
            "committed_tokens": len(entry.token_ids),
            "full_pages": len(entry.token_ids) // self.page_size,
            "num_pages": len(entry.pages),
            "last_use_unix": time.time(),
        }

    # ------------------------------------------------------------------ introspection
    def _record_timing(self, sched: SchedulerOutput, dt: float) -> None:
        a = 0.2  # 0.0 = not measured yet
        if all(sc.is_decode for sc in sched.scheduled):
            self._decode_step = ewma(self._decode_step or None, dt, a)
        else:
            self._prefill_per_token = ewma(self._prefill_per_token or None, dt / max(sched.num_batched_tokens, 1), a)

    def _refresh_snapshot(self) -> None:
        kv = self.kv
        live = {e.session_id for e in kv.sessions.entries()}
        for sid in list(self._session_info):
            if sid not in live:
                del self._session_info[sid]
        total, free = kv.num_pages, kv.num_free_pages
        self._snapshot = {
            "model_id": self.model_id,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting + len(self._pending),
            "kv_pages_total": total,
            "kv_pages_free": free,
            "kv_pages_used": total - free,
            "kv_usage": (total - free) / total,
            "radix_pages": kv.radix.num_pages,
            "session_pages": kv.sessions.num_pages,
            "sessions": [dict(v) for v in self._session_info.values()],
            "prefix_hit_rate": kv.hit_rate,
            "tokens_generated": self.num_tokens_generated,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "max_context": self.max_context,
            "profile": {"prefill_per_token": self._prefill_per_token, "decode_step": self._decode_step,
                        **({"restore_per_token": self.host_kv.restore_per_token.value} if self.host_kv is not None else {})},
            "host_kv": self.host_kv.snapshot() if self.host_kv is not None else None,

        }

    def stats(self) -> dict[str, Any]:
        """Snapshot taken after the latest step (safe from any thread)."""
        snap = dict(self._snapshot)
        with self._intake_lock:
            snap["num_unfinished"] = len(self._live_ids)
        return snap

    def session_info(self, session_id: str) -> dict[str, Any] | None:
        """``committed_tokens``, ``full_pages`` … of the session's cached entry, or None."""
        for s in self._snapshot.get("sessions", []):
            if s["session_id"] == session_id:
                return dict(s)
        return None

    def attach_host_kv(self, host_kv) -> None:
        """Use a host KV tier (``services.engine.host_kv.HostKV``): checkpoint session pages when calls end,
        restore prefixes from it when calls arrive."""
        with self._step_lock:
            self.host_kv = host_kv
            self._refresh_snapshot()

    def attach_retention(self, book) -> None:
        """Evict session entries by predicted return (``kv.retention.RetentionBook``, issue 14)."""
        with self._step_lock:
            self.kv.sessions.retention = book

    def drain_checkpoints(self, timeout: float | None = None) -> bool:
        """Switch barrier (Talaria Appendix B): wait until every outstanding device->host checkpoint copy
        has completed (or been abandoned) and its pages are unpinned. Call before releasing the KV region.
        Returns False if ``timeout`` passed first."""
        with self._step_lock:
            return self.host_kv.drain(timeout) if self.host_kv is not None else True

    def flush_cache(self) -> int:

        """Drop all cached prefixes and session entries not in use. Returns pages freed."""
        with self._step_lock:
            freed = self.kv.flush()
            self._refresh_snapshot()
            return freed

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def check_integrity(self) -> None:
        with self._step_lock:
            self.scheduler.check_integrity()
