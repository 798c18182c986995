"""CUDA graphs of decode steps.

Design note. On a GPU a decode step of a small model is bound by launches, not by math: a step of
``small-llama`` (bench engine's default) is ~15 kernels per layer of a few microseconds each, every one behind
Python dispatch and a launch. A CUDA graph (PyTorch's ``torch.cuda.CUDAGraph``; the decode graphs of vLLM
and SGLang) records one step's kernels once and replays them with one launch. A graph fixes every shape
and address, so decode steps are bucketed:

* *batch buckets* 1, 2, 4, 8, ... up to ``max_batch``: a step of ``B`` sequences replays the smallest bucket
  ``>= B``; its padding rows repeat row 0 exactly (same token, position, KV slot and context), so their K/V
  writes put the same bytes in the same slot and their outputs are dropped;
* *context buckets* (tokens) 256, 1024, 4096, ... up to ``max_context`` (longer contexts run eagerly): the
  keys are gathered from the paged pool through the block tables padded to the bucket's pages and masked by
  each sequence's length (and the sliding window) inside the graph.

Per bucket, static device buffers hold the step's inputs: ids / positions / write slots (one device copy from
the executor's step tensor) and the int64 block tables + lengths (one host -> device copy). The expansion of
tables into slots, the mask, every layer and the final norm are in the graph; the lm_head and sampling stay
outside (they see only the rows that sample). Graphs share one memory pool and are captured once, at start,
largest first, against the engine's own weights, KV pool and RoPE table, which this object keeps referenced so
that they are never freed. A model whose weights move (the cold pool rebinds its views) or whose layers are
gated (streaming hot-swap) or compiled runs eagerly: :meth:`DecodeGraphs.bucket_for` says None.

What it mutates: capturing writes the warm-up's K/V into slot 0 of the pool (the engine captures before any
sequence exists); :meth:`DecodeGraphs.run` writes the step's new K/V (like ``forward``) and the static buffers.
``capture=False`` runs the same bucketed body eagerly (the CPU tests check it against ``forward``).

Measured (bench/device-check on an H200, 2026-12-04; ``talaria bench engine --device cuda:0``, small-llama,
median of 3, same engine with ``cuda_graphs: off`` side by side): decode fp32 batch 1 232 -> 1,270 tok/s
(5.5x), batch 8 1,641 -> 6,680 (4.0x), bf16 batch 8 1,143 -> 6,969 (6.1x); identical greedy tokens.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .batch import AttnBatch, KVCache
from .llama import LlamaForCausalLM, _AttnPlan, _Group, pad_table

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT_BUCKETS = (256, 1024, 4096, 16384, 65536)
DEFAULT_MAX_CONTEXT = 8192  # tokens; a [batch, context] gather per layer bounds the graphs' memory


def _ladder(limit: int, steps: tuple[int, ...]) -> list[int]:
    """The steps below ``limit``, then ``limit`` itself (every size up to ``limit`` has a bucket)."""
    return [s for s in steps if s < limit] + [limit]


class _Bucket:
    """Static buffers and the graph of one (batch, pages) bucket. ``iv``: ``[3, batch]`` ids | positions |
    write slots; ``tl``: ``[batch, pages + 1]`` block tables | context length; ``out``: the graph's output."""

    __slots__ = ("batch", "pages", "iv", "tl", "out", "graph")

    def __init__(self, batch: int, pages: int, device: torch.device) -> None:
        self.batch, self.pages = batch, pages
        self.iv = torch.zeros(3, batch, dtype=torch.int64, device=device)
        self.tl = torch.zeros(batch, pages + 1, dtype=torch.int64, device=device)
        self.tl[:, pages] = 1  # warm-up: every row one token of context at slot 0
        self.out: torch.Tensor | None = None
        self.graph = None


