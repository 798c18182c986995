"""services/telemetry: session SCT rules, record decoding, metrics, records file (no processes)."""

from __future__ import annotations

import json

import pytest

from prometheus_client.parser import text_string_to_metric_families

from services.telemetry.collector import (
    Collector,
    RecordWriter,
    kv_source_split,
    read_records,
)
from services.telemetry.metrics import CATALOG
from services.telemetry.sessions import SessionTracker
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from talaria.v1 import telemetry_pb2 as tpb


def _fams(c: Collector) -> dict:
    return {f.name: f for f in text_string_to_metric_families(c.metrics.exposition().decode())}


def _v(fams, family, sample, **labels) -> float:
    return sum(s.value for s in fams[family].samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_sct_is_first_arrival_to_last_response_after_idle():
    t = SessionTracker(idle_s=1.0)
    t.call_started("s", "r1", arrival=100.0, now=100.0)
    t.call_ended("s", "r1", 100.0, 101.0, now=101.0, model="m", instance="e0", tokens=(10, 2, 0))
    t.call_started("s", "r2", arrival=101.4, now=101.4)
    assert t.expire(now=103.0) == []  # a call in flight keeps the session open however long it runs
    t.call_ended("s", "r2", 101.4, 103.5, now=103.5, tokens=(20, 2, 10))
    t.call_ended("s", "r2", 101.45, 103.49, now=103.6, tokens=(20, 2, 10))  # the engine's hook for the same call
    assert t.expire(now=104.0) == []
    (r,) = t.expire(now=104.6)
    assert r.sct_seconds == 3.5 and r.calls == 2 and r.input_tokens == 30 and r.cached_tokens == 10 and r.models == ("m",)
    t.call_ended("s", "r2", 101.45, 103.49, now=105.0)  # a late duplicate does not start a new session
    assert "s" not in t.open
    t.call_ended("s", "r3", 110.0, 111.0, now=111.0)  # a new call after the end is a new session
    (r2,) = t.expire(now=113.0)
    assert r2.sct_seconds == 1.0


def test_abandoned_in_flight_call_expires():
    t = SessionTracker(idle_s=1.0, inflight_timeout_s=10.0)
    t.call_started("s", "r1", 0.0, 0.0)
    t.call_ended("s", "r0", 0.0, 0.5, 0.5)
    assert t.expire(5.0) == []
    (r,) = t.expire(11.0)
    assert r.calls == 1


def _hook(rid, session, arrival, finish, ttft, prompt, out, cached, error=None, restored=0, reason="stop") -> bytes:
    h = pb.CompletionHook(
        request_id=rid, session_id=session, model="m", instance_id="e0", finish_reason=reason, arrival_unix=arrival, finish_unix=finish, ttft_seconds=ttft,
        usage=cpb.Usage(prompt_tokens=prompt, completion_tokens=out, cached_tokens=cached, restored_tokens=restored),
    )
    if error:
        h.error.CopyFrom(cpb.Error(code=error, message="x", http_status=500))
    return h.SerializeToString()


def test_scripted_run_feeds_metrics_sessions_and_records(tmp_path):
    c = Collector(idle_s=0.5, writer=RecordWriter(tmp_path / "run.jsonl"))
    start = tpb.CallRecord(phase="start", request_id="r1", session_id="s", model="m", instance_id="e0", arrival_unix=10.0, placement_reason="cost", lease="expired", avoidable_open=True)
    c.feed("call", start.SerializeToString(), now=10.01)
    c.feed("hook", _hook("r1", "s", 10.01, 10.5, 0.1, 100, 5, 0), now=10.5)
    end = tpb.CallRecord(phase="end", request_id="r1", session_id="s", model="m", instance_id="e0", arrival_unix=10.0, end_unix=10.51, first_token_unix=10.12)
    c.feed("call", end.SerializeToString(), now=10.52)
    c.feed("call", tpb.CallRecord(phase="start", request_id="r2", session_id="s", model="m", instance_id="e0", arrival_unix=10.9, placement_reason="lease", lease="hit").SerializeToString(), now=10.9)
    c.feed("hook", _hook("r2", "s", 10.91, 11.2, 0.05, 110, 5, 96), now=11.2)
    c.feed("call", tpb.CallRecord(phase="end", request_id="r2", session_id="s", model="m", instance_id="e0", arrival_unix=10.9, end_unix=11.21, first_token_unix=10.97).SerializeToString(), now=11.21)
    c.feed("call", tpb.CallRecord(phase="end", request_id="r3", model="m", arrival_unix=11.0, end_unix=11.0, error="overloaded", http_status=429).SerializeToString(), now=11.0)
    c.feed("hook", _hook("r4", "", 11.0, 11.1, 0.0, 5, 0, 0, error="engine_error"), now=11.1)
    snap = pb.InstanceSnapshot(instance_id="e0", heartbeat_period_s=0.5, kv_usage=0.25, staging_slack_bytes=4096, num_running=1)
    c.feed("heartbeat", snap.SerializeToString(), now=11.2)
    switch = pb.SwitchRecord(
        instance_id="e0", seq=1, from_model="a", to_model="b", path="partial", started_unix=11.0, total_seconds=0.5,
        save_teardown_seconds=0.1, open_weights_seconds=0.2, restore_kv_shell_seconds=0.1, restore_runtime_seconds=0.05, publish_seconds=0.05,
    ).SerializeToString()
    c.feed("switch", switch, now=11.3)
    c.feed("switch", switch, now=11.3)  # the same record twice counts once
    c.feed("round", pb.RoundSummary(instance_id="e0", sp_admitted=3, sp_deferred=1, deadline_risk=True, wall_s=0.8).SerializeToString(), now=11.4)
    c.feed("hook", b"\xff\xff not protobuf", now=11.5)
    ended = c.tick(now=12.0)
    assert [(r.session_id, round(r.sct_seconds, 3), r.calls) for r in ended] == [("s", 1.21, 2)]

    f = _fams(c)
    assert {m.name for m in CATALOG} <= set(f)
    assert _v(f, "talaria_calls", "talaria_calls_total") == 3
    assert _v(f, "gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds_count") == 2
    assert _v(f, "gen_ai_server_time_per_output_token_seconds", "gen_ai_server_time_per_output_token_seconds_count") == 2
    assert abs(_v(f, "talaria_ttft_schedule_aware_seconds", "talaria_ttft_schedule_aware_seconds_sum") - 0.19) < 1e-9
    assert _v(f, "talaria_session_completion_seconds", "talaria_session_completion_seconds_count") == 1
    assert _v(f, "talaria_kv_hits", "talaria_kv_hits_total", source="device") == 1 and _v(f, "talaria_kv_hits", "talaria_kv_hits_total", source="recompute") == 1
    assert _v(f, "talaria_kv_hit_tokens", "talaria_kv_hit_tokens_total", source="device") == 96
    assert _v(f, "talaria_lease_hits", "talaria_lease_hits_total") == 1 and _v(f, "talaria_lease_expiries", "talaria_lease_expiries_total") == 1
    assert _v(f, "talaria_avoidable_cold_opens", "talaria_avoidable_cold_opens_total") == 1
    assert _v(f, "talaria_placements", "talaria_placements_total", reason="cost") == 1
    assert _v(f, "talaria_errors", "talaria_errors_total", kind="overloaded") == 1 and _v(f, "talaria_errors", "talaria_errors_total", kind="engine_error") == 1
    assert _v(f, "talaria_errors", "talaria_errors_total", kind="bad_hook") == 1
    assert _v(f, "talaria_kv_occupancy_ratio", "talaria_kv_occupancy_ratio", instance="e0") == 0.25
    assert _v(f, "talaria_staging_slack_bytes", "talaria_staging_slack_bytes", instance="e0") == 4096
    assert _v(f, "talaria_switch_seconds", "talaria_switch_seconds_count", path="partial") == 1
    assert _v(f, "talaria_switch_phase_seconds", "talaria_switch_phase_seconds_count", phase="open_weights") == 1
    assert _v(f, "talaria_sp_admitted", "talaria_sp_admitted_total") == 3 and _v(f, "talaria_sp_deferred", "talaria_sp_deferred_total") == 1
    assert _v(f, "talaria_deadline_risk_events", "talaria_deadline_risk_events_total") == 1
    assert _v(f, "talaria_round_wall_seconds", "talaria_round_wall_seconds_count", instance="e0") == 1
    assert _v(f, "talaria_instance_up", "talaria_instance_up", instance="e0") == 1
    c.tick(now=20.0)
    assert _v(_fams(c), "talaria_instance_up", "talaria_instance_up", instance="e0") == 0  # stale: no heartbeat for > 3 periods

    s = c.summary()
    assert s["sessions"]["finished"] == 1 and s["sessions"]["sct_p50_s"] == ended[0].sct_seconds and s["instances"]["e0"]["kv_usage"] == 0.25
    c.writer.close()
    kinds = [r["kind"] for r in read_records(tmp_path / "run.jsonl")]
    assert kinds.count("call") == 5 and kinds.count("hook") == 3 and kinds.count("switch") == 1 and kinds.count("session") == 1 and "heartbeat" not in kinds
    (sess,) = read_records(tmp_path / "run.jsonl", "session")
    assert sess["session_id"] == "s" and sess["calls"] == 2


def test_kv_hits_by_source_are_exact_per_call_from_hook_usage():
    assert kv_source_split(200, 180, 128) == {"device": 52, "host": 128, "recompute": 20}
    assert kv_source_split(10, 12, 20) == {"device": 0, "host": 10, "recompute": 0}  # clamped: restored <= cached <= prompt
    c = Collector(idle_s=0.5)
    calls = [  # (prompt, cached, restored)
        (100, 96, 0),  # device hit
        (200, 180, 128),  # partly restored from host, the rest on the device: a host call
        (64, 63, 63),  # all of the cached prefix restored
        (50, 0, 0),  # recomputed
    ]
    for i, (p, cached, restored) in enumerate(calls):
        c.feed("hook", _hook(f"r{i}", "s", 1.0, 2.0, 0.1, p, 4, cached, restored=restored), now=2.0)
    c.feed("hook", _hook("ab", "s", 1.0, 2.0, 0.1, 70, 1, 64, restored=64, reason="abort"), now=2.0)  # aborted: not counted
    c.feed("hook", _hook("er", "s", 1.0, 2.0, 0.0, 70, 0, 64, restored=64, error="engine_error"), now=2.0)  # failed: not counted
    # a round's host hits are the same restores the hooks already reported: not counted a second time
    c.feed("round", pb.RoundSummary(instance_id="e0", sp_admitted=2).SerializeToString(), now=2.5)
    f = _fams(c)
    hits = {src: _v(f, "talaria_kv_hits", "talaria_kv_hits_total", source=src) for src in ("device", "host", "recompute")}
    toks = {src: _v(f, "talaria_kv_hit_tokens", "talaria_kv_hit_tokens_total", source=src) for src in ("device", "host", "recompute")}
    assert hits == {"device": 1, "host": 2, "recompute": 1}
    assert toks == {"device": 96 + 52, "host": 128 + 63, "recompute": 4 + 20 + 1 + 50}
    assert sum(toks.values()) == sum(p for p, _c, _r in calls)  # every prompt token has exactly one source


def test_protobuf_switch_records_when_the_contract_has_them():
    if not hasattr(pb, "SwitchRecord"):
        return  # issue 3's contract not present in this checkout
    c = Collector(idle_s=1.0)
    rec = pb.SwitchRecord(instance_id="e1", seq=7, path="full_staged", started_unix=5.0, total_seconds=0.3, open_weights_seconds=0.2, publish_seconds=0.1)
    c.feed("switch", rec.SerializeToString(), now=6.0)
    f = _fams(c)
    assert _v(f, "talaria_switch_seconds", "talaria_switch_seconds_count", path="full_staged") == 1
    assert _v(f, "talaria_switch_phase_seconds", "talaria_switch_phase_seconds_sum", phase="open_weights") == 0.2


def test_dashboard_and_collector_config_refer_to_real_things():
    import re
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2] / "deploy"
    dash = json.loads((root / "grafana" / "dashboards" / "talaria-dashboard.json").read_text())  # the folder Grafana provisions
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    from talaria.vllm_metrics import TALARIA_NAMES  # the router's /metrics exports these beside vllm:*

    known = {m.name for m in CATALOG} | set(TALARIA_NAMES)
    used = {re.sub(r"_(bucket|total|count|sum)$", "", n) for e in exprs for n in re.findall(r"\b(?:talaria|gen_ai)_[a-z_]+", e)}
    assert used and used <= known, used - known
    assert {"talaria_session_completion_seconds", "gen_ai_server_time_to_first_token_seconds", "talaria_switch_seconds", "talaria_kv_occupancy_ratio"} <= used
    col = yaml.safe_load((root / "otel" / "collector.yaml").read_text())  # the one collector config compose and Nomad mount
    defined = {k: set(col.get(k) or {}) for k in ("receivers", "processors", "exporters", "connectors")}
    for name, p in col["service"]["pipelines"].items():
        assert set(p["receivers"]) <= defined["receivers"] | defined["connectors"], name
        assert set(p.get("processors", [])) <= defined["processors"], name
        assert set(p["exporters"]) <= defined["exporters"] | defined["connectors"], name
    pipes = col["service"]["pipelines"]
    assert "spanmetrics" in pipes["traces"]["exporters"] and "spanmetrics" in pipes["metrics"]["receivers"]


