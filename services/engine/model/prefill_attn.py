"""Prefill attention for the CPU on AMX tiles or AVX-512 BF16 dot products: a C++ kernel
(``prefill_attn.cpp``) in the same extension as the paged decode kernel (``paged_attn.py``).

Design note
-----------
What it computes: for each sequence of a prefill group (``n_q`` new tokens at the end of a context of ``n``
keys), query row ``i`` of head ``h`` attends to keys ``0 .. n - n_q + i`` (causal, bottom-right aligned: a
chunk after its prefix sees the whole prefix and its own earlier rows), with K/V read from the paged pool
through the group's packed slot list. The same function as the ``rows`` path of
``llama.Attention._attend_rows`` (one causal ATen flash call, or two merged by log-sum-exp for a chunk
after a prefix), in one call for the whole group.

Why: a prefill's attention was ATen's CPU flash kernel, ~30-45 % of a prefill of SmolLM2-135M (bf16, 2
threads) and most of the difference to vLLM's CPU build on long prompts. That kernel is bound by
its softmax (one exp per score, ~2.9 G/s here) and, for a causal block, computes the masked half too; its
matrix products do not set the pace. Here the two products of each block run on the AMX tile unit
(``TDPBF16PS``: bf16 pairs, float accumulation) and the softmax on AVX-512, FlashAttention's online softmax
(Dao et al., "FlashAttention", NeurIPS'22, Algorithm 1) over spans of 128 keys: per task (sequence, query
head, 16 query rows) S = Q K^T for 4 blocks of 32 keys into 16x16 float tiles, then per row the span's max,
exp (a degree-6 polynomial, relative error < 3e-7), sum and P rounded to bf16, then P V in 16x16 tiles added
into float accumulators rescaled by exp(m_old - m_new). K and V of each (sequence, kv head) are gathered
from the pool and packed once per call into the tile operand layouts (K as a dword transpose, V as key
pairs), so the per-layer gather copy of the ``rows`` path is gone too, and the ``G = H / KVH`` query heads
sharing a kv head read the same packed copy. Causal waste is at most one 32-key block per 16 rows.
Code written from scratch for this repo.

Accuracy: float accumulation throughout, P in bf16 as ATen's bf16 flash kernel has it; against a float64
reference the outputs are within one bf16 step, as close as ATen's or closer
(``tests/unit/test_prefill_attn.py``).

Packing is vectorized: K's dword transpose by 64-bit-index gathers straight from the pool slots, V's key
pairs by one 16-bit permute per 16 dims (the scalar version cost a third of a 232-query call).

Measured (ATen flash incl. its gather vs this kernel, one layer, SmolLM2-135M shapes, bf16, 2 threads, in
one process, quiet machine, 2026-12-03): 512 fresh tokens 938 -> 565 us, 800 fresh 1,973 -> 1,355 us, a
512-token chunk after 512 / 1,536 keys 2,090 -> 1,467 / 4,081 -> 3,176 us, 232 after 1,500 1,968 ->
1,582 us; with the vectorized packing (old kernel vs new, interleaved): 232 after 1,500 1,516 -> 1,159 us,
512 after 1,536 3,160 -> 2,689 us, 32 after 1,968 749 -> 356 us. Whole prefills: services/engine/README.md.

AVX-512 BF16 without AMX (AMD Zen 4 and later, Cooper Lake): the same packing, the same online softmax and
exp, the products on ``VDPBF16PS`` (16 float lanes += 16 bf16 pairs) in register blocks: S for 4 query rows x
64 keys (16 accumulators; per dim pair 4 K dwords loaded, each query's dword broadcast), P V for 4 rows x 64
dims (16 accumulators; per key pair 4 V rows loaded, each row's P pair broadcast). Each group of 4 rows stops
at the keys its own last row sees, so the causal waste is at most 3 keys per row (plus one 16-key vector),
not the 16-row block's. ~5 cycles per (query, key) pair per core: 4 dot-product instructions and the exp.
Measured (``python -m bench.prefill_attn_bench --mode layer|engine``, SmolLM2-135M shapes, bf16, 2 threads,
2-core AMD EPYC with AVX512-BF16 and no AMX, quiet (load 0.8-1.9), 2026-12-04): one layer 512 fresh
5,653 -> 1,146 us (4.9x), 2,048 fresh 50.0 -> 16.7 ms (3.0x), 232 after 1,500 7,895 -> 3,183 us (2.5x), 32
after 1,968 1,692 -> 742 us (2.3x), 8 x 100 fresh 3,247 -> 552 us (5.9x); TTFT through one ``Engine``
(5 interleaved repetitions): 512 fresh 459 -> 338 ms (1.36x), 2,048 fresh in one step 2,514 -> 1,657 ms
(1.52x), a 232-token return after a cached 1,500-token prefix 456 -> 257 ms (1.78x), 8 x 800 fresh 6.63 ->
4.65 s (1.43x). What is left of a prefill there is the linears, at ~400 GFLOP/s (the bf16 peak of
``torch.mm`` on that CPU).

Availability (:func:`isas`, fastest first): ``amx`` on x86 CPUs with AMX-BF16 (Sapphire Rapids and later)
and a kernel that grants the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, asked once per process);
``avx512_bf16`` on CPUs with AVX512-BF16 and AVX512-BW (an AMX CPU has both; the tests run each). bf16 K/V
and head dim 64 only. Anything else keeps the ATen flash path (:func:`load_prefill_kernel` returns
``None``); the engine config ``prefill_attention: off`` keeps it too.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from services.engine.model.paged_attn import load_extension

PrefillFn = Callable[..., torch.Tensor]

HEAD_DIM = 64  # the only head dim the kernel takes


def applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel can serve a model on ``device`` whose weights and KV are ``dtype`` (the one check
    the engine and the model's forward share)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and head_dim == HEAD_DIM


def isas() -> list[str]:
    """The instruction sets the kernel can use in this process, fastest first: ``"amx"`` (AMX-BF16 tiles the
    OS grants), ``"avx512_bf16"`` (AVX-512 with ``VDPBF16PS``); empty when the extension did not build or the
    CPU has neither."""
    module = load_extension()
    return [] if module is None or not hasattr(module, "prefill_attention_isas") else list(module.prefill_attention_isas())


def load_prefill_kernel(isa: str | None = None) -> PrefillFn | None:
    """The compiled ``prefill_attention(q, k_pool, v_pool, slots, q_lens, ctx_lens, scale)`` on ``isa`` (one of
    :func:`isas`; ``None``: the fastest this CPU has), or ``None`` if the extension does not build or the CPU
    (and OS) can run neither AMX-BF16 nor AVX-512 BF16, or ``isa`` is not among them."""
    available = isas()
    if not available or (isa is not None and isa not in available):
        return None
    return functools.partial(load_extension().prefill_attention, isa=isa or available[0])


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                      q_lens: list[int], ctx_lens: list[int], scale: float) -> torch.Tensor:
    """``[T, H, 64]`` bf16 attention of ``q`` (the groups' new tokens, sequence after sequence) over the
    pools ``[S, KVH, 64]`` through ``slots`` (int64, each sequence's ``ctx_lens[i]`` context slots in
    order); row ``i`` of sequence ``s`` sees its first ``ctx_lens[s] - q_lens[s] + i + 1`` keys. Reads only.
    Raises ``RuntimeError`` where the kernel is unavailable (see :func:`load_prefill_kernel`)."""
    kernel = load_prefill_kernel()
    if kernel is None:
        raise RuntimeError("prefill attention kernel unavailable on this CPU or build (needs AMX-BF16 or AVX-512 BF16)")
    return kernel(q, k_pool, v_pool, slots, list(q_lens), list(ctx_lens), scale)