class DecodeGraphs:
    """Captured decode steps of one model over one KV pool (see the module note)."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, *, max_batch: int, max_context: int = DEFAULT_MAX_CONTEXT,
                 capture: bool = True, context_buckets: tuple[int, ...] = CONTEXT_BUCKETS,
                 say: Callable[[str], None] | None = None) -> None:
        if max_batch < 1 or max_context < 1:
            raise ValueError(f"max_batch and max_context must be >= 1, got {max_batch}, {max_context}")
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        self.model, self.kv, self.page_size = model, kv, kv.page_size
        self.window = model.config.sliding_window
        P = self.page_size
        self.page_buckets = [-(-c // P) for c in _ladder(max_context, context_buckets)]
        self.batch_buckets = _ladder(max_batch, BATCH_BUCKETS)
        self.max_batch, self.max_context = max_batch, self.page_buckets[-1] * P
        self._keys = torch.arange(self.max_context, device=self.device)
        self._page_offsets = torch.arange(P, device=self.device)
        self._q_index = torch.arange(self.batch_buckets[-1], device=self.device)
        with torch.inference_mode():  # the RoPE table of every captured position, built now and kept
            model._rope(self._keys[:1], weight.dtype, self.max_context - 1)
        self._rope_keep = model._rope_table[(self.device, weight.dtype)]
        self.captured = capture
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        t0 = time.perf_counter()
        for B in reversed(self.batch_buckets):  # largest first: later graphs reuse its pool memory
            for W in reversed(self.page_buckets):
                self._buckets[(B, W)] = self._build(B, W)
        if say is not None and capture:
            say(f"captured {len(self._buckets)} decode CUDA graphs (batch <= {max_batch}, context <= "
                f"{self.max_context} tokens) in {time.perf_counter() - t0:.1f} s")

    def _body(self, b: _Bucket) -> torch.Tensor:
        """One bucketed decode forward over ``b``'s buffers (what a graph records)."""
        P, n = self.page_size, b.tl[:, b.pages : b.pages + 1]
        slots = (b.tl[:, : b.pages, None] * P + self._page_offsets).view(b.batch, b.pages * P)
        keys = self._keys[: b.pages * P][None, :]
        mask = keys < n
        if self.window is not None:  # the query is at n - 1: keys n - window .. n - 1
            mask &= keys >= n - self.window
        group = _Group("decode", self._q_index[: b.batch], slots, mask[:, None, None, :])
        plan = _AttnPlan.of_group(b.iv[2], group)
        return self.model.run_planned(b.iv[0], b.iv[1], plan, self.kv, self.max_context - 1)

    @torch.inference_mode()
    def _build(self, batch: int, pages: int) -> _Bucket:
        b = _Bucket(batch, pages, self.device)
        if not self.captured:
            return b
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture (lazy inits, cuBLAS workspaces)
            for _ in range(2):
                self._body(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            b.out = self._body(b)
        b.graph = graph
        return b

    def bucket_for(self, batch: AttnBatch, num_tokens: int) -> _Bucket | None:
        """The bucket a step replays, or None when it must run eagerly: not every sequence decodes one token,
        more sequences or a longer context than captured, or the model's layers are gated or compiled."""
        B = batch.num_seqs
        if num_tokens != B or B > self.max_batch or self.model.layer_gate is not None or self.model.dense is not None:
            return None
        need = -(-max(batch.context_lens) // self.page_size)
        if need > self.page_buckets[-1]:
            return None
        Bb = next(x for x in self.batch_buckets if x >= B)
        W = next(x for x in self.page_buckets if x >= need)
        return self._buckets[(Bb, W)]

    @torch.inference_mode()
    def run(self, b: _Bucket, ivs: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        """Replay ``b`` for ``batch``: ``ivs`` is the step's ``[3 * B]`` ids | positions | write slots on the
        device. Returns ``[B, hidden]`` final-normed hidden states -- a view of the graph's output, valid until
        the next run. Writes the new K/V into the pool and the bucket's buffers."""
        B, W = batch.num_seqs, b.pages
        rows = [pad_table(t, W) + [n] for t, n in zip(batch.block_tables, batch.context_lens)]
        rows += [rows[0]] * (b.batch - B)
        b.tl.copy_(torch.tensor(rows, dtype=torch.int64))
        b.iv[:, :B].copy_(ivs.view(3, B))
        if b.batch > B:
            b.iv[:, B:].copy_(b.iv[:, :1].expand(3, b.batch - B))
        self.replays += 1
        if b.graph is None:
            return self._body(b)[:B]
        b.graph.replay()
        return b.out[:B]
