"""Token sampling for a batch of requests with different parameters.

Design: logits arrive as float32 ``[n, vocab]``. Greedy rows (temperature 0) take the argmax. Other rows
are scaled by their temperature, filtered by top-k (keep the k largest) and top-p (keep the smallest set
of most likely tokens whose probability mass reaches p; the most likely token is always kept), and drawn
from their own ``torch.Generator``. Every request has its own generator, seeded from
``SamplingParams.seed`` or, without one, deterministically from the request id, so a request's tokens do
not depend on which other requests share its batch, and a preempted/recomputed request continues the
same random stream (one draw per sampled token).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from services.engine.types import SamplingParams


def derive_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


class Sampler:
    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Create the request's generator (no-op for greedy requests)."""
        if params.greedy:
            return
        g = torch.Generator(device=self.device)
        g.manual_seed(params.seed if params.seed is not None else derive_seed(request_id))
        self._generators[request_id] = g

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._generators)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]) -> list[int]:
        """One token per row of ``logits`` (``[n, vocab]``), row ``i`` for ``request_ids[i]``."""
        n, vocab = logits.shape
        if n == 0:
            return []
        logits = logits.float()
        out = torch.argmax(logits, dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
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
        return out.tolist()


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
