"""Issue 7 end to end: traces across router and engine processes, the telemetry service's /metrics and SCT,
and serving that does not depend on telemetry.

Spans come from separate processes: every process of the stack writes its spans to its own JSONL file in a
temporary directory (``telemetry.traces_dir``), and the test assembles them by trace id.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.telemetry.collector import read_records
from services.telemetry.metrics import CATALOG
from talaria.otel import read_spans, traces_by_id
from tests.integration.conftest import client_for, engine, stack_config, start_stack, wait_until

pytestmark = pytest.mark.slow

LLAMA = "tiny-llama"
IDLE_S = 0.6


@pytest.fixture(scope="module")
def stack(models_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("telemetry")
    cfg = stack_config(models_dir, [engine("llama-a", LLAMA)])
    cfg["telemetry"] = {"traces_dir": str(d / "traces"), "port": 0, "session_idle_s": IDLE_S, "records_file": str(d / "records.jsonl")}
    s = start_stack(cfg)
    s.test_dir = d
    assert s.telemetry_url, "talaria up / LocalStack starts the telemetry service"
    yield s
    s.stop()


def chat(client, content, session, **kw):
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.with_raw_response.create(
        model=LLAMA, messages=[{"role": "user", "content": content}], temperature=0, extra_headers={"X-Session-ID": session, **kw.pop("headers", {})}, **kw
    )


def _trace_of(stack, request_id: str, want: set[str]) -> list[dict]:
    """All spans of the trace whose router span carries ``request_id``, once spans named ``want`` are in."""

    def ready():
        spans = read_spans(stack.test_dir / "traces")
        root = next((s for s in spans if s["attributes"].get("talaria.request.id") == request_id and s["kind"] == "SERVER" and s["resource"]["service.name"] == "talaria-router"), None)
        if root is None:
            return None
        trace = traces_by_id(spans)[root["trace_id"]]
        return trace if want <= {s["name"] for s in trace} else None

    return wait_until(ready, timeout=15)


def test_one_call_is_one_connected_trace_across_processes(stack):
    client = client_for(stack)
    chat(client, "Plan a trip to Lisbon.", "trace-s1")  # the session's first call (prefix now cached)
    raw = chat(client, "Plan a trip to Lisbon.", "trace-s1")
    r = raw.parse()
    rid = r.id.split("-", 1)[1]
    phases = {"talaria.engine.intake", "talaria.engine.queue", "talaria.engine.prefill", "talaria.engine.decode"}
    trace = _trace_of(stack, rid, {"chat tiny-llama", "talaria.placement", "talaria.engine.call", *phases})
    by_id = {s["span_id"]: s for s in trace}
    roots = [s for s in trace if s["parent_span_id"] is None]
    assert [s["name"] for s in roots] == ["chat tiny-llama"], "one root: the router's call span"
    for s in trace:  # connected: every other span's parent is in the same trace
        assert s["parent_span_id"] is None or s["parent_span_id"] in by_id, s["name"]
    services = {s["resource"]["service.name"]: s["resource"]["process.pid"] for s in trace}
    assert set(services) == {"talaria-router", "talaria-engine"} and len(set(services.values())) == 2

    root = roots[0]
    a = root["attributes"]
    assert a["gen_ai.request.model"] == LLAMA and a["talaria.session.id"] == "trace-s1" and a["gen_ai.conversation.id"] == "trace-s1"
    assert a["talaria.instance.id"] == raw.headers["x-talaria-instance"] == "llama-a"
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens and a["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [r.choices[0].finish_reason]
    assert a["gen_ai.server.time_to_first_token"] > 0 and root["status"] != "ERROR"

    place = next(s for s in trace if s["name"] == "talaria.placement")
    assert place["parent_span_id"] == root["span_id"]
    assert place["attributes"]["talaria.placement.reason"] and place["attributes"]["talaria.placement.instance"] == "llama-a"

    call = next(s for s in trace if s["name"] == "talaria.engine.call")
    assert call["parent_span_id"] == root["span_id"], "the engine span continues the router's trace (W3C context over NATS)"
    ca = call["attributes"]
    assert ca["talaria.session.id"] == "trace-s1" and ca["talaria.instance.id"] == "llama-a" and ca["gen_ai.request.model"] == LLAMA
    assert ca["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    prefill = next(s for s in trace if s["name"] == "talaria.engine.prefill")
    pa = prefill["attributes"]
    assert pa["gen_ai.usage.cache_read.input_tokens"] == r.usage.prompt_tokens_details.cached_tokens > 0, "second call of the session hits device KV"
    assert pa["talaria.kv.source"] == "device" and pa["talaria.kv.device_hit"] is True
    assert pa["talaria.prefill.computed_tokens"] == r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    kids = sorted((s for s in trace if s["name"] in phases), key=lambda s: s["start_unix_nano"])
    assert [s["name"] for s in kids] == ["talaria.engine.intake", "talaria.engine.queue", "talaria.engine.prefill", "talaria.engine.decode"]
    assert all(s["parent_span_id"] == call["span_id"] for s in kids)
    assert call["start_unix_nano"] >= root["start_unix_nano"] and call["end_unix_nano"] <= root["end_unix_nano"]


def test_client_traceparent_and_streaming_call(stack):
    """A client's own W3C traceparent header is continued; a streamed call's span ends with the stream."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    client = client_for(stack)
    stream = client.chat.completions.create(
        model=LLAMA,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_headers={"X-Session-ID": "trace-s2", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    ids = {ev.id for ev in stream}
    rid = ids.pop().split("-", 1)[1]
    trace = _trace_of(stack, rid, {"chat tiny-llama", "talaria.engine.call", "talaria.engine.decode"})
    assert {s["trace_id"] for s in trace} == {trace_id}
    root = next(s for s in trace if s["name"] == "chat tiny-llama")
    assert root["parent_span_id"] == "00f067aa0ba902b7" and root["attributes"]["gen_ai.request.stream"] is True
    assert root["attributes"]["gen_ai.usage.output_tokens"] >= 1


def _metrics(stack) -> dict:
    text = httpx.get(f"{stack.telemetry_url}/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in fams[family].samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_sct_matches_client_and_metrics_carry_the_run(stack):
    """A scripted session of 3 calls with tool gaps: the service's SCT equals the client's own measurement
    within 100 ms, and /metrics (parsed by the Prometheus parser) carries the run's counters."""
    client = client_for(stack)
    before = _metrics(stack)
    calls_before = _value(before, "talaria_calls", "talaria_calls_total")
    t0 = time.time()
    for i in range(3):
        chat(client, "Search the docs for the answer." + " and more" * i, "sct-session", max_tokens=6)
        if i < 2:
            time.sleep(0.2)  # tool gap
    t1 = time.time()
    client_sct = t1 - t0

    def finished():
        body = httpx.get(f"{stack.telemetry_url}/summary", timeout=5).json()
        return next((x for x in body["sessions"]["recent"] if x["session_id"] == "sct-session"), None)

    got = wait_until(finished, timeout=10 + IDLE_S)
    assert got["calls"] == 3
    assert abs(got["sct_seconds"] - client_sct) <= 0.1, (got["sct_seconds"], client_sct)
    assert t0 - 0.05 <= got["first_arrival_unix"] and got["last_response_unix"] <= t1 + 0.05

    fams = _metrics(stack)
    for m in CATALOG:  # every documented metric exists, fed or not
        assert m.name in fams, m.name
    assert _value(fams, "talaria_calls", "talaria_calls_total", model=LLAMA, instance="llama-a") - calls_before >= 3
    assert _value(fams, "gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds_count") >= 3
    assert _value(fams, "talaria_ttft_schedule_aware_seconds", "talaria_ttft_schedule_aware_seconds_count") >= 3
    assert _value(fams, "talaria_session_completion_seconds", "talaria_session_completion_seconds_count") >= 1
    assert _value(fams, "talaria_kv_hits", "talaria_kv_hits_total", source="device") >= 2
    assert _value(fams, "talaria_placements", "talaria_placements_total") >= 3
    assert _value(fams, "talaria_tokens", "talaria_tokens_total", type="cached") > 0
    assert _value(fams, "talaria_instance_up", "talaria_instance_up", instance="llama-a") == 1
    assert "llama-a" in {s.labels.get("instance") for s in fams["talaria_kv_occupancy_ratio"].samples}

    recs = read_records(stack.test_dir / "records.jsonl")
    kinds = {r["kind"] for r in recs}
    assert {"hook", "call", "session"} <= kinds
    sess = [r for r in recs if r["kind"] == "session" and r["session_id"] == "sct-session"]
    assert len(sess) == 1 and sess[0]["sct_seconds"] == got["sct_seconds"]


def test_call_records_carry_the_time_split_summed_per_session(stack):
    """Issue 12 #1: each call's end record carries its time split — the engine's phases (from the finished
    chunk) plus the router's placement — summing to the latency the router measured; hooks carry the engine's
    part; the session record sums its calls'."""
    client = client_for(stack)
    for i in range(3):
        chat(client, "Split my time." + " again" * i, "split-session", max_tokens=6)

    def session_record():
        recs = read_records(stack.test_dir / "records.jsonl")
        return recs if any(r["kind"] == "session" and r["session_id"] == "split-session" for r in recs) else None

    recs = wait_until(session_record, timeout=15 + IDLE_S)
    ends = [r for r in recs if r["kind"] == "call" and r["phase"] == "end" and r["session_id"] == "split-session"]
    hooks = [r for r in recs if r["kind"] == "hook" and r["session_id"] == "split-session"]
    assert len(ends) == 3 and len(hooks) == 3
    for r in ends:
        a = r["attribution"]
        assert a["total_s"] == pytest.approx(r["end_unix"] - r["arrival_unix"], abs=1e-3)
        assert sum(v for k, v in a.items() if k != "total_s") == pytest.approx(a["total_s"], abs=1e-6)
        # engine queue may be 0.0: a call that arrives while a step is being scheduled is taken by that step,
        # whose phase moves are stamped at the step's start (before the arrival; the clock never runs back)
        assert a["placement_s"] > 0 and a["engine_queue_s"] >= 0 and a["prefill_s"] > 0 and a["decode_s"] > 0
        assert a["round_wait_s"] == 0 and a["switch_wait_s"] == 0  # a hot engine has no rounds
    for h in hooks:
        a = h["attribution"]
        assert a["prefill_s"] > 0 and sum(v for k, v in a.items() if k != "total_s") == pytest.approx(a["total_s"], abs=1e-6)
    (sess,) = [r for r in recs if r["kind"] == "session" and r["session_id"] == "split-session"]
    assert sess["attribution"]["decode_s"] == pytest.approx(sum(r["attribution"]["decode_s"] for r in ends))


def test_serving_unaffected_when_telemetry_is_stopped_or_killed(stack):
    """A frozen (SIGSTOP: the slowest possible consumer) and then a killed telemetry service change nothing
    for callers: every call completes, each within a bounded time."""
    client = client_for(stack)
    child = stack.children["telemetry"]
    stack.kill("telemetry", signal.SIGSTOP)
    try:
        for i in range(3):
            t = time.monotonic()
            r = chat(client, f"while telemetry is frozen {i}", "down-s1").parse()
            assert r.choices[0].finish_reason in ("stop", "length") and time.monotonic() - t < 10
    finally:
        stack.kill("telemetry", signal.SIGCONT)
    stack.kill("telemetry", signal.SIGKILL)
    assert not child.alive()
    for i in range(3):
        t = time.monotonic()
        r = chat(client, f"after telemetry died {i}", "down-s2").parse()
        assert r.choices[0].finish_reason in ("stop", "length") and time.monotonic() - t < 10

