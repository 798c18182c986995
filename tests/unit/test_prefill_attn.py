"""The prefill attention kernel (services/engine/model/prefill_attn.py) -- on each instruction set this CPU
has (AMX-BF16 tiles, AVX-512 BF16) -- against a float64 reference and ATen's flash kernel, and wired into
the model and the engine config."""

from __future__ import annotations

import pytest
import torch

from bench.prefill_attn_bench import aten_rows as _aten  # the model's path without the kernel
from services.engine.model.prefill_attn import isas, load_prefill_kernel
from tests.unit.kernel_fixtures import cpu_flags, require_extension

KERNEL = load_prefill_kernel()
ISAS = isas()
needs_kernel = pytest.mark.skipif(  # a CPU with the ISA whose build failed fails test_isas_are_what_this_cpu_has
    KERNEL is None and "avx512_bf16" not in cpu_flags(), reason="neither AMX-BF16 nor AVX-512 BF16 on this CPU (or the extension did not build): ATen's flash kernel is the path in use")
# every instruction set the kernel has, each run where this CPU has it (an AMX CPU runs both)
EVERY_ISA = pytest.mark.parametrize(
    "isa", [pytest.param(i, marks=pytest.mark.skipif(i not in ISAS and (KERNEL is not None or not flags <= cpu_flags()), reason=f"no {i} on this CPU"))
            for i, flags in (("amx", {"amx_bf16", "amx_tile"}), ("avx512_bf16", {"avx512_bf16", "avx512bw"}))])
D = 64


def _reference(q, kpool, vpool, slots, q_lens, ctx_lens, scale):
    """float64 attention; row i of a chunk of n_q after n - n_q keys sees keys 0 .. n - n_q + i."""
    H, KVH = q.shape[1], kpool.shape[1]
    outs, qa, ka = [], 0, 0
    for nq, n in zip(q_lens, ctx_lens):
        k = kpool.index_select(0, slots[ka : ka + n]).double().repeat_interleave(H // KVH, 1)
        v = vpool.index_select(0, slots[ka : ka + n]).double().repeat_interleave(H // KVH, 1)
        s = torch.einsum("qhd,khd->hqk", q[qa : qa + nq].double(), k) * scale
        visible = torch.arange(n)[None, :] <= (n - nq + torch.arange(nq))[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), v))
        qa, ka = qa + nq, ka + n
    return torch.cat(outs)


CASES = [
    ([1], [1]),  # one token
    ([17], [17]),  # a fresh prompt with a tail of one row past 16 and keys past 32
    ([33], [100]),  # a chunk after 67 keys
    ([512], [512]),
    ([232], [1732]),  # an agent's return after its prefix
    ([100, 7, 300], [100, 50, 1000]),  # a mixed group: fresh, short chunk, chunk after a long prefix
    ([5, 5], [40, 5]),
    # prefixes of every residue mod 4 (and one = 1 mod 16): a group of 4 rows whose last row alone opens
    # a new 16-key block
    ([45], [62]), ([64], [193]), ([30], [32]), ([21], [40]),
]


@EVERY_ISA
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("q_lens,ctx_lens", CASES)
def test_matches_float64_at_least_as_well_as_aten_flash(q_lens, ctx_lens, heads, isa):
    H, KVH = heads
    g = torch.Generator().manual_seed(sum(ctx_lens) + H)
    pool = 4096
    kpool = torch.randn(pool, KVH, D, generator=g).to(torch.bfloat16)
    vpool = torch.randn(pool, KVH, D, generator=g).to(torch.bfloat16)
    slots = torch.randperm(pool, generator=g)[: sum(ctx_lens)]  # scattered pages, as in the pool
    wide = torch.randn(sum(q_lens), H + 2, D, generator=g).mul(2).to(torch.bfloat16)
    q = wide[:, 1 : H + 1]  # a strided view, as the fused projection gives
    scale = D**-0.5
    got = load_prefill_kernel(isa)(q, kpool, vpool, slots, q_lens, ctx_lens, scale)
    assert got.shape == (sum(q_lens), H, D) and got.dtype == torch.bfloat16
    ref = _reference(q, kpool, vpool, slots, q_lens, ctx_lens, scale)
    err = (got.double() - ref).abs().max().item()
    aten = (_aten(q, kpool, vpool, slots, q_lens, ctx_lens, scale).double() - ref).abs().max().item()
    assert err <= 0.016 and err <= aten + 0.004, (err, aten)  # bf16 output: one step at 2 is 0.0156


