"""Layer groups of a bank image (JointServe §3.1 "independently managed weight layer groups", §4.4).

A model's packed weights image (``bank.py``) lays tensors out in module order: embeddings, layer 0, …,
layer L−1, final norm, LM head. Group ``g`` covers layers ``[g·n, (g+1)·n)``; the embeddings belong to group
0 and the final norm / LM head to the last group, so every byte of the image is in exactly one group and the
groups are contiguous byte ranges in order. A chunk (the unit of staging and copying) belongs to the group
holding its first byte; a group's copy is complete when all of its chunks are. Pure (reads the specs only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    index: int
    layers: range  # decoder layers run by this group
    lo: int  # byte range in the image
    hi: int
    chunks: range  # chunk indices owned by the group

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def layer_groups(entry, layers_per_group: int = 1) -> list[LayerGroup]:
    """The layer groups of a :class:`~services.engine.substrate.bank.BankEntry` (``layers_per_group`` >= 1)."""
    if layers_per_group < 1:
        raise ValueError("layers_per_group must be >= 1")
    n_layers = entry.config.num_hidden_layers
    n_groups = -(-n_layers // layers_per_group)
    starts = [None] * n_groups  # first byte of each group's first layer
    for s in entry.specs:
        m = _LAYER.search(s.name)
        if m is not None:
            g = int(m.group(1)) // layers_per_group
            starts[g] = s.offset if starts[g] is None else min(starts[g], s.offset)
    if any(x is None for x in starts) or starts != sorted(starts):
        raise ValueError(f"model {entry.model!r}: layer tensors are not laid out in layer order")
    bounds = [0] + starts[1:] + [entry.nbytes]
    cb = entry.chunk_bytes
    out = []
    for g in range(n_groups):
        lo, hi = bounds[g], bounds[g + 1]
        c0 = -(-lo // cb)  # first chunk starting at or after lo
        c1 = -(-hi // cb) if g < n_groups - 1 else entry.num_chunks
        out.append(LayerGroup(g, range(g * layers_per_group, min((g + 1) * layers_per_group, n_layers)), lo, hi, range(c0, c1)))
    return out


def group_of_layer(groups: list[LayerGroup], layer: int) -> int:
    for g in groups:
        if layer in g.layers:
            return g.index
    return groups[-1].index  # past the last layer: final norm and LM head
