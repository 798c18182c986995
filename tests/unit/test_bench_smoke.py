"""Smoke tests of ``talaria bench``: each benchmark runs end to end at its smallest settings and returns
well-formed results. No speed is asserted (timings on a shared CPU say nothing); only structure,
positive finite rates/ratios and that the outputs of the compared paths agree where they must."""

from __future__ import annotations

import json
import math

import pytest

from bench.cli import add_cli


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_cli_registers_bench_commands():
    import argparse

    p = argparse.ArgumentParser()
    add_cli(p.add_subparsers(dest="cmd"))
    e = p.parse_args(["bench", "engine", "--repeats", "1", "--json", "x.json"])
    assert (e.model, e.repeats, e.batch, e.json) == ("small-llama", 1, [1, 8], "x.json")
    r = p.parse_args(["bench", "router", "--models-dir", "/tmp/m"])
    assert (r.model, r.models_dir, r.max_tokens) == ("tiny-llama", "/tmp/m", [1, 16])


def test_engine_bench_smoke(synth_models, tmp_path, capsys):
    from bench.engine_bench import render, run_engine_bench

    models_dir = synth_models["tiny-llama"].parent
    res = run_engine_bench(models_dir, model="tiny-llama", batches=(1, 2), prompt_len=8, new_tokens=4, repeats=1, say=lambda _m: None)
    json.loads(json.dumps(res))  # serializable for --json
    assert res["bench"] == "engine" and [r["batch"] for r in res["rows"]] == [1, 2]
    for row in res["rows"]:
        for k in ("ours_tok_s", "hf_tok_s", "ratio", "ours_decode_tok_s", "hf_decode_tok_s", "decode_ratio"):
            assert _positive(row[k]), (k, row[k])
        assert 0.0 <= row["identical_seqs"] <= 1.0 and 0.0 <= row["identical_tokens"] <= 1.0
    text = render(res)
    assert "ours/HF" in text and "identical seqs" in text and "deterministic mode" not in text


def test_engine_bench_deterministic_rows(synth_models):
    """``--deterministic``: the mode measured against the default engine in the same run (bf16 only)."""
    from bench.engine_bench import render, run_engine_bench

    models_dir = synth_models["tiny-llama"].parent
    res = run_engine_bench(models_dir, model="tiny-llama", batches=(2,), prompt_len=8, new_tokens=4, repeats=1,
                           dtype="bfloat16", deterministic=True, say=lambda _m: None)
    (row,) = res["rows"]
    for k in ("det_decode_tok_s", "det_vs_default_decode", "det_prefill_s", "default_prefill_s"):
        assert _positive(row[k]), (k, row[k])
    assert 0.0 <= row["det_identical_seqs"] <= 1.0
    assert "deterministic mode vs the default engine" in render(res)


@pytest.mark.slow
def test_router_bench_smoke(synth_models):
    from bench.router_bench import PATHS, render, run_router_bench

    models_dir = synth_models["tiny-llama"].parent
    res = run_router_bench(models_dir, model="tiny-llama", max_tokens=(1, 3), calls=3, block=2, warmup=1, repeats=1, say=lambda _m: None)
    json.loads(json.dumps(res))
    assert res["bench"] == "router"
    assert [(r["max_tokens"], r["path"]) for r in res["rows"]] == [(m, p) for m in (1, 3) for p in PATHS]
    for row in res["rows"]:
        for k in ("p50_ms", "p95_ms", "mean_ms", "ratio_p50"):
            assert _positive(row[k]), (k, row[k])
        assert math.isfinite(row["added_p50_ms"])
        # the router paths, and only they, are paired with the direct engine call (raw = a minimal HTTP client)
        assert (row["over_direct_p50_ms"] is not None) == (row["path"] in ("router", "router-stream", "router-raw", "router-raw-stream"))
        assert row["output_agrees"], row  # greedy: every path must produce the same tokens/text
        cpu = row["cpu_ms_per_call"]  # every process of the stack, by name, and this one
        assert {"router-0", "bench-engine-0", "telemetry", "nats-server", "bench"} <= set(cpu), cpu
        assert all(v >= 0 for v in cpu.values())
    text = render(res)
    assert "p50 / in-process" in text and "CPU ms per call by process" in text and "over direct per token ms" in text


def test_router_bench_pairs_each_router_path_with_the_direct_call_of_its_kind():
    """A streamed router call is compared with a streamed direct call (the engine's per-step chunks are not the
    router's), a plain one with a plain one; block by block, median of the differences."""
    from bench.router_bench import over_direct

    blocks = {"nats": [0.010, 0.020, 0.012], "nats-stream": [0.030, 0.040, 0.032], "router": [0.012, 0.023, 0.013],
              "router-stream": [0.031, 0.041, 0.034], "router-raw": [0.011, 0.021, 0.013], "router-raw-stream": [0.031, 0.040, 0.033]}
    assert over_direct(blocks, "router") == pytest.approx(2.0)  # 2, 3, 1 ms over nats, paired per block
    assert over_direct(blocks, "router-stream") == pytest.approx(1.0)  # 1, 1, 2 ms over nats-stream (not 21 over nats)
    assert over_direct(blocks, "router-raw-stream") == pytest.approx(1.0)
    assert over_direct(blocks, "router-raw") == pytest.approx(1.0)
    assert over_direct(blocks, "nats") is None and over_direct(blocks, "in-process") is None


def test_coldpool_bench_registered_and_renders():
    """issue 16: ``talaria bench coldpool`` is registered; its table renders from a result dict."""
    import argparse

    from bench.cli import add_cli
    from bench.coldpool_bench import render

    p = argparse.ArgumentParser()
    add_cli(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["bench", "coldpool", "--repeats", "1", "--skip-slo"])
    assert a.repeats == 1 and a.skip_slo
    cfg = {"ttft_p50": 0.2, "ttft_p95": 0.3, "switch_p50": 0.1, "samples": 3}
    res = {"ttft": {"prompt_tokens": 8, "outputs_identical": True, "configs": {"load-all": cfg, "streaming": dict(cfg, ttft_p50=0.1)},
                    "streaming": {"k": {"m": 1}, "stall_s": 0.0, "streams": 1}},
           "loadavg_before": [1.0], "loadavg_mid": [1.0], "loadavg_after": [1.0]}
    assert "streaming / load-all TTFT p50: 0.500" in render(res)
