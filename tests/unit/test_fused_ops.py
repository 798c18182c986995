"""The fused elementwise CPU ops (services/engine/model/fused_ops.py) against the eager ops they replace, and
an engine with them against one without (greedy tokens equal). Skips only if the extension cannot build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.executor import Engine
from services.engine.model.fused_ops import FusedOps, load_fused_ops
from services.engine.model.batch import AttnBatch
from services.engine.model.llama import RMSNorm, _rms_norm, apply_rope
from services.engine.model.loader import allocate_kv_cache, load_model
from services.engine.types import SamplingParams
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture
from tests.unit.kernel_fixtures import require_extension

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
EPS = 1e-5


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    require_extension()  # a failed build fails the module (tests/unit/kernel_fixtures.py)
    return load_fused_ops()


def _close(fused: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype, exact: bool = False) -> None:
    """``exact``: bit-identical (add and RoPE round exactly where eager does). Else bf16: equal except at most
    one bf16 step on a rare element (the norm's sum order, the polynomial exp); float32: a few ulps."""
    assert fused.shape == eager.shape and fused.dtype == eager.dtype
    if exact:
        assert torch.equal(fused, eager), (fused.float() - eager.float()).abs().max()
    elif dtype == torch.bfloat16:
        diff = (fused.float() - eager.float()).abs()
        step = eager.float().abs() * 2.0**-7 + 1e-30  # one bf16 step is <= 2^-7 relative
        assert bool((diff <= step).all()), diff.max()
        assert int((diff > 1e-30).sum()) <= max(1, diff.numel() // 1000)  # rare (below 1e-30: saturated SiLU)
    else:
        torch.testing.assert_close(fused, eager, rtol=2e-6, atol=1e-6)


ROWS = (0, 1, 3, 8, 700)  # 0 rows, a decode step, a prefill chunk over the parallel grain
WIDTHS = (37, 576)  # a width that is not a multiple of any vector length


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", WIDTHS)
def test_norms_equal_eager(ops, dtype, rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randn(rows, n, generator=g) * 4).to(dtype)
    r = torch.randn(rows, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    _close(ops.rms_norm(x, w, EPS), _rms_norm(x, w, EPS), dtype)
    h, normed = ops.add_rms_norm(x, r, w, EPS)
    _close(h, x + r, dtype, exact=True)
    _close(normed, _rms_norm(x + r, w, EPS), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_eager(ops, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * 150, generator=g) * 8).to(dtype)
    gu[:, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated exp both ways, zeros
    gate, up = gu.chunk(2, dim=-1)
    _close(ops.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", (37, 256, 640))
def test_gemma_norm_and_geglu_equal_eager(ops, dtype, rows, n):
    """Gemma 3's forms (gemma3.py): the (1 + w) norm rounded once, and GELU-tanh(gate) * up."""
    from services.engine.model.gemma3 import GemmaRMSNorm

    g = torch.Generator().manual_seed(rows * 7 + n)
    x = (torch.randn(rows, n, generator=g) * 4).to(dtype)
    norm = GemmaRMSNorm(n, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5, generator=g)
        eager = norm(x)
        norm.ops = ops
        fused = norm(x)
    assert ops.gemma_rms_norm(x, norm.weight, EPS) is not None
    _close(fused, eager, dtype)
    gu = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    fused, eager = ops.gelu_tanh_mul(gu), F.gelu(gate, approximate="tanh") * up
    # std::tanh vs ATen's vectorized tanh: a few float ulps, times |up| up to ~16; in the saturated negative tail
    # 1 + tanh cancels, so values below ~1e-5 differ relatively more (a bf16 step or so, absolutely tiny)
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(fused.float(), eager.float(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_rope_equals_eager_on_a_strided_view(ops, dtype, rows):
    """q and k as the forward hands them over: a view into the fused qkv output (row stride > heads * D)."""
    g = torch.Generator().manual_seed(rows + 7)
    heads, kvh, d = 6, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kvh) * d, generator=g).to(dtype)
    x = qkv[:, : (heads + kvh) * d].view(rows, heads + kvh, d)
    angle = torch.randn(rows, 1, d, generator=g) * 10
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    _close(ops.rope(x, cos, sin), apply_rope(x, cos, sin), dtype, exact=True)


def test_nan_and_inf_propagate_as_in_eager(ops):
    x = torch.tensor([[1.0, float("nan"), 2.0], [1.0, float("inf"), 2.0]], dtype=torch.bfloat16)
    w = torch.ones(3, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w, EPS).isnan(), _rms_norm(x, w, EPS).isnan())


def test_guards_fall_back_to_eager(ops):
    """What the kernels do not cover returns None (the module then runs its eager op)."""
    w16 = torch.ones(8, dtype=torch.float16)
    assert ops.rms_norm(torch.ones(2, 8, dtype=torch.float16), w16, EPS) is None
    assert ops.rms_norm(torch.ones(8, 2).t(), torch.ones(2), EPS) is None  # not contiguous
    assert ops.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.bfloat16), EPS) is None  # mixed dtypes
    assert ops.silu_mul(torch.ones(4, 2).t()) is None
    assert ops.rope(torch.ones(2, 3, 8)[..., ::2], torch.ones(2, 1, 4), torch.ones(2, 1, 4)) is None
    norm = RMSNorm(8, EPS)
    norm.ops = ops
    x = torch.randn(2, 8, dtype=torch.float16)
    assert torch.equal(norm(x), _rms_norm(x, norm.weight, EPS))  # fell back, same result


def _run(path, dtype, mode):
    eng = Engine(path, dtype=dtype, page_size=4, num_pages=256, max_num_batched_tokens=24, fused_ops=mode)
    assert eng.runner.fused_ops == (mode == "auto")
    assert all(m.ops is (None if mode == "off" else eng.model.fused_ops)
               for m in eng.model.modules() if isinstance(m, RMSNorm))
    ps = [eng.tokenizer.encode(f"call {i}: the quick brown fox {'jumps ' * (3 * i)}over the lazy dog") for i in range(6)]
    out = eng.generate(ps, GREEDY)
    eng.check_integrity()
    return out


ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]


@pytest.mark.parametrize("name", ARCHS)
def test_engine_greedy_tokens_equal_with_and_without_fused_ops(ops, synth_models, name):
    """Ragged prompts (chunked prefill mixed with decodes) give the same greedy tokens with the fused ops as
    with ``fused_ops='off'``. float32: in bf16 a rare one-step difference can flip these random tiny models'
    near-tied logits (bf16 is bounded by the logits test below). Qwen3's per-head q/k norms stay eager."""
    runs = {mode: _run(synth_models[name], torch.float32, mode) for mode in ("auto", "off")}
    assert runs["auto"] == runs["off"]
    assert len({tuple(t) for t in runs["off"]}) > 1  # not a degenerate model


def _logits(model, cfg, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """All-position logits of one prompt in two chunks (the second reads the first's KV back)."""
    n, page = len(ids), 16
    pages = list(range(-(-n // page)))
    kv = allocate_kv_cache(cfg, len(pages), page, dtype=dtype)
    out = []
    for a, b in ((0, n // 2), (n // 2, n)):
        pos = torch.arange(a, b)
        batch = AttnBatch(cu_q=[0, b - a], context_lens=[b], block_tables=[pages],
                          slot_mapping=torch.tensor(pages)[pos // page] * page + pos % page)
        out.append(model.compute_logits(model(ids[a:b], pos, batch, kv)))
    return torch.cat(out)


@pytest.mark.parametrize("name", ARCHS)
def test_bf16_fused_logits_as_close_to_fp32_as_eager(ops, synth_models, name):
    """bf16 with the fused ops is as accurate as eager bf16: its logits' distance to the float32 model's is
    within 10 % (+ a bf16 step) of eager's, and its argmax agrees with float32's as often as eager's does (up
    to 2 %: on these random models both bf16 paths flip near ties, not always the same ones -- tiny-qwen2,
    fused vs eager 0.933, each vs float32 0.933 / 0.940)."""
    ref_model, cfg = load_model(synth_models[name], dtype=torch.float32)
    low, _ = load_model(synth_models[name], dtype=torch.bfloat16)
    ids = torch.randint(3, 4096, (150,), generator=torch.Generator().manual_seed(3))
    ref = _logits(ref_model, cfg, ids, torch.float32)
    eager = _logits(low, cfg, ids, torch.bfloat16)
    low.use_fused_ops(ops)
    fused = _logits(low, cfg, ids, torch.bfloat16)
    err_eager, err_fused = (eager - ref).abs().max().item(), (fused - ref).abs().max().item()
    assert err_fused <= 1.1 * err_eager + 2.0**-7 * ref.abs().max().item(), (err_fused, err_eager)
    agree = lambda a: (a.argmax(-1) == ref.argmax(-1)).float().mean().item()  # noqa: E731
    assert agree(fused) >= agree(eager) - 0.02 and agree(fused) >= 0.9, (agree(fused), agree(eager))


def test_engine_refuses_an_unknown_mode(synth_models):
    with pytest.raises(ValueError, match="fused_ops"):
        Engine(synth_models["tiny-llama"], page_size=4, num_pages=64, fused_ops="on")


def test_small_steps_run_with_small_step_threads(synth_models):
    """``small_step_threads``: steps of <= SMALL_STEP_TOKENS tokens (decode) run with that many intra-op
    threads, larger ones (a prefill chunk) with the configured count; None leaves every step alone."""
    from services.engine.model_runner import SMALL_STEP_TOKENS

    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for small, want in ((1, {1, 2}), (None, {2})):
            torch.set_num_threads(2)  # the configured count (a step changes the calling thread's)
            eng = Engine(synth_models["tiny-llama"], page_size=4, num_pages=256, max_num_batched_tokens=256,
                         small_step_threads=small)
            seen: list[tuple[int, int]] = []
            fwd = eng.model.forward

            def spy(ids, *a, **kw):
                seen.append((ids.shape[0], torch.get_num_threads()))
                return fwd(ids, *a, **kw)

            eng.model.forward = spy
            eng.generate([list(range(5, 5 + 3 * SMALL_STEP_TOKENS))], GREEDY)
            assert {n for _, n in seen} == want
            assert all(n == (1 if small and t <= SMALL_STEP_TOKENS else 2) for t, n in seen), seen
        with pytest.raises(ValueError, match="small_step_threads"):
            Engine(synth_models["tiny-llama"], page_size=4, num_pages=64, small_step_threads=0)
    finally:
        torch.set_num_threads(prev)