def test_round_token_deadlines_feed_attainment_counters_and_gap_gauge():
    """issue 16: a round summary's per-token deadline stats become talaria_token_deadline_tokens{token,on_time}
    and the latest round's p99 inter-token gap."""
    from services.telemetry.collector import decode_round

    c = Collector(idle_s=1.0)
    td = pb.TokenDeadlineStats(tokens=10, tokens_on_time=7, first_tokens=3, first_on_time=3, gap_p99_s=0.25)
    rs = pb.RoundSummary(instance_id="cold-0", index=1, wall_s=1.0, token_deadlines=td, cold_scheduler="token_deadlines")
    c.on_round(decode_round(rs.SerializeToString()), now=1.0)
    f = _fams(c)
    name = "talaria_token_deadline_tokens"
    assert _v(f, name, name + "_total", token="later", on_time="true") == 7
    assert _v(f, name, name + "_total", token="later", on_time="false") == 3
    assert _v(f, name, name + "_total", token="first", on_time="true") == 3
    assert _v(f, "talaria_inter_token_gap_p99_seconds", "talaria_inter_token_gap_p99_seconds", instance="cold-0") == 0.25


def test_heartbeat_token_deadline_attainment_reaches_the_summary():
    c = Collector(idle_s=1.0)
    snap = pb.InstanceSnapshot(instance_id="cold-0", pool=pb.POOL_COLD, cold_scheduler="token_deadlines",
                               deadline_attainment=0.9, ttft_attainment=1.0, gap_p99_s=0.2)
    c.on_heartbeat(snap, now=1.0)
    inst = c.summary()["instances"]["cold-0"]
    assert inst["cold_scheduler"] == "token_deadlines" and inst["deadline_attainment"] == pytest.approx(0.9)


