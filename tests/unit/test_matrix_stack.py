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


def test_residency_regime_paces_every_engine_from_the_largest_model(synth_models):
    """``--residency-regime``: the link bandwidth is the largest model's bank image over the target switch
    seconds, every engine of the stack gets it (and parses), and the flag picks the regime's configurations."""
    import argparse

    from bench.matrix import REGIME_CONFIGS, REGIME_SWITCH_S, add_args, regime_link_mb_s
    from services.engine.substrate.bank import WeightBank

    models_dir = next(iter(synth_models.values())).parent
    names = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
    bank = WeightBank(pin=False)
    largest = max(bank.load(m, models_dir / m, "float32").nbytes for m in names)
    assert regime_link_mb_s(models_dir, names, 2.0, "float32") == pytest.approx(largest / 2.0 / 1e6)
    stack = parse_config(base_stack(models_dir, None, weight_link_mb_s=7.5))
    assert [e.weight_link_mb_s for e in stack.engines] == [7.5, 7.5] and all(len(e.models) >= 3 for e in stack.engines)
    assert all(e.weight_link_mb_s is None for e in parse_config(base_stack(models_dir, None)).engines)
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args(["--residency-regime"]).residency_regime == REGIME_SWITCH_S
    assert p.parse_args(["--residency-regime", "2"]).residency_regime == 2.0
    assert p.parse_args([]).residency_regime is None
    assert set(REGIME_CONFIGS) == {"Talaria", "least-pressure", "Round-only"}
