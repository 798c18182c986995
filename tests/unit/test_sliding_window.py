"""issue 19 #5: a checkpoint whose sliding window is shorter than its positions (Mistral-v0.1: 4096 of 32768)
is served with its context capped to the window, with a warning — not silently with full attention beyond it."""

from __future__ import annotations

import json
import logging
import shutil

from services.engine.executor import Engine
from services.engine.model.config import ModelConfig


def test_context_is_capped_to_the_sliding_window_with_a_warning(synth_models, tmp_path, caplog):
    src = synth_models["tiny-mistral"]
    dst = tmp_path / "windowed-mistral"
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(sliding_window=48, max_position_embeddings=4096)
    (dst / "config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="services.engine.model.config"):
        cfg = ModelConfig.from_dir(dst)
    assert cfg.attention_span == 48 and any("sliding_window 48" in r.getMessage() for r in caplog.records)
    eng = Engine(dst, page_size=4, num_pages=256)
    assert eng.max_context == 48  # a 49-token call is refused with 413 instead of attending past the window


def test_no_window_or_a_window_as_long_as_the_positions_changes_nothing():
    base = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512}
    assert ModelConfig.from_dict(dict(base)).attention_span == 512
    assert ModelConfig.from_dict(dict(base, sliding_window=512)).attention_span == 512
    qwen = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False)
    assert ModelConfig.from_dict(qwen).attention_span == 512  # window declared but off
