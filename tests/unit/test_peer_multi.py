"""``talaria bench peer --multi``: the two-model workload both sides get, the per-run metrics, the report's
medians and advantages, and the memory of real process trees. No model server (the end-to-end run against
Talaria and two vLLM servers is in bench/README.md, *Two models*)."""

from __future__ import annotations

import argparse
import math
import socket
import subprocess
import sys
import time

import pytest

from bench.peer_multi import (
    api_base,
    compare,
    listener_pid,
    make_workload,
    parse_peers,
    stack_root,
    summarize,
    tree_memory,
)
from bench.replay import CallResult, ReplayResult
from bench.workloads import common_prefix, resolve_prompts

MODELS = ("agent-m", "user-m")
PARAMS = dict(sessions=8, seed=5, max_depth=12, length_scale=1 / 32, time_scale=1.0, mean_interarrival_s=2.0, agent_calls_per_turn=2.0)


# ------------------------------------------------------------------------------------- workload
def test_workload_alternates_two_models_within_sessions_and_extends_prompts():
    w = make_workload(MODELS, **PARAMS)
    assert len(w.sessions) == 8 and w.meta["two_model"]
    agents, both = set(), 0
    for s in w.sessions:
        models = [c.model for c in s.calls]
        agent = models[0]  # a session opens with its agent model
        agents.add(agent)
        both += len(set(models)) == 2
        for prev, cur in zip(models, models[1:]):
            assert prev == agent or cur == agent, models  # the user simulator answers once, then the agent resumes
        ps = resolve_prompts(s)
        for i in range(1, len(ps)):
            assert common_prefix(ps[i - 1], ps[i]) == s.calls[i].prefix_tokens and len(ps[i]) > s.calls[i].prefix_tokens
        assert max(len(p) for p in ps) + max(c.output_tokens for c in s.calls) <= 4096  # fits --max-model-len 4096
        assert len(s.calls) <= 12
    assert agents == set(MODELS)  # each model is the agent of some sessions
    assert both >= 6  # and the other model simulates the user within (nearly) every session


def test_both_sides_get_the_same_calls_under_their_own_model_names():
    a = make_workload(MODELS, **PARAMS)
    b = make_workload(MODELS, **PARAMS).remap_models({"agent-m": "peer-a", "user-m": "peer-u"})
    assert [resolve_prompts(s) for s in a.sessions] == [resolve_prompts(s) for s in b.sessions]
    ren = {"agent-m": "peer-a", "user-m": "peer-u"}
    assert [[ren[c.model] for c in s.calls] for s in a.sessions] == [[c.model for c in s.calls] for s in b.sessions]
    assert [[c.output_tokens for c in s.calls] for s in a.sessions] == [[c.output_tokens for c in s.calls] for s in b.sessions]
    other = make_workload(MODELS, **{**PARAMS, "seed": 6})  # the next repetition: new prompts, nothing cached from this one
    assert resolve_prompts(other.sessions[0])[0] != resolve_prompts(a.sessions[0])[0]


# --------------------------------------------------------------------------------------- metrics
def _call(sid, k, model, intended, ttft, dur, error=""):
    return CallResult(sid, k, model, intended, sent=intended, first_token=intended + ttft, last_token=intended + dur,
                      end=intended + dur, status=200 if not error else 500, error=error)


def test_summarize_splits_first_returns_and_handoffs_and_leaves_failed_sessions_out():
    calls = [
        # s0: agent, agent, user (hand-off), agent (hand-off); SCT 0 -> 10
        _call("s0", 0, "a", 0.0, 1.0, 2.0), _call("s0", 1, "a", 3.0, 0.2, 1.0),
        _call("s0", 2, "u", 5.0, 0.7, 2.0), _call("s0", 3, "a", 8.0, 0.9, 2.0),
        # s1: first call then a failed return: out of the SCTs, counted as failed
        _call("s1", 0, "u", 1.0, 3.0, 4.0), _call("s1", 1, "a", 6.0, float("nan"), 1.0, error="http_500: boom"),
        # s2: one call, SCT 4
        _call("s2", 0, "a", 2.0, 2.0, 4.0),
    ]
    m = summarize(ReplayResult(calls, time.time(), 12.0))
    assert m["sct_p50_s"] == pytest.approx(4.0) and m["sct_p95_s"] == pytest.approx(10.0)  # nearest rank of [4, 10]
    assert m["sessions_complete"] == 2 and m["failed_calls"] == 1
    assert m["first_ttft_p50_s"] == pytest.approx(2.0) and m["first_ttft_p95_s"] == pytest.approx(3.0)  # [1, 2, 3]
    assert m["return_ttft_p50_s"] == pytest.approx(0.7) and m["return_ttft_p95_s"] == pytest.approx(0.9)  # [0.2, 0.7, 0.9]
    assert m["handoff_ttft_p50_s"] == pytest.approx(0.7)  # [0.7, 0.9]: the calls whose model differs from the previous


