"""bench: KV hits by source in the replay report — exact per call from the usage the client received
(``prompt_tokens_details.restored_tokens``), the old estimate (client cached calls / kvstore restores) only
when the responses lack it, and the report says which one it used. No server."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.replay import CallResult, Outcome, ReplayResult, replay
from bench.report import matrix_table, summarize_run
from bench.workloads import Call, Session, Workload

TEL = {"kvstore_before": {"restores": 1}, "kvstore_after": {"restores": 4}}


def _res(usages: list[tuple[int, int, int | None]]) -> ReplayResult:
    """One call per (prompt, cached, restored) usage; restored None = the server did not report it."""
    calls = [
        CallResult(f"s{i}", 0, "m", 0.0, sent=0.0, first_token=0.1, last_token=0.2, end=0.2, status=200,
                   prompt_tokens=p, completion_tokens=2, cached_tokens=c, restored_tokens=r)
        for i, (p, c, r) in enumerate(usages)
    ]
    return ReplayResult(calls, time.time(), 1.0)


def test_replay_client_records_restored_tokens_only_when_the_server_reports_them():
    answers = iter([{"cached_tokens": 48, "restored_tokens": 32}, {"cached_tokens": 8}])

    async def send(s, c, prompt, sent_at):
        now = time.monotonic()
        return Outcome(status=200, first_token=now, last_token=now, end=now,
                       usage={"prompt_tokens": 64, "completion_tokens": 1, "prompt_tokens_details": next(answers)})

    w = Workload([Session("x", 0.0, [Call("x", 0, "m", 1, prompt_tokens=[4]), Call("x", 1, "m", 1, prompt_tokens=[4, 5])])])
    a, b = asyncio.run(replay(w, send, gap_cap_s=0.0)).calls
    assert (a.cached_tokens, a.restored_tokens) == (48, 32)
    assert (b.cached_tokens, b.restored_tokens) == (8, None)
    assert ReplayResult.from_json(ReplayResult([a, b], 0.0, 1.0).to_json()).calls[0].restored_tokens == 32


def test_kv_hits_by_source_are_exact_from_per_call_usage():
    # device hit, partly restored (host), fully restored (host), recomputed
    s = summarize_run(_res([(100, 96, 0), (200, 180, 128), (64, 63, 63), (50, 0, 0)]), TEL)
    assert s["kv_hits_source"] == "usage"
    assert s["kv_hit_calls_by_source"] == {"device": 1, "host": 2, "recompute": 1}
    assert s["kv_hit_tokens_by_source"] == {"device": 96 + 52, "host": 128 + 63, "recompute": 4 + 20 + 1 + 50}
    # the cell is the exact split (device 1 / host 2), not the estimate (3 cached calls / 3 kvstore restores)
    table = matrix_table([{"name": "Talaria", "summary": s}])
    assert " 1/2 " in table and "~" not in table


def test_kv_hits_fall_back_to_the_estimate_without_restored_tokens():
    # one response without restored_tokens (an older server): the exact split is not claimed
    s = summarize_run(_res([(100, 96, 0), (200, 180, None)]), TEL)
    assert s["kv_hits_source"] == "estimate" and s["kv_hit_calls_by_source"] == {}
    table = matrix_table([{"name": "Talaria", "summary": s}])
    assert " ~2/3 " in table  # calls with cached tokens (client) / host restores (kvstore Stats), marked `~`


def test_compute_overlap_counts_work_and_instances_computing_at_once():
    """Issue 12: the report shows what the per-call split cannot — prefilled tokens, seconds any engine
    computed, seconds two engines computed at once, and compute ms per prefilled token (hooks; warmup out)."""
    from bench.report import compute_overlap, latency_split

    def hook(iid, end, prefill, decode, prompt, cached, sid="s"):
        return {"kind": "hook", "session_id": sid, "instance_id": iid, "finish_unix": end,
                "usage": {"prompt_tokens": prompt, "cached_tokens": cached},
                "attribution": {"prefill_s": prefill, "decode_s": decode}}

    recs = [
        hook("e0", 10.0, 1.5, 0.5, 1000, 200),   # e0 computes 8..10
        hook("e1", 11.0, 2.0, 0.0, 600, 0),      # e1 computes 9..11: 1 s together with e0
        hook("e0", 14.0, 1.0, 0.0, 300, 100),    # e0 alone 13..14
        hook("e0", 50.0, 9.0, 0.0, 9999, 0, sid="warmup-0-m"),  # warmup: left out
    ]
    c = compute_overlap(recs)
    assert (c["calls"], c["prefill_tokens"]) == (3, 800 + 600 + 200)
    assert c["compute_s"] == pytest.approx(4.0)  # 8..11 and 13..14
    assert c["overlap_s"] == pytest.approx(1.0)
    assert c["ms_per_prefill_token"] == pytest.approx(4000 / 1600)
    assert latency_split(recs)["compute"] == c


def test_deadline_attainment_sums_the_windows_round_records():
    """The report's per-token deadline attainment is the sum over the window's rounds (not a mean of per-round
    shares): 3 of 4 first tokens and 90 of 100 later tokens on time; counts carried as JSON strings (64-bit proto
    fields) count too; rounds without the field (an older engine) give n/a, not 100 %."""
    from bench.report import _cell, _records_metrics

    rounds = [{"kind": "round", "token_deadlines": {"first_tokens": 1, "first_on_time": 1, "tokens": 10, "tokens_on_time": 10}},
              {"kind": "round", "token_deadlines": {"first_tokens": "3", "first_on_time": "2", "tokens": "90", "tokens_on_time": "80"}},
              {"kind": "call", "phase": "start"}]
    m = _records_metrics(rounds, "")
    assert m["deadline_first"] == 0.75 and m["deadline_later"] == 0.9
    assert _cell(m, "deadlines") == "75%/90%"
    old = _records_metrics([{"kind": "round", "sp_admitted": 1}], "")
    assert _cell(old, "deadlines") == "n/a"