@needs_kernel
def test_bad_arguments_are_errors_not_crashes():
    kpool = torch.zeros(64, 2, D, dtype=torch.bfloat16)
    q = torch.zeros(4, 8, D, dtype=torch.bfloat16)
    slots = torch.arange(8)
    with pytest.raises(RuntimeError, match="bf16 only"):
        KERNEL(q.float(), kpool, kpool, slots, [4], [8], 0.125)
    with pytest.raises(RuntimeError, match="slot out of range"):
        KERNEL(q, kpool, kpool, slots + 60, [4], [8], 0.125)
    with pytest.raises(RuntimeError, match="q_len <= ctx_len"):
        KERNEL(q, kpool, kpool, torch.arange(3), [4], [3], 0.125)
    with pytest.raises(RuntimeError, match="do not match"):
        KERNEL(q, kpool, kpool, slots, [3], [8], 0.125)
    with pytest.raises(RuntimeError, match="isa 'sse2' is not available"):
        KERNEL.func(q, kpool, kpool, slots, [4], [8], 0.125, isa="sse2")
    assert load_prefill_kernel("sse2") is None


def test_isas_are_what_this_cpu_has():
    """The kernel offers AVX-512 BF16 exactly where the CPU has it, and AMX only where it has AMX-BF16 too."""
    from pathlib import Path

    flags = set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split())
    if "avx512_bf16" in flags:
        require_extension()  # the CPU has the ISA: a failed build is a failure, not a skip
    assert ("avx512_bf16" in ISAS) == ("avx512_bf16" in flags and "avx512bw" in flags)
    assert "amx" not in ISAS or {"amx_bf16", "amx_tile"} <= flags
    assert "amx" not in ISAS or ISAS[0] == "amx"  # the faster first: the one a plain load_prefill_kernel() takes


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """A synthesized Llama with head dim 64 (hidden 512, 8 heads, 2 kv heads): the kernel's shape."""
    from talaria.models import synthesize

    (path,) = synthesize(tmp_path_factory.mktemp("small-llama"), seed=0, names=["small-llama"])
    return path


@needs_kernel
def test_the_engine_runs_every_prefill_through_the_kernel_with_bf16_accuracy(small_llama, monkeypatch):
    """A bf16 engine on a head-dim-64 model gives its model the kernel (config ``prefill_attention: auto``),
    every layer of a step with prompt chunks makes one call for all of them, and the prefill logits stay as
    close to float32 as ATen's path's; ``off`` keeps ATen's path."""
    from services.engine.executor import Engine
    from services.engine.model.batch import AttnBatch
    from services.engine.model.loader import allocate_kv_cache, load_model

    eng = Engine(small_llama, dtype=torch.bfloat16, num_pages=64, page_size=16)
    assert eng.runner.prefill_attention and eng.model.prefill_attention is not None
    assert Engine(small_llama, dtype=torch.bfloat16, num_pages=64, page_size=16, prefill_attention="off").model.prefill_attention is None
    with pytest.raises(ValueError, match="prefill_attention"):
        Engine(small_llama, dtype=torch.bfloat16, num_pages=64, page_size=16, prefill_attention="on")

    model, cfg = eng.model, eng.config
    calls = []
    kernel = model.prefill_attention

    def counting(*a):
        calls.append(a[5])
        return kernel(*a)

    ref_model, _ = load_model(small_llama, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, cfg.vocab_size, (150,), generator=g), torch.randint(3, cfg.vocab_size, (40,), generator=g)

    def prefill(m, dtype, use_kernel):
        m.prefill_attention = counting if use_kernel else None
        kv = allocate_kv_cache(cfg, 32, 16, dtype=dtype)
        # step 1: a alone (100 tokens); step 2: the rest of a (a chunk after its prefix) with all of b
        logits = []
        for chunks in ([(a[:100], 0, list(range(10)))], [(a[100:], 100, list(range(10))), (b, 0, list(range(12, 15)))]):
            ids = torch.cat([c for c, _, _ in chunks])
            pos = torch.cat([torch.arange(s, s + len(c)) for c, s, _ in chunks])
            cu = [0]
            for c, _, _ in chunks:
                cu.append(cu[-1] + len(c))
            slots = torch.cat([torch.tensor([t[(s + i) // 16] * 16 + (s + i) % 16 for i in range(len(c))]) for c, s, t in chunks])
            batch = AttnBatch(cu, [s + len(c) for c, s, _ in chunks], [t for _, _, t in chunks], slots)
            with torch.inference_mode():
                logits.append(m.compute_logits(m.forward(ids, pos, batch, kv)))
        return torch.cat(logits)

    ref = prefill(ref_model, torch.float32, False)
    got = prefill(model, torch.bfloat16, True)
    assert calls == [[100]] * cfg.num_hidden_layers + [[150, 40]] * cfg.num_hidden_layers  # one call per layer per step
    aten = prefill(model, torch.bfloat16, False)
    err, aten_err = (got - ref).abs().max().item(), (aten - ref).abs().max().item()
    assert err <= max(0.1, 1.5 * aten_err), (err, aten_err)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
