"""Fused elementwise ops for the CPU forward: RMSNorm (with the residual add), SiLU(gate)*up and RoPE.

Design note
-----------
What: the elementwise parts of a Llama-family layer, each as one C++ pass (``fused_ops.cpp``, built into the
paged-attention extension, ``paged_attn.load_extension``):

* ``rms_norm(x, w)`` = ``w * F.rms_norm(x.float()).to(x.dtype)`` (the HF order: normalize in float, round,
  then the weight); ``add_rms_norm(x, r, w)`` = ``(h, rms_norm(h, w))`` with ``h = x + r`` (the residual add
  before the post-attention norm);
* ``silu_mul(gu)`` = ``F.silu(g) * u`` for ``g, u = gu.chunk(2, -1)`` (the fused gate/up projection's output);
* ``rope(x, cos, sin)`` = ``llama.apply_rope``: ``x * cos + cat(-x2, x1) * sin``;
* Gemma 3's (``gemma3.py``): ``gemma_rms_norm(x, w)`` = ``(F.rms_norm(x.float()) * (1 + w.float())).to(x.dtype)``
  (one rounding) and ``gelu_tanh_mul(gu)`` = ``F.gelu(g, approximate="tanh") * u``.

Why: eager PyTorch runs each of these as 4-6 kernels with a temporary per kernel (a norm is a float copy,
a square, a mean, an rsqrt, two multiplies and two casts), each a full pass over the activations, plus ~10 us
of dispatch per op. Measured (one thread, bf16, SmolLM2-135M shapes, thread CPU time): at 512 tokens the
eager chain is ~5.4 ms per layer, 163 ms per 512-token prefill chunk -- as much as the layer's matmuls; at
a batch-8 decode step 81 us per layer, 2.4 ms per step. Fusion is FlashAttention's memory-traffic argument
(Dao et al., NeurIPS'22) applied to the elementwise tail, and what inductor does when it compiles a layer
(``compiled.py``; here its bf16 graph measured slower than eager, see the engine README).

Exactness: each op rounds to the storage dtype exactly where eager's intermediate tensors do (after the
norm, after SiLU, after each RoPE product, after the residual add), so in bf16 outputs equal eager's except
where the float math differs -- the order of the sum of squares and a polynomial ``exp`` -- which moves a
result by at most one bf16 step, rarely (the tests bound it). In float32 the results differ from eager by a
few ulps. Tokens are compared against transformers and the eager path in ``test_fused_ops.py``.

When: a CPU tensor in float32 or bfloat16 with contiguous rows (what the forward produces); anything else
(CUDA, fp16, a strided view, inside ``torch.compile``) takes the eager op. Config ``engine.fused_ops``:
``auto`` (default: use them when the extension builds) or ``off``.
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.bfloat16)


class FusedOps:
    """The extension's fused ops behind shape/dtype/device guards; each method returns None when it does not
    apply (the caller runs the eager op). Pure functions: they allocate their outputs and write nothing else."""

    def __init__(self, module) -> None:
        self._m = module

    @staticmethod
    def _ok(*ts: torch.Tensor) -> bool:
        t0 = ts[0]
        return (
            t0.device.type == "cpu" and t0.dtype in _DTYPES and not torch.compiler.is_compiling()
            and all(t.dtype == t0.dtype and t.is_contiguous() for t in ts)
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        if not self._ok(x, weight):
            return None
        return self._m.fused_rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._ok(x, residual, weight) or x.shape != residual.shape:
            return None
        return self._m.fused_add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        if not self._ok(gate_up):
            return None
        return self._m.fused_silu_mul(gate_up)

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """Gemma's ``(F.rms_norm(x.float()) * (1 + w.float())).to(x.dtype)``: one rounding (gemma3.py)."""
        if not self._ok(x, weight) or not hasattr(self._m, "fused_gemma_rms_norm"):
            return None
        return self._m.fused_gemma_rms_norm(x, weight, eps)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``F.gelu(g, approximate="tanh") * u`` for ``g, u = gate_up.chunk(2, -1)`` (Gemma's GeGLU)."""
        if not self._ok(gate_up) or not hasattr(self._m, "fused_gelu_tanh_mul"):
            return None
        return self._m.fused_gelu_tanh_mul(gate_up)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        if (x.device.type != "cpu" or x.dtype not in _DTYPES or torch.compiler.is_compiling() or x.dim() != 3
                or x.stride(2) != 1 or cos.dtype != x.dtype or sin.dtype != x.dtype or cos.stride(2) != 1 or sin.stride(2) != 1):
            return None
        return self._m.fused_rope(x, cos, sin)


def load_fused_ops() -> FusedOps | None:
    """The fused ops (building the CPU extension on first use, ``paged_attn.load_extension``), or None if the
    extension cannot be built (the warning is logged there)."""
    from .paged_attn import load_extension

    module = load_extension()
    return None if module is None else FusedOps(module)
