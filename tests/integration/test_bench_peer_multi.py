"""``talaria bench peer --multi`` end to end: one Talaria stack serving two models against one Talaria stack per
model standing in for the peer (real stacks, the official HTTP path; vLLM is not a dependency). Slow (~90 s at
load 10-30, 3 s of it the two replays; the rest is three stacks starting and stopping): the only check of the
two-URL peer path, the per-side replay and the memory of real process trees together."""

from __future__ import annotations

import argparse
import asyncio
import math
from contextlib import ExitStack

import pytest

from bench.peer import add_args
from bench.peer_multi import render, run_multi_bench
from tests.integration.conftest import engine, stack_config, start_stack

pytestmark = pytest.mark.slow


def _pids(stack) -> list[int]:
    pids = [c.proc.pid for c in stack.children.values()]
    if stack.nats is not None and stack.nats.proc is not None:
        pids.append(stack.nats.proc.pid)
    return pids


def test_multi_bench_one_stack_for_two_models_against_one_server_per_model(models_dir):
    with ExitStack() as started:  # every stack that started is stopped, whatever fails after it
        both = start_stack(stack_config(models_dir, [engine("m0", "tiny-llama"), engine("m1", "tiny-qwen2")]))
        started.callback(both.stop)
        pa = start_stack(stack_config(models_dir, [engine("pa", "tiny-llama")]))
        started.callback(pa.stop)
        pb = start_stack(stack_config(models_dir, [engine("pb", "tiny-qwen2")]))
        started.callback(pb.stop)
        p = argparse.ArgumentParser()
        add_args(p)
        args = p.parse_args([
            "--multi", "--peer", f"tiny-llama={pa.api}/v1", "--peer", f"tiny-qwen2={pb.api}/v1", "--talaria-url", f"{both.api}/v1",
            "--repeats", "1", "--sessions", "2", "--max-depth", "4", "--length-scale", str(1 / 256), "--time-scale", "0.05",
            "--mean-interarrival", "0.2", "--mem-interval", "0.2", "--timeout", "60",
            "--talaria-pids", *map(str, _pids(both)), "--peer-pids", *map(str, _pids(pa) + _pids(pb)),
        ])
        res = asyncio.run(run_multi_bench(args, say=lambda _m: None))
    rows = {r["metric"]: r for r in res["rows"]}
    assert rows["failed_calls"]["talaria"] == 0 and rows["failed_calls"]["peer"] == 0
    assert rows["sessions_complete"]["talaria"] == 2 and rows["sessions_complete"]["peer"] == 2
    for m in ("sct_p50_s", "sct_p95_s", "first_ttft_p50_s", "return_ttft_p50_s", "rss_peak_mib", "pss_peak_mib"):
        assert rows[m]["talaria"] > 0 and rows[m]["peer"] > 0 and math.isfinite(rows[m]["talaria_advantage"]), rows[m]
    # both sides ran the same calls, each to the model it names, and every call generated its fixed token count
    for side in ("talaria", "peer"):
        for x in res["extras"][side]:
            assert all(c["completion_tokens"] == c["recorded_output_tokens"] for c in x["calls"])
            assert {c["model"] for c in x["calls"]} == {"tiny-llama", "tiny-qwen2"}
            assert sum("services.engine" in k for k in x["memory_by_process_mib"]) == 2  # two engines a side
    assert [len(x["calls"]) for x in res["extras"]["talaria"]] == [len(x["calls"]) for x in res["extras"]["peer"]]
    assert "talaria advantage" in render(res)
