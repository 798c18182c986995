"""``talaria bench profile`` measures a loadable simulator profile from a real engine (smallest settings;
no speed asserted, only that every number is measured, positive where it must be, and cited)."""

from __future__ import annotations

import argparse

import yaml

from bench.profile_bench import add_args, build_profile
from sim.profile import from_dict, uncited


def test_bench_profile_measures_a_loadable_profile(synth_models):
    models_dir = synth_models["tiny-llama"].parent
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--models", "tiny-llama", "tiny-qwen2", "--models-dir", str(models_dir), "--lengths", "16", "64", "1000000",
                         "--batches", "1", "2", "--contexts", "16", "--restore-tokens", "0", "--switches", "1", "--repeats", "2"])
    said: list[str] = []
    raw = build_profile(args, say=said.append)
    assert any("prefill lengths above its context" in m for m in said)  # measured at the longest it takes, not a crash
    raw = yaml.safe_load(yaml.safe_dump(raw))
    assert uncited(raw) == []
    cite = raw["models"]["tiny-llama"]["prefill_k"]["cite"]
    assert "median first-token times" in cite and "each repetition fitted alone puts 1024 tokens at" in cite
    prof = from_dict(raw)
    m = prof.model("tiny-llama")
    assert m.prefill_s(0, 64) > 0 and m.weights_gib > 0 and m.kv_bytes_per_token > 0
    assert m.decode_s(1, 16) > 0
    assert prof.switch.total(0.0) > 0 and prof.switch.total(1.0) > 0
    assert set(prof.models) == {"tiny-llama", "tiny-qwen2"}
