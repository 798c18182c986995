"""The decode-step GEMM (services/engine/model/decode_gemm.py): the kernel against a float64 reference
rounded once to bf16, the packed linear's dispatch (small calls to the kernel, the rest to oneDNN), and a bf16
model with it as close to float32 as with oneDNN. Skips where the kernel cannot run (no AVX-512 BF16, or the
extension cannot build)."""

from __future__ import annotations

import pytest
import torch

from services.engine.executor import Engine
from services.engine.model.batch import AttnBatch
from services.engine.model.decode_gemm import MAX_ROWS, DecodeGemm, load_decode_gemm
from services.engine.model.loader import allocate_kv_cache, load_model
from services.engine.model.packed import PackedLinear, can_pack
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture
from tests.unit.kernel_fixtures import require_isa


@pytest.fixture(scope="module")
def gemm() -> DecodeGemm:
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN on this torch build")
    require_isa("avx512f", "avx512bw", "avx512_bf16")  # skip only without the ISA; a failed build fails
    g = load_decode_gemm()
    assert g is not None, "the extension built but reports no decode GEMM on a CPU with AVX-512 BF16"
    return g


def _data(n: int, k: int, rows: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    return w, x, b


def _rounded_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    return ref.to(torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 21, 32])
@pytest.mark.parametrize("n,k", [(16, 64), (37, 64), (200, 576), (100, 1536)])
def test_kernel_is_the_float_sum_rounded_once(gemm, n, k, rows, bias):
    """Column counts off the 16-output blocks (masked tails) and the 64-output groups, rows off the 4-row passes:
    every output is the exact
    sum rounded to bf16 (nearest even), or one bf16 step from it where float32's summation order moved it
    across a rounding boundary (rare)."""
    w, x, b = _data(n, k, rows, bias)
    y = gemm(x, gemm.pack(w), n, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    exact = _rounded_reference(x, w, b).float()
    step = exact.abs() * 2.0**-7 + 1e-30  # one bf16 step is <= 2^-7 relative
    off = (y.float() - exact).abs()
    assert (off <= step).all(), off.max().item()
    assert (off == 0).float().mean().item() >= 0.97


@pytest.mark.parametrize("n,k", [(37, 64), (200, 576), (1000, 1536)])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(gemm, n, k):
    """Batch invariance (same request, same answer): each output's float32 sum runs over k in the same order
    whatever the call's row count, its pass and its column group, so a row computed alone and as row 0, 6 or 15 of
    a 16-row call (four 4-row passes over weights then in L2) is bit-identical."""
    w, x, b = _data(n, k, 16, True, seed=3)
    packed = gemm.pack(w)
    together = gemm(x, packed, n, b)
    for i in (0, 6, 15):
        assert torch.equal(gemm(x[i:i + 1], packed, n, b), together[i:i + 1]), i
    assert torch.equal(gemm(x[4:9], packed, n, b), together[4:9])


def test_leading_dims_and_the_pack_guards(gemm):
    w, x, _ = _data(48, 64, 6, False)
    y = gemm(x.view(2, 3, 64), gemm.pack(w), 48, None)
    assert y.shape == (2, 3, 48) and torch.equal(y.view(6, 48), gemm(x, gemm.pack(w), 48, None))
    assert gemm.pack(w.float()) is None  # float32: not the kernel's
    assert gemm.pack(torch.zeros(8, 63, dtype=torch.bfloat16)) is None  # K odd


def test_packed_linear_takes_the_kernel_only_for_small_calls(gemm):
    """Up to MAX_ROWS rows a packed linear with the kernel returns the kernel's result; above it, oneDNN's,
    bit for bit the result of the plain packed linear."""
    w, x, b = _data(96, 128, MAX_ROWS + 3, True)
    plain, fast = PackedLinear(w, b), PackedLinear(w, b, gemm=gemm)
    assert fast.gemm is gemm and plain.gemm is None
    assert torch.equal(fast(x), plain(x))  # MAX_ROWS + 3 rows: oneDNN
    small = x[:MAX_ROWS]
    assert torch.equal(fast(small), gemm(small, fast.small, 96, fast.small_bias))
    assert not torch.equal(fast(small), torch.zeros_like(fast(small)))
    assert PackedLinear(w.float(), None, gemm=gemm).gemm is None  # a float32 layer keeps oneDNN


def _chunked_logits(model, cfg, ids: torch.Tensor, dtype: torch.dtype, chunk: int) -> torch.Tensor:
    """All-position logits of one prompt fed ``chunk`` tokens per forward (each reads the earlier KV back)."""
    n, page = len(ids), 16
    pages = list(range(-(-n // page)))
    kv = allocate_kv_cache(cfg, len(pages), page, dtype=dtype)
    out = []
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        pos = torch.arange(a, b)
        batch = AttnBatch(cu_q=[0, b - a], context_lens=[b], block_tables=[pages],
                          slot_mapping=torch.tensor(pages)[pos // page] * page + pos % page)
        out.append(model.compute_logits(model(ids[a:b], pos, batch, kv)))
    return torch.cat(out)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_bf16_model_with_the_kernel_as_close_to_fp32_as_with_onednn(gemm, synth_models, name):
    """Fed in forwards of 8 rows (every linear, lm_head included, takes the kernel), a packed bf16 model with
    the kernel is as accurate as with oneDNN alone: its logits' distance to the float32 model's within 10 %
    (+ a bf16 step) of oneDNN's, its argmax as often equal to float32's (up to 2 %)."""
    ref_model, cfg = load_model(synth_models[name], dtype=torch.float32)
    low, _ = load_model(synth_models[name], dtype=torch.bfloat16)
    ids = torch.randint(3, 4096, (120,), generator=torch.Generator().manual_seed(3))
    ref = _chunked_logits(ref_model, cfg, ids, torch.float32, 8)
    low.pack_weights()
    onednn = _chunked_logits(low, cfg, ids, torch.bfloat16, 8)
    calls = []

    class Counted(DecodeGemm):
        def __call__(self, *args):
            calls.append(args[0].shape[0])
            return super().__call__(*args)

    low.pack_weights(Counted(gemm._m))
    kernel = _chunked_logits(low, cfg, ids, torch.bfloat16, 8)
    n_layers = len(low.model.layers)
    assert len(calls) == (120 // 8) * (4 * n_layers + 1) and set(calls) == {8}  # every linear, every forward
    err_o, err_k = (onednn - ref).abs().max().item(), (kernel - ref).abs().max().item()
    assert err_k <= 1.1 * err_o + 2.0**-7 * ref.abs().max().item(), (err_k, err_o)
    agree = lambda a: (a.argmax(-1) == ref.argmax(-1)).float().mean().item()  # noqa: E731
    assert agree(kernel) >= agree(onednn) - 0.02 and agree(kernel) >= 0.9, (agree(kernel), agree(onednn))


def test_engine_switch(gemm, synth_models):
    """``decode_gemm``: auto packs for the kernel (bf16 hot engine), off keeps oneDNN; a bad value is refused."""
    path = synth_models["tiny-llama"]
    on = Engine(path, dtype=torch.bfloat16, page_size=4, num_pages=64)
    off = Engine(path, dtype=torch.bfloat16, page_size=4, num_pages=64, decode_gemm="off")
    assert on.runner.decode_gemm and isinstance(on.model.lm_head_packed.gemm, DecodeGemm)
    assert not off.runner.decode_gemm and off.model.is_packed and off.model.lm_head_packed.gemm is None
    assert not Engine(path, dtype=torch.float32, page_size=4, num_pages=64).runner.decode_gemm  # fp32: not packed
    with pytest.raises(ValueError, match="decode_gemm"):
        Engine(path, dtype=torch.bfloat16, page_size=4, num_pages=64, decode_gemm="on")
