"""The boundary type between the executor (which owns pages) and the model (which only reads/writes them).

A step runs a *flat* batch: the new tokens of every scheduled sequence are concatenated into one
``input_ids``/``positions`` pair, sequence ``i`` owning the half-open range
``[cu_q[i], cu_q[i+1])`` of the flat axis. Sequence ``i`` has ``context_lens[i]`` tokens of context *after*
this step (cached tokens + its new tokens); its KV lives in the pages ``block_tables[i]`` (page ``j`` holds
tokens ``[j*page_size, (j+1)*page_size)``). ``slot_mapping[t]`` is the flat slot
(``page * page_size + offset``) where new token ``t`` writes its K and V.

The model mutates only the KV slots named by ``slot_mapping``; it never allocates pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttnBatch:
    cu_q: list[int]  # len B+1, prefix sums of new-token counts
    context_lens: list[int]  # len B, tokens of context after this step (cached + new)
    block_tables: list[list[int]]  # len B, page ids covering context_lens[i] tokens
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot of each new token

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def last_token_indices(self) -> list[int]:
        """Flat index of the last new token of each sequence (where logits are taken)."""
        return [e - 1 for e in self.cu_q[1:]]


@dataclass(slots=True)
class KVCache:
    """Paged KV storage of one model: per layer, K and V as ``[num_pages * page_size, kv_heads, head_dim]``.

    ``k[l]`` / ``v[l]`` are views into one preallocated tensor so that the pool has stable addresses.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int
