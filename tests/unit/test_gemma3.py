"""The Gemma 3 family (services/engine/model/gemma3.py) against transformers' Gemma3ForCausalLM on a tiny random
checkpoint (its norms, q/k norms perturbed away from zero so the ``1 + w`` matters): sliding-window layers with
a window shorter than the prompts, full layers with another RoPE base, an attention scale that is not
``head_dim ** -0.5``, final logit softcapping. Runs without the real checkpoint (that one is
tests/integration/test_gemma3_real.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.engine.executor import Engine
from services.engine.model.config import ModelConfig
from services.engine.model.gemma3 import Gemma3ForCausalLM
from services.engine.model.loader import load_model
from services.engine.model.registry import lookup
from services.engine.types import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 6


def tiny_config(vocab: int, **over) -> dict:
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": None, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2,
    }
    cfg.update(over)
    return cfg


def write_gemma(dst, tokenizer_src, **over):
    """A random tiny Gemma 3 checkpoint at ``dst`` with ``tokenizer_src``'s tokenizer files."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_src / f, dst / f)
    vocab = json.loads((tokenizer_src / "config.json").read_text())["vocab_size"]
    cfg = transformers.Gemma3TextConfig(**{k: v for k, v in tiny_config(vocab, **over).items() if k != "architectures"})
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)  # zero-init norms would hide the (1 + w) convention
    hf.save_pretrained(dst, safe_serialization=True)
    return dst


@pytest.fixture(scope="module")
def tiny_gemma(synth_models, tmp_path_factory):
    return write_gemma(tmp_path_factory.mktemp("gemma") / "tiny-gemma3", synth_models["tiny-llama"])


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (23, 5, 14, 31)]


def _hf_refs(path, n_new: int) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in _prompts():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


def test_config_parses_gemma_fields_and_refuses_what_it_cannot_serve():
    cfg = ModelConfig.from_dict(tiny_config(100))
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_types[2] == "full_attention" and cfg.sliding_window == WINDOW
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4 and cfg.attn_scale == 24**-0.5
    assert cfg.final_logit_softcapping == 30.0 and cfg.qk_norm
    assert lookup("Gemma3ForCausalLM").model_class is Gemma3ForCausalLM
    legacy = ModelConfig.from_dict({**tiny_config(100, num_hidden_layers=6), "layer_types": None, "rope_parameters": None,
                                    "rope_theta": 1e6, "rope_local_base_freq": 5e3, "sliding_window_pattern": 3})
    assert legacy.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert legacy.rope_local_theta == 5e3
    for bad in ({"attn_logit_softcapping": 50.0}, {"hidden_activation": "relu"}, {"layer_types": ["sliding_attention"]}):
        with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
            ModelConfig.from_dict(tiny_config(100, **bad))


def test_full_prompt_logits_match_transformers(tiny_gemma):
    """One forward over a prompt longer than the window: every position's logits (fp32) equal transformers'."""
    from services.engine.model.batch import AttnBatch
    from services.engine.model.loader import allocate_kv_cache

    ids = torch.tensor(_prompts()[3])
    n = len(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_gemma), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    model, cfg = load_model(tiny_gemma, dtype=torch.float32)
    kv = allocate_kv_cache(cfg, 16, 4, dtype=torch.float32)
    pages = [5, 2, 9, 0, 7, 3, 11, 1]  # shuffled pages
    pos = torch.arange(n)
    batch = AttnBatch([0, n], [n], [pages], torch.tensor(pages)[pos // 4] * 4 + pos % 4)
    got = model.compute_logits(model(ids, pos, batch, kv))
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("paged_decode", ["auto", "off"])
def test_engine_greedy_equals_transformers_chunked_and_batched(tiny_gemma, paged_decode):
    """Prompts longer than the window, chunked (8-token budget: prefill chunks after their prefixes, mixed with
    decodes) and whole, with the paged decode kernel (windowed layers read only their window) and with gather
    + SDPA: the greedy tokens of transformers' generate(), one prompt at a time."""
    n_new = 16
    refs = _hf_refs(tiny_gemma, n_new)
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    for budget in (8, 256):
        eng = Engine(tiny_gemma, dtype=torch.float32, page_size=4, num_pages=128, max_num_batched_tokens=budget,
                     paged_decode=paged_decode)
        assert eng.generate(_prompts(), sp) == refs
        assert [eng.generate([p], sp)[0] for p in _prompts()] == refs  # alone, after prefix-cache hits


def test_the_window_and_the_local_rope_base_matter(tiny_gemma):
    """The same weights with full attention on every layer, or one RoPE base for all, answer differently: the
    parity above cannot pass by ignoring either."""
    refs = _hf_refs(tiny_gemma, 16)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    raw = json.loads((tiny_gemma / "config.json").read_text())
    for change in ({"layer_types": ["full_attention"] * 4},
                   {"rope_parameters": {k: {"rope_type": "default", "rope_theta": 1e6} for k in ("sliding_attention", "full_attention")}}):
        cfg = ModelConfig.from_dict({**raw, **change})
        model, _ = load_model(tiny_gemma, dtype=torch.float32)
        eng = Engine(tiny_gemma, dtype=torch.float32, page_size=4, num_pages=128, model=(Gemma3ForCausalLM(cfg), cfg))
        with torch.no_grad():
            for (_, p), (_, q) in zip(eng.model.named_parameters(), model.named_parameters()):
                p.copy_(q)
        assert eng.generate(_prompts(), sp) != refs


def test_bf16_logits_within_tolerance_of_fp32(tiny_gemma):
    from services.engine.model.batch import AttnBatch
    from services.engine.model.loader import allocate_kv_cache

    ids = torch.tensor(_prompts()[3])
    n, pages = len(ids), list(range(8))
    pos = torch.arange(n)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        model, cfg = load_model(tiny_gemma, dtype=dtype)
        kv = allocate_kv_cache(cfg, 8, 4, dtype=dtype)
        outs.append(model.compute_logits(model(ids, pos, AttnBatch([0, n], [n], [pages], pos.clone()), kv)))
    assert (outs[1] - outs[0]).abs().max().item() < 0.1 * outs[0].abs().max().item()


def test_cold_bank_binds_gemma_onto_arena_memory(tiny_gemma):
    """The cold pool's bank image of a Gemma model (no buffers: the embedding scale is computed) binds and
    answers like the loaded model."""
    from services.engine.model.batch import AttnBatch
    from services.engine.model.loader import allocate_kv_cache
    from services.engine.substrate.bank import WeightBank, bind_model

    bank = WeightBank(pin=False)
    entry = bank.load("g", tiny_gemma, dtype=torch.float32)
    bound = bind_model(entry, entry.host)
    model, cfg = load_model(tiny_gemma, dtype=torch.float32)
    ids = torch.tensor(_prompts()[0])
    n, pages = len(ids), list(range(8))
    pos = torch.arange(n)
    outs = []
    for m in (bound, model):
        kv = allocate_kv_cache(cfg, 8, 4, dtype=torch.float32)
        outs.append(m.compute_logits(m(ids, pos, AttnBatch([0, n], [n], [pages], pos.clone()), kv)))
    torch.testing.assert_close(outs[0], outs[1])
