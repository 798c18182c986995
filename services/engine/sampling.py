"""Token sampling for a batch of requests with different parameters.

Design: logits arrive as float32 ``[n, vocab]``. Greedy rows (temperature 0) take the argmax. Other rows
are scaled by their temperature, filtered by top-k (keep the k largest) and top-p (keep the smallest set
of most likely tokens whose probability mass reaches p; the most likely token is always kept), and drawn
from their own ``torch.Generator``. Every request has its own generator, seeded from
``SamplingParams.seed`` or, without one, deterministically from the request id, so a request's tokens do
not depend on which other requests share its batch, and a preempted/recomputed request continues the
same random stream (one draw per sampled token).

Constrained rows (structured output, ``SamplingParams.grammar``; see ``grammar.py``): each such request has
an xgrammar matcher; before sampling, only those rows get their disallowed tokens masked to -inf (XGrammar
§3's per-step token bitmask), and the sampled token is then advanced through the matcher. Rows without a
grammar are not touched, so an unconstrained batch pays nothing. A matcher error ends nothing but its own
row's constraint (it is logged and dropped). A reasoning model's constrained call (``SamplingParams.reasoning_gate``)
is masked only outside its reasoning: its first token may also be ``<think>``, and from there to ``</think>``
nothing is masked and the matcher sees nothing (``talaria/reasoning_parsers.ReasoningGate``). A reasoning
that has used its ``thinking_token_budget`` gets its close marker forced (every other logit -inf).

Logit shaping (rows whose params ask for it; others untouched): ``logit_bias`` is added; the repetition
penalty (Keskar et al., 2019, CTRL §4.1) divides positive / multiplies negative logits of tokens seen in the
prompt or output; OpenAI's frequency and presence penalties subtract ``count * f + (count > 0) * p`` for
tokens in the output. The sampler keeps each such request's token history itself (it sees every token it
draws). ``min_p`` drops tokens whose probability is below ``min_p`` times the top token's (after
temperature), before top-k/top-p.

Log-probabilities (``SamplingParams.logprobs >= 0``): of the model's distribution (log-softmax of the raw
logits, before penalties, grammar masks and temperature), for the sampled token and the k most likely;
kept until the executor collects them with :meth:`Sampler.pop_logprobs`.

Temperatures below ``MIN_TEMPERATURE`` are greedy: dividing logits by 1e-45 overflows to inf/nan, which
would fail the whole batch's draw.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import torch

from services.engine.types import SamplingParams
from talaria.reasoning_parsers import ReasoningGate

log = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-5


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < MIN_TEMPERATURE


def derive_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


class Sampler:
    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, object] = {}  # request id -> xgrammar GrammarMatcher (constrained requests)
        self._gates: dict[str, ReasoningGate] = {}  # request id -> where its reasoning is (grammar after reasoning)
        self._history: dict[str, tuple[set[int], dict[int, int]]] = {}  # logit-shaping requests: (prompt ids, output counts)
        self._logprobs: dict[str, list] = {}  # request id -> entries not yet collected (outlive remove())

    def add(self, request_id: str, params: SamplingParams, prompt_token_ids: Sequence[int] = ()) -> None:
        """Create the request's generator (none for greedy requests), grammar matcher (if constrained) and
        token history (if it shapes logits)."""
        if params.shapes_logits and request_id not in self._history:
            self._history[request_id] = (set(prompt_token_ids), {})
        if params.grammar is not None and request_id not in self._matchers:
            import xgrammar as xgr

            self._matchers[request_id] = xgr.GrammarMatcher(params.grammar)
        if params.reasoning_gate is not None and request_id not in self._gates:
            self._gates[request_id] = ReasoningGate(*params.reasoning_gate)
        if is_greedy(params):
            return
        g = torch.Generator(device=self.device)
        g.manual_seed(params.seed if params.seed is not None else derive_seed(request_id))
        self._generators[request_id] = g

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._gates.pop(request_id, None)
        self._history.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._generators)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]) -> list[int]:
        """One token per row of ``logits`` (``[n, vocab]``), row ``i`` for ``request_ids[i]``."""
        n, vocab = logits.shape
        if n == 0:
            return []
        logits = logits.float()
        lp_rows = [i for i, p in enumerate(params) if p.logprobs >= 0]
        raw = torch.log_softmax(logits.index_select(0, torch.tensor(lp_rows, device=logits.device)), dim=-1) if lp_rows else None
        shaped = [i for i, p in enumerate(params) if p.shapes_logits]
        for i in shaped:
            self._shape(logits[i], request_ids[i], params[i])
        constrained = [i for i, rid in enumerate(request_ids) if rid in self._matchers] if self._matchers else []
        gated = [i for i, rid in enumerate(request_ids) if rid in self._gates] if self._gates else []
        masked = [i for i in constrained if (gate := self._gates.get(request_ids[i])) is None or gate.constrained] if gated else constrained
        if masked:
            self._mask(logits, [request_ids[i] for i in masked], masked)
        for i in gated:
            gate = self._gates[request_ids[i]]
            if gate.must_close:  # the reasoning's budget is spent: its close marker, whatever the row's sampling
                logits[i].fill_(float("-inf"))
                logits[i, gate.close_id] = 0.0
        out = torch.argmax(logits, dim=-1)
        rows = [i for i, p in enumerate(params) if not is_greedy(p)]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sub = logits.index_select(0, idx)
            temps = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=torch.float32)
            top_k = torch.tensor(
                [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows], device=logits.device
            )
            top_p = torch.tensor([min(max(params[i].top_p, 0.0), 1.0) for i in rows], device=logits.device)
            scaled = sub / temps.unsqueeze(1)
            min_p = [params[i].min_p for i in rows]
            if any(min_p):
                scaled = apply_min_p(scaled, torch.tensor(min_p, device=logits.device, dtype=torch.float32))
            probs = filtered_probs(scaled, top_k, top_p)
            for j, i in enumerate(rows):
                g = self._generators.get(request_ids[i])
                if g is None:  # sample() without add(): create it lazily
                    self.add(request_ids[i], params[i])
                    g = self._generators[request_ids[i]]
                out[i] = torch.multinomial(probs[j], 1, generator=g)[0]
        tokens = out.tolist()
        for j, i in enumerate(lp_rows):
            k = min(params[i].logprobs, 20)
            top = torch.topk(raw[j], k) if k else None
            alts = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            self._logprobs.setdefault(request_ids[i], []).append((tokens[i], float(raw[j, tokens[i]]), alts))
        answer = {i: self._gates[request_ids[i]].feed(tokens[i]) for i in gated}  # False: a token of the reasoning
        for i in constrained:
            if answer.get(i, True):  # the grammar's matcher sees only the answer
                self._advance(request_ids[i], tokens[i])
        for i in shaped:
            h = self._history.get(request_ids[i])
            if h is not None:
                h[1][tokens[i]] = h[1].get(tokens[i], 0) + 1
        return tokens

    @property
    def wants_logprobs(self) -> bool:
        return bool(self._logprobs)

    def pop_logprobs(self, request_id: str) -> list | None:
        """The entries of ``request_id`` collected since the last call (and forget them)."""
        return self._logprobs.pop(request_id, None)

    def _shape(self, row: torch.Tensor, rid: str, p: SamplingParams) -> None:
        """Penalties and bias on one row of logits, in place."""
        prompt, counts = self._history.setdefault(rid, (set(), {}))
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype))
        if p.repetition_penalty != 1.0:
            seen = prompt | counts.keys()
            if seen:
                ids = torch.tensor(sorted(seen), dtype=torch.long)
                v = row.index_select(0, ids)
                row.index_copy_(0, ids, torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and counts:
            ids = torch.tensor(list(counts), dtype=torch.long)
            c = torch.tensor(list(counts.values()), dtype=row.dtype)
            row.index_add_(0, ids, -(c * p.frequency_penalty + p.presence_penalty))

    def _mask(self, logits: torch.Tensor, rids: list[str], rows: list[int]) -> None:
        """Mask the constrained ``rows`` of ``logits`` in place to their grammars' allowed tokens."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(logits), logits.shape[-1])
        live = []
        for rid, i in zip(rids, rows):
            m = self._matchers[rid]
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)
                live.append(i)
                gate = self._gates.get(rid)
                if gate is not None and gate.state == "start":  # the first token may open the reasoning instead
                    word, bit = divmod(gate.open_id, 32)
                    bitmask[i, word] |= 1 << bit  # torch stores bit 31 as the int32 sign bit
        if live:
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=live)

    def _advance(self, rid: str, token: int) -> None:
        m = self._matchers.get(rid)
        if m is not None and not m.is_terminated() and not m.accept_token(token):
            log.warning("request %s: token %d rejected by its grammar; constraint dropped", rid, token)
            self._matchers.pop(rid, None)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Logits with tokens below ``min_p`` times the row's top probability set to -inf (rows with 0 kept)."""
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after top-k and top-p filtering, per row. ``top_k`` in [1, vocab], ``top_p`` in [0, 1]."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
    drop = (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
