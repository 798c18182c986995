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
row's constraint (it is logged and dropped).

Temperatures below ``MIN_TEMPERATURE`` are greedy: dividing logits by 1e-45 overflows to inf/nan, which
would fail the whole batch's draw (issue 18 item 1).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import torch

from services.engine.types import SamplingParams

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

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Create the request's generator (none for greedy requests) and grammar matcher (if constrained)."""
        if params.grammar is not None and request_id not in self._matchers:
            import xgrammar as xgr

            self._matchers[request_id] = xgr.GrammarMatcher(params.grammar)
        if is_greedy(params):
            return
        g = torch.Generator(device=self.device)
        g.manual_seed(params.seed if params.seed is not None else derive_seed(request_id))
        self._generators[request_id] = g

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._generators)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]) -> list[int]:
        """One token per row of ``logits`` (``[n, vocab]``), row ``i`` for ``request_ids[i]``."""
        n, vocab = logits.shape
        if n == 0:
            return []
        logits = logits.float()
        constrained = [i for i, rid in enumerate(request_ids) if rid in self._matchers] if self._matchers else []
        if constrained:
            self._mask(logits, [request_ids[i] for i in constrained], constrained)
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
            probs = filtered_probs(sub / temps.unsqueeze(1), top_k, top_p)
            for j, i in enumerate(rows):
                g = self._generators.get(request_ids[i])
                if g is None:  # sample() without add(): create it lazily
                    self.add(request_ids[i], params[i])
                    g = self._generators[request_ids[i]]
                out[i] = torch.multinomial(probs[j], 1, generator=g)[0]
        tokens = out.tolist()
        for i in constrained:
            self._advance(request_ids[i], tokens[i])
        return tokens

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
        if live:
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=live)

    def _advance(self, rid: str, token: int) -> None:
        m = self._matchers.get(rid)
        if m is not None and not m.is_terminated() and not m.accept_token(token):
            log.warning("request %s: token %d rejected by its grammar; constraint dropped", rid, token)
            self._matchers.pop(rid, None)


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
