"""bench/call_diff.py: two runs joined call by call, differences attributed to placement outcomes and components."""

from __future__ import annotations

import json

from bench.call_diff import call_views, diff, kv_source, load_run, table


def _call(sid, i, inst, sent, end, cached=0, restored=0, error="", model="m"):
    return {"session_id": sid, "call_index": i, "model": model, "instance": inst, "sent": sent, "first_token": sent + 0.1, "end": end,
            "cached_tokens": cached, "restored_tokens": restored, "error": error}


def _rec(sid, arrival, **kw):
    attribution = kw.pop("attribution", {})
    return {"kind": "call", "phase": "end", "session_id": sid, "arrival_unix": arrival, "attribution": attribution, **kw}


def test_kv_source_from_usage():
    assert kv_source(0, 0) == "recompute"
    assert kv_source(300, 0) == "device"
    assert kv_source(300, 300) == "host"
    assert kv_source(300, 100) == "device"
    assert kv_source(300, None) == "device"


def test_views_join_records_by_session_order_and_skip_errors():
    replay = {"calls": [
        _call("s", 0, "e0", 0.0, 1.0),
        _call("s", 1, "e0", 2.0, 2.5, cached=100),
        _call("s", 2, "e1", 3.0, 5.0, cached=100, restored=100),
        _call("s", 3, "e1", 6.0, 6.1, error="timeout"),
    ]}
    records = [
        _rec("tenant|s", 100.0, opens_model=True, attribution={"prefill_s": 0.8}),
        _rec("tenant|s", 102.0, attribution={"prefill_s": 0.1, "decode_s": 0.3}),
        _rec("tenant|s", 102.9, error="overloaded"),  # a 429 the client retried: not a call of its own
        _rec("tenant|s", 103.0, switches_model=True, attribution={"switch_wait_s": 1.0, "restore_s": 0.2}),
        {"kind": "round", "phase": "end", "session_id": "s", "arrival_unix": 99.0},
    ]
    v = call_views(replay, records)
    assert sorted(v) == [("s", 0), ("s", 1), ("s", 2)]  # the failed call is left out
    assert v[("s", 0)].outcome == "first/recompute/open"
    assert v[("s", 1)].outcome == "same/device/resident"
    assert v[("s", 1)].components == {"prefill": 0.1, "decode": 0.3}
    assert v[("s", 2)].outcome == "moved/host/switch"
    assert v[("s", 2)].components == {"switch wait": 1.0, "KV restore": 0.2}
    assert v[("s", 2)].latency_s == 2.0
    # a two-model session: the user simulator's call in between does not make the agent's return a move
    two = call_views({"calls": [_call("u", 0, "e0", 0, 1), _call("u", 1, "e1", 1, 2, model="sim"), _call("u", 2, "e0", 2, 3, cached=9)]}, None)
    assert [two[("u", i)].moved for i in range(3)] == ["first", "first", "same"]
    no_records = call_views(replay, None)
    assert no_records[("s", 1)].outcome == "same/device/?" and no_records[("s", 1)].components == {}


def test_diff_attributes_the_difference_to_outcome_pairs_and_components(tmp_path):
    a = {"calls": [_call("s", 0, "e0", 0, 1.0), _call("s", 1, "e0", 2, 2.5, cached=100),
                   _call("t", 0, "e1", 0, 1.0), _call("t", 1, "e1", 2, 2.4, cached=100)]}
    b = {"calls": [_call("s", 0, "e0", 0, 1.0), _call("s", 1, "e1", 2, 4.0),
                   _call("t", 0, "e1", 0, 1.0), _call("t", 1, "e1", 2, 2.5, cached=100)]}
    ra = [_rec("s", 1, attribution={"prefill_s": 0.9}), _rec("s", 3, attribution={"prefill_s": 0.1}),
          _rec("t", 1, attribution={"prefill_s": 0.9}), _rec("t", 3, attribution={"prefill_s": 0.1})]
    rb = [_rec("s", 1, attribution={"prefill_s": 0.9}), _rec("s", 3, switches_model=True, attribution={"prefill_s": 0.9, "switch_wait_s": 0.5}),
          _rec("t", 1, attribution={"prefill_s": 0.9}), _rec("t", 3, attribution={"prefill_s": 0.2})]
    d = diff(call_views(a, ra), call_views(b, rb))
    assert d["calls"] == 4 and d["a_faster"] == 2
    assert abs(d["sum_delta_s"] - (-1.5 - 0.1)) < 1e-9
    first = d["by_outcome"][0]  # most negative sum first: where A won most
    assert (first["a"], first["b"], first["calls"]) == ("same/device/resident", "moved/recompute/switch", 1)
    assert abs(first["sum_delta_s"] + 1.5) < 1e-9
    comps = {r["component"]: r["delta_s"] for r in d["components"]["rows"]}
    assert abs(comps["prefill"] - (2.0 - 2.9)) < 1e-9 and abs(comps["switch wait"] + 0.5) < 1e-9
    assert d["top"][0]["session_id"] == "s" and d["top"][0]["index"] == 1
    md = table(d, "full", "least-pressure")
    assert "| same/device/resident | moved/recompute/switch | 1 | 1 | -1.50 s |" in md
    # the on-disk layout of a matrix run directory
    for name, rep, recs in (("A", a, ra), ("B", b, rb)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "replay.json").write_text(json.dumps(rep))
        (tmp_path / name / "records.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert diff(load_run(tmp_path / "A"), load_run(tmp_path / "B"))["sum_delta_s"] == d["sum_delta_s"]