def test_compare_takes_medians_sums_failures_and_orients_the_advantage():
    t = [{"sct_p50_s": 10.0, "failed_calls": 0.0, "rss_peak_mib": 2000.0}, {"sct_p50_s": 30.0, "failed_calls": 1.0, "rss_peak_mib": 2100.0},
         {"sct_p50_s": 12.0, "failed_calls": 0.0, "rss_peak_mib": 1900.0}]
    p = [{"sct_p50_s": 15.0, "failed_calls": 2.0, "rss_peak_mib": 3000.0}, {"sct_p50_s": 16.0, "failed_calls": 2.0, "rss_peak_mib": float("nan")},
         {"sct_p50_s": 18.0, "failed_calls": 0.0, "rss_peak_mib": 3000.0}]
    rows = {r["metric"]: r for r in compare({"talaria": t, "peer": p})}
    assert rows["sct_p50_s"]["talaria"] == 12.0 and rows["sct_p50_s"]["peer"] == 16.0
    assert rows["sct_p50_s"]["talaria_advantage"] == pytest.approx(16 / 12)  # > 1: Talaria faster
    assert rows["failed_calls"]["talaria"] == 1 and rows["failed_calls"]["peer"] == 4
    assert math.isnan(rows["failed_calls"]["talaria_advantage"])
    assert rows["rss_peak_mib"]["talaria_advantage"] == pytest.approx(3000 / 2000)


def test_peer_specs_and_base_urls():
    assert parse_peers(["a=http://127.0.0.1:8001/v1", "b=http://h:9/v1"]) == [("a", "http://127.0.0.1:8001/v1"), ("b", "http://h:9/v1")]
    for bad in (["a"], ["=http://x"], ["a=ftp://x"], ["a=http://x", "a=http://y"]):
        with pytest.raises(ValueError):
            parse_peers(bad)
    assert api_base("http://127.0.0.1:8001/v1/") == "http://127.0.0.1:8001" and api_base("http://h:9") == "http://h:9"


def test_cli_takes_multi_and_still_requires_a_peer_url_without_it():
    from bench.cli import add_cli
    from bench.peer import main

    p = argparse.ArgumentParser()
    add_cli(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["bench", "peer", "--multi", "--peer", "x=http://127.0.0.1:1/v1", "--peer", "y=http://127.0.0.1:2/v1",
                      "--talaria-models", "tx", "ty", "--repeats", "1", "--sessions", "2", "--max-depth", "3"])
    assert a.multi and a.peer == ["x=http://127.0.0.1:1/v1", "y=http://127.0.0.1:2/v1"] and a.talaria_models == ["tx", "ty"]
    assert a.max_depth == 3 and a.length_scale == pytest.approx(1 / 32)
    with pytest.raises(SystemExit, match="--url and --model are required"):
        main(p.parse_args(["bench", "peer"]))
    with pytest.raises(SystemExit, match="twice"):
        main(p.parse_args(["bench", "peer", "--multi", "--peer", "x=http://127.0.0.1:1/v1"]))


# ---------------------------------------------------------------------------------------- memory
def test_tree_memory_sums_a_real_process_tree_and_finds_a_supervised_listener():
    """A parent whose command line reads like ``talaria up`` starts a child that listens on a port and holds
    64 MiB: the listener is found by its port, its root is the supervisor, and the tree's summed RSS
    counts the child's 64 MiB besides the parent."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = ("import socket, time\n"
             "buf = bytearray(64 << 20)\n"
             "for i in range(0, len(buf), 4096): buf[i] = 1\n"
             f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
             "print('ready', flush=True); time.sleep(60)")
    parent = ("import subprocess, sys, time\n"
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=sys.stdout)\n"
              "time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", parent, "talaria", "up"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        pid = listener_pid(f"http://127.0.0.1:{port}/v1")
        assert pid is not None and pid != p.pid
        assert stack_root(pid) == p.pid
        assert stack_root(p.pid) == p.pid  # this test's process is no talaria supervisor
        alone, tree = tree_memory([pid]), tree_memory([p.pid])
        assert alone.rss >= 64 << 20 and len(alone.per_process) == 1
        assert tree.rss > alone.rss and len(tree.per_process) == 2 and tree.pss > 0
        assert listener_pid("http://10.255.255.1:1/v1") is None  # another host: not measured here
    finally:
        import psutil

        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()
