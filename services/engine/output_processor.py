"""The output side of one engine's step: logits of the sampled rows -> tokens -> text -> ``RequestOutput``.

Design note. vLLM's v1 engine keeps an output processor apart from its model runner: detokenization, stop
strings and the request outputs never see a tensor layout or a kernel, and the runner never sees text. The
same split here: :class:`OutputProcessor` owns each request's output state (its sampler entry: generator,
penalty history, grammar matcher, logprobs; its incremental detokenizer; its stop-string buffer) from admission
to finish, and turns one step's sampled tokens into outputs. It holds no model, KV pool or scheduler; what
finishing a request does to the engine's pages and caches is the loop's (``executor.Engine``), handed in as
the ``release`` callback, so the order "release the pages, then build the final output" stays one place.

What it mutates: its own request table (``requests``) and sampler; per sampled token the sequence (the token
is appended, ``Sequence.append_token``) and its phase clock (``Phase.DECODE``); the count of generated
tokens. Failure isolation: a row whose sampling, detokenization or stop check raises ends that request with
an error output; the other rows of the step are unaffected.

Hot path: ``process`` runs once per step and ``_advance`` once per sampled token, as the engine's own methods
did before the split (one dict lookup and one call per token; no new objects but the output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from services.engine.sampling import Sampler
from services.engine.sequence import Sequence
from services.engine.types import EngineRequest, FinishReason, RequestOutput, Usage
from talaria.attribution import Phase, attribution_clock
from talaria.tokenizer import IncrementalDecoder, Tokenizer


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
        """Append ``delta`` and return (the text now safe to release, whether a stop string completed).
        Mutates the buffer (its text, release mark and ``matched``)."""
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


@dataclass(slots=True)
class RequestState:
    """One request's output state (the scheduler owns its Sequence; this holds a reference to it)."""

    seq: Sequence
    decoder: IncrementalDecoder
    text: StopStringBuffer
    finished: bool = False


class OutputProcessor:
    """Sampling and output building for the requests of one engine (executor thread only).

    ``release(seq)`` is called once per finishing request, before its final output is built: the loop frees
    its pages, checkpoints its session, and drops it from the live table there."""

    def __init__(self, tokenizer: Tokenizer, sampler: Sampler, eos_token_ids: frozenset[int], max_context: int,
                 release: Callable[[Sequence], None]) -> None:
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self._release = release
        self.requests: dict[str, RequestState] = {}
        self.num_tokens_generated = 0

    def add(self, req: EngineRequest, seq: Sequence) -> None:
        """Start ``req``'s output state: its detokenizer (primed with the prompt), stop buffer and sampler entry.
        Mutates ``requests`` and the sampler."""
        sp = req.sampling
        dec = self.tokenizer.incremental_decoder(req.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens)
        self.requests[req.request_id] = RequestState(seq, dec, StopStringBuffer(sp.stop, sp.include_stop_str_in_output))
        self.sampler.add(req.request_id, sp, req.prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request still in flight with ``ABORT`` (None if it is unknown or finished). Mutates as
        ``_finish``."""
        st = self.requests.get(request_id)
        if st is None or st.finished:
            return None
        return self._finish(st, FinishReason.ABORT, [], "")

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        """One token per row; a row whose sampling fails gets its exception instead, so one sequence's bad
        parameters end that sequence only. The batched call is tried first; only when it fails
        are the rows sampled one by one (each request's generator draws once either way). Call under
        ``torch.inference_mode`` (the sampler shapes rows of ``logits`` in place). Mutates the sampler's
        per-request state (generators, histories, matchers, logprobs)."""
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

    def process(self, seqs: list[Sequence], sampled: list[int | Exception]) -> list[RequestOutput]:
        """Per sampled sequence: append, detokenize, stop checks. A failure in any of these (or in its
        sampling) ends that sequence with an error output; the others are unaffected. Mutates the sequences,
        their output state and phase clocks; finishing ones are released (``release``)."""
        outputs: list[RequestOutput] = []
        now = attribution_clock()
        for seq, tok in zip(seqs, sampled):
            st = self.requests[seq.request_id]
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

    def _advance(self, st: RequestState, tok: int) -> RequestOutput:
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

    def _finish(self, st: RequestState, reason: FinishReason, new_ids: list[int], text: str) -> RequestOutput:
        """The request's final output. Mutates: marks it finished, releases it (``release``: pages, caches, the
        live table), drops its sampler entry and output state, stops its phase clock."""
        seq = st.seq
        st.finished = True
        self._release(seq)
        self.sampler.remove(seq.request_id)
        del self.requests[seq.request_id]
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens, min(seq.num_restored_tokens, seq.num_cached_tokens))
        attribution = seq.phases.stop(attribution_clock()) if seq.phases is not None else None
        return RequestOutput(seq.request_id, new_ids, text, True, reason, usage, attribution=attribution)
