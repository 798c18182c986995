"""``talaria bench kvstore`` runs end to end on a tiny prefix (the real numbers come from the CLI)."""

from __future__ import annotations

from bench.kvstore_bench import render, run_kvstore_bench


def test_kvstore_bench_smoke(synth_models):
    models_dir = next(iter(synth_models.values())).parent
    result = run_kvstore_bench(str(models_dir), "tiny-llama", [64], repeats=1, seed=0, threads=1, say=lambda _m: None)
    (row,) = result["rows"]
    assert row["prefix_tokens"] == 64 and row["same_first_token"]
    assert row["restore_gib_s"] > 0 and row["mooncake_tcp_gib_s"] > 0 and row["memcpy_gib_s"] > 0
    assert 0.0 <= row["checkpoint_cpu_s"] < 10.0  # the checkpoint's CPU (a difference of two runs: may be ~0 at 64 tokens)
    assert "restore/mooncake" in render(result)
