"""``talaria bench matrix --stack FILE``: a config file's engines replace the two synthesized cold engines (the
mechanism knobs still on), and models that are neither present nor importable from a package stop the run
before any stack starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.matrix import base_stack, run_matrix
from talaria.config import load_config, parse_config

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "config" / "two-real-models.yaml"


def test_two_real_models_config_is_one_cold_engine_with_both_models():
    cfg = load_config(str(CONFIG))
    assert [(e.pool, e.models) for e in cfg.engines] == [("cold", ["smollm2-135m-instruct", "gemma3-270m"])]
    engines = [e.model_dump(include={"id", "pool", "models", "device", "dtype", "kv_cache_mb"}) for e in cfg.engines]
    stack = parse_config(base_stack(Path("/m"), None, engines=engines))
    assert [e.models for e in stack.engines] == [["smollm2-135m-instruct", "gemma3-270m"]]
    assert stack.engines[0].slot_scheduler and stack.models_dir == "/m"
    default = parse_config(base_stack(Path("/m"), None))
    assert len(default.engines) == 2 and default.engines[0].models[0].startswith("tiny-")


def test_a_stack_with_models_no_package_provides_stops_before_running(tmp_path):
    f = tmp_path / "stack.yaml"
    f.write_text(f"models_dir: {tmp_path / 'models'}\nengines:\n  - {{id: c0, pool: cold, models: [nope-a, nope-b]}}\n")
    with pytest.raises(ValueError, match=r"nope-a.*neither under"):
        run_matrix(tmp_path / "out", stack=f, say=lambda *_: None)
