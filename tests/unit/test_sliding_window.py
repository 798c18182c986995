"""issue 19 #5: a checkpoint whose sliding window is shorter than its positions (Mistral-v0.1: 4096 of 32768)
gets its window applied (attention masked to the last ``sliding_window`` positions), not full attention;
a window the model does not implement (Qwen's per-layer one) caps the context, with a warning."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from services.engine.executor import Engine
from services.engine.model.config import ModelConfig
from services.engine.types import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 12


@pytest.fixture(scope="module")
def windowed_mistral(synth_models, tmp_path_factory):
    dst = tmp_path_factory.mktemp("windowed") / "windowed-mistral"
    shutil.copytree(synth_models["tiny-mistral"], dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(sliding_window=WINDOW, max_position_embeddings=4096)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (30, 5, 19, 41)]


def test_window_is_applied_and_greedy_tokens_equal_transformers(windowed_mistral):
    """Prompts longer than the window, chunked (8-token budget: packed and padded prefill groups mixed
    with decodes) and batched, against transformers' windowed greedy generate() one prompt at a time."""
    cfg = ModelConfig.from_dir(windowed_mistral)
    assert cfg.sliding_window == WINDOW and cfg.attention_span == 4096
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(windowed_mistral), dtype=torch.float32).eval()
    n_new = 12
    refs = []
    with torch.no_grad():
        for p in _prompts():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    for budget in (8, 256):  # chunked + mixed, and every prompt in one step
        eng = Engine(windowed_mistral, dtype=torch.float32, page_size=4, num_pages=128, max_num_batched_tokens=budget)
        assert eng.max_context == 128 * 4  # the pool, not the window, bounds the context
        assert eng.generate(_prompts(), sp) == refs
    # the window matters: the same checkpoint with full attention answers differently
    full = ModelConfig.from_dict({**json.loads((windowed_mistral / "config.json").read_text()), "sliding_window": None})
    assert full.sliding_window is None
    eng.model.config = full
    try:
        assert eng.generate(_prompts(), sp) != refs
    finally:
        eng.model.config = cfg


def test_qwen_per_layer_window_caps_the_context_with_a_warning(caplog):
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512}
    with caplog.at_level(logging.WARNING, logger="services.engine.model.llama_family"):
        cfg = ModelConfig.from_dict(dict(base, sliding_window=48, use_sliding_window=True))
    assert cfg.attention_span == 48 and cfg.sliding_window is None
    assert any("sliding_window 48" in r.getMessage() for r in caplog.records)


def test_no_window_or_a_window_as_long_as_the_positions_changes_nothing():
    base = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512}
    assert ModelConfig.from_dict(dict(base)).attention_span == 512
    assert ModelConfig.from_dict(dict(base, sliding_window=512)).sliding_window is None
    qwen = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False)
    assert ModelConfig.from_dict(qwen).attention_span == 512  # window declared but off


def test_registry_names_every_family_and_refuses_others():
    from services.engine.model.llama import LlamaForCausalLM
    from services.engine.model.registry import lookup, supported
    from talaria.models.importer import SUPPORTED_ARCHITECTURES

    assert supported() == tuple(sorted(SUPPORTED_ARCHITECTURES))  # what `talaria models import` accepts is servable
    arch = lookup("MistralForCausalLM")
    assert arch.model_class is LlamaForCausalLM
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100})
    kv = arch.kv_shape(cfg)
    assert kv.pool_shape(32) == (2, 3, 32, 2, 16) and kv.page_bytes(4, 2) == 2 * 3 * 4 * 2 * 16 * 2
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        lookup("GPT2LMHeadModel")
