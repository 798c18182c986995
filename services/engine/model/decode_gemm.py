"""The decode step's linears on AVX-512 BF16: a small-row GEMM kernel (``decode_gemm.cpp``).

Design note ("the hot path"). A decode step multiplies a few rows (``M`` = the step's
sequences, 1-16) by every weight of the model. For SmolLM2-135M that is 270 MB of bf16 weights per step and
2 x M x 135 M flops: at M = 8, 2.2 GFLOP. One core of this machine reads ~23 GB/s (270 MB in ~12 ms) and its
VDPBF16PS units do far more than 100 GFLOP/s, yet oneDNN's prepacked bf16 linear (``packed.py``) ran the
step's matmuls at well under both, because its blocked kernels are built for many rows. This kernel is
the textbook GEMV-shaped schedule for that regime (what llama.cpp's and vLLM's CPU decode kernels do):

* the weight is packed once at load as ``[N / 16, K / 2, 16, 2]`` -- for each block of 16 outputs, the
  k-pairs of its 16 rows side by side, one 64-byte cache line per k-pair -- so the step reads each weight
  exactly once, sequentially, in the order the dot-product instruction consumes it;
* the output columns go in groups of 4 blocks (64 outputs); per group, passes of up to 4 rows keep 4 x 4
  zmm of float32 accumulators in registers, each row's k-pair is broadcast once and ``VDPBF16PS`` adds
  ``w[j][0] * x[k] + w[j][1] * x[k + 1]`` into 16 outputs of each of the 4 blocks; the first pass reads the
  group's weights from memory, later passes (rows 5-32) find them in L2 (a group is 4 x K x 64 bytes: 72 KiB
  at K = 576, 192 KiB at 1,536), so a step reads each weight from memory once whatever its rows (calls with
  more than ``MAX_ROWS`` = 32 rows keep oneDNN);
* the bias is added in float32 and each output rounded to bf16 once (nearest even), as oneDNN does;
* runs of column blocks are spread over torch's threads (``at::parallel_for``).

The schedule before (2026-12-07) was 8 rows x 2 blocks per pass, with the passes of a 16-row step each
streaming every weight from memory: one broadcast fed 2 dot products instead of 4, and 16 rows read the
weights twice. SmolLM2-135M's linears and lm_head per step (2 threads, bf16, interleaved medians of 7, two
sittings on this 2-core VM): 10.7 / 12.3 / 19.7 ms at M = 1 / 8 / 16 before, 10.1 / 12.2 / 17.3 ms after; in
a noisier second sitting 10.6 / 16.5 / 26.3 before, 9.7 / 14.8 / 20.5 after. Outputs bit-identical (each
output's sum runs over k in order in one accumulator either way); 2 x 8 and 8 x 2 groupings measured worse.
With the weights read once per step, the kernel also beats oneDNN's packed linear past 16 rows (per shape,
weights cache-warm: 1.1-1.5x at 24 and 32 rows, the 49k-row lm_head 1.01-1.03x), so ``MAX_ROWS`` went from 16
to 32, the engine's default ``max_num_seqs``: in-process decode steps (SmolLM2-135M bf16, 2 threads, 256-token
prompts, medians of alternating runs in one process) at batch 24 49.8 -> 41.4 ms, at batch 32 60.3 -> 51.3 ms.

Exactness: the products are exact in float32 and summed in float32, like oneDNN's, but in a different
order, so outputs can differ from oneDNN's (and from ``F.linear``) by one bf16 rounding step; greedy tokens
against transformers are then checked within the bf16 tolerance (``tests/unit/test_decode_gemm.py``), as for
the paged decode kernel. fp32 engines never take it (they are not packed).

When: a hot CPU engine that packs its weights (bf16, ``packed_weights``), on a CPU with AVX-512 BF16, with
``engine.decode_gemm: auto`` (default; ``off`` keeps oneDNN for every step); the kernel is compiled into the
paged-attention extension (``paged_attn.load_extension``). Memory: one more copy of the linear weights
(prefill keeps oneDNN's blocked copy). Measured in ``services/engine/README.md`` (*decode_gemm*).
"""

from __future__ import annotations

import torch

MAX_ROWS = 32  # calls with more rows (prefill chunks, decode batches past the default max_num_seqs) keep oneDNN


class DecodeGemm:
    """The extension's decode GEMM: ``pack`` a weight once, then call with ``x`` of at most ``max_rows`` rows.
    Pure functions over their arguments (``pack`` allocates the packed copy, a call its output)."""

    max_rows = MAX_ROWS

    def __init__(self, module) -> None:
        self._m = module

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` ``[N, K]`` in the kernel's layout, or None where the kernel does not apply (not bf16 on a
        CPU, K odd): the caller keeps oneDNN for that layer."""
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
            return None
        return self._m.decode_gemm_pack(weight.detach())

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` (bf16 ``x``, ``bias`` float32 or None)."""
        return self._m.decode_gemm(x, packed, out_features, bias)


def load_decode_gemm() -> DecodeGemm | None:
    """The decode GEMM (building the CPU extension on first use), or None if the extension cannot be built or
    this CPU build has no AVX-512 BF16."""
    from .paged_attn import load_extension

    module = load_extension()
    if module is None or not module.decode_gemm_supported():
        return None
    return DecodeGemm(module)