def test_hook_and_call_record_attributions_feed_phase_seconds_and_session_sums():
    """Issue 12: the engine's split (hook) feeds seconds per phase; the router's full split (call end record)
    is summed per session, once per call."""
    from talaria.attribution import CallAttribution

    c = Collector(idle_s=0.5)
    h = pb.CompletionHook.FromString(_hook("r1", "s", 1.0, 2.0, 0.1, 10, 2, 0))
    h.attribution.CopyFrom(CallAttribution(round_wait_s=0.25, prefill_s=0.5, decode_s=0.25, total_s=1.0).to_proto())
    c.feed("hook", h.SerializeToString(), now=2.0)
    f = _fams(c)
    assert _v(f, "talaria_call_phase_seconds", "talaria_call_phase_seconds_total", phase="prefill", instance="e0") == 0.5
    assert _v(f, "talaria_call_phase_seconds", "talaria_call_phase_seconds_total", phase="round_wait") == 0.25
    end = tpb.CallRecord(phase="end", request_id="r1", session_id="s", model="m", instance_id="e0", arrival_unix=1.0, end_unix=2.1)
    end.attribution.CopyFrom(CallAttribution(placement_s=0.05, round_wait_s=0.25, prefill_s=0.5, decode_s=0.25, other_s=0.05, total_s=1.1).to_proto())
    for _ in range(2):  # a duplicate record counts once
        c.feed("call", end.SerializeToString(), now=2.1)
    (res,) = c.sessions.expire(3.0)
    assert res.attribution["placement_s"] == 0.05 and res.attribution["total_s"] == 1.1


def test_a_failed_write_of_the_records_file_is_an_error_metric_and_in_the_summary(tmp_path, caplog):
    w = RecordWriter(tmp_path / "records.jsonl")
    c = Collector(idle_s=1.0, writer=w)
    w._f.close()  # the file becomes unwritable (a full disk or a lost mount looks the same to the writer)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            w.write({"kind": "call", "x": 1})
    assert w.errors == 3 and sum("write failed" in r.getMessage() for r in caplog.records) == 1  # logged once, counted always
    c.tick(now=1000.0)  # flush fails too: 4
    assert _v(_fams(c), "talaria_errors", "talaria_errors_total", kind="records_file_write") == 4
    assert c.summary()["records_file_errors"] == 4
    c.tick(now=1001.0)  # counted once: the next tick adds only new failures (its own flush)
    assert _v(_fams(c), "talaria_errors", "talaria_errors_total", kind="records_file_write") == 5
