"""``talaria bench peer`` against a second Talaria instance (the same checkpoint behind two stacks)."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest

from bench.peer import add_args, render, run_peer_bench
from tests.integration.conftest import engine, stack_config, start_stack

pytestmark = pytest.mark.slow


def test_peer_bench_against_a_second_talaria(models_dir):
    a = start_stack(stack_config(models_dir, [engine("a0", "tiny-llama")]))
    b = start_stack(stack_config(models_dir, [engine("b0", "tiny-llama")]))
    try:
        p = argparse.ArgumentParser()
        add_args(p)
        args = p.parse_args([
            "--url", f"{b.api}/v1", "--model", "tiny-llama", "--talaria-url", f"{a.api}/v1",
            "--repeats", "3", "--ttft-lengths", "32", "64", "--ttft-calls", "1", "--streams", "1", "3",
            "--decode-tokens", "6", "--sessions", "2", "--calls", "3", "--first-tokens", "40",
            "--turn-tokens", "10", "--agent-tokens", "4", "--gap", "0.05", "--timeout", "60",
        ])
        res = asyncio.run(run_peer_bench(args, say=lambda _m: None))
    finally:
        b.stop()
        a.stop()
    metrics = {r["metric"]: r for r in res["rows"]}
    assert set(metrics) == {"ttft_32_s", "ttft_64_s", "decode_1_tok_s", "decode_3_tok_s",
                            "sct_p50_s", "sct_p95_s", "return_ttft_p50_s", "return_ttft_p95_s"}
    for r in res["rows"]:
        assert r["talaria"] > 0 and r["peer"] > 0 and math.isfinite(r["talaria_advantage"]), r
    assert all(len(runs) == 3 for runs in res["runs"].values())
    # the agent sessions ran their calls: SCT covers at least the two gaps between three calls
    assert metrics["sct_p50_s"]["talaria"] >= 2 * 0.05 and metrics["sct_p50_s"]["peer"] >= 2 * 0.05
    assert res["identical_completions"] == 1.0  # same checkpoint, greedy, same texts on both sides
    assert "talaria advantage" in render(res)
