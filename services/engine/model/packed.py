"""Prepacked CPU linear weights (oneDNN): the decode step's matmuls without a per-call weight reorder.

Design note ("the hot path"): a decode step multiplies a few rows (``M`` = batch
size, 1-32) by every weight of the model, so it is bound by reading the weights. ``F.linear`` on a CPU
hands oneDNN/MKL the checkpoint's ``[out, in]`` layout, which the library re-blocks on *every* call; for
small ``M`` that reorder costs as much as the multiplication. This is the weight prepacking that
inductor's CPU ``freezing`` pass does (``torch.ops.mkldnn._reorder_linear_weight`` +
``_linear_pointwise``, the same kernels vLLM's CPU backend and IPEX use): done once at load, each
projection keeps one blocked copy and the step calls the packed kernel. Measured on this repository's
machine (AVX512-BF16, one thread, SmolLM2-135M shapes): bf16 projections 1.6-2x faster at M = 1 and 8,
the tied 49k-row lm_head 1.8x, and the results are bit-identical to ``F.linear`` (same oneDNN kernel
and accumulation order), so greedy tokens do not change. fp32 packing is not bit-identical (1e-4) and
did not pay consistently, so only bf16 is packed by default (``auto``).

What it mutates: :func:`pack_model` sets ``packed`` on each projection owner (attention, MLP, model);
the checkpoint parameters (and the fused views) are untouched, so the packed copies are *extra* memory
(one more copy of the linear weights) and stale if someone later writes into a parameter in place --
which is why only a hot engine that loaded its own weights packs (the cold pool's arena-bound models,
whose weights are swapped in place, never do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN linears exist for this device/dtype: CPU, bf16, oneDNN built in, and a CPU
    whose oneDNN has a bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT: ``_reorder_linear_weight`` raises on an
    AVX2-only CPU, where a bf16 engine runs its linears through ``F.linear`` instead)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedLinear:
    """One linear layer ``y = x W^T + b`` over a weight reordered once into oneDNN's blocked layout, and, with
    ``gemm`` (``decode_gemm.DecodeGemm``), a second copy in the decode kernel's layout that serves every call
    of at most ``decode_gemm.MAX_ROWS`` rows (a decode step).

    ``x`` may have any leading shape; the weight/bias are copies (not views of the parameters)."""

    __slots__ = ("weight", "bias", "out_features", "in_features", "gemm", "small", "small_bias", "tiled")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 8, gemm=None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach().contiguous().clone()
        self.small = gemm.pack(weight) if gemm is not None else None
        self.gemm = gemm if self.small is not None else None
        self.small_bias = None if bias is None or self.small is None else bias.detach().float().contiguous().clone()
        # deterministic mode (model_runner.ModelRunner._deterministic): every call in tiles of at most gemm.max_rows rows through the
        # decode kernel, whose rows do not depend on the row count; oneDNN's bf16 rows do at some shapes (K = 1,536:
        # 13 of 116 rows differ from one-row calls), so a token decoded and the same token prefilled would differ
        self.tiled = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inside a torch.compile graph: the opaque kernel as one extern call
            return torch.ops.talaria.packed_linear(x, self.weight, self.bias, self.out_features)
        if self.gemm is not None and x.numel() <= self.gemm.max_rows * self.in_features and x.dtype == torch.bfloat16:
            return self.gemm(x, self.small, self.out_features, self.small_bias)
        if self.tiled and self.gemm is not None and x.dtype == torch.bfloat16:
            rows = x.reshape(-1, self.in_features)
            out = torch.cat([self.gemm(t, self.small, self.out_features, self.small_bias) for t in rows.split(self.gemm.max_rows)])
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@torch.library.custom_op("talaria::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The prepacked linear as an opaque op for torch.compile (inductor's own lowering of
    ``mkldnn._linear_pointwise`` expects weights it packed itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def linear(x: torch.Tensor, packed: PackedLinear | None, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``packed(x)`` when the layer is packed, else ``F.linear(x, weight, bias)``."""
    if packed is not None:
        return packed(x)
    return F.linear(x, weight, bias)
