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
* per pass, up to 8 rows x 2 column blocks of float32 accumulators live in registers (16 zmm), each row's
  k-pair is broadcast and ``VDPBF16PS`` adds ``w[j][0] * x[k] + w[j][1] * x[k + 1]`` into 16 outputs; steps
  with more rows make more passes (the weights then come from memory again, which is why only small steps
  take this path, ``MAX_ROWS``);
* the bias is added in float32 and each output rounded to bf16 once (nearest even), as oneDNN does;
* column-block pairs are spread over torch's threads (``at::parallel_for``).

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

MAX_ROWS = 16  # calls with more rows (prefill chunks, large decode batches) keep oneDNN


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
