"""talaria/otel.py and the router's CallTrace, in process with an in-memory span exporter."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.router.policy import Decision, cost_breakdown
from services.router.tracing import CallTrace
from talaria import otel
from talaria.config import TelemetryConfig
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb


def _tel(exporter=None, **cfg) -> otel.Telemetry:
    return otel.setup("talaria-test", "t-0", TelemetryConfig(**cfg), "ns1", span_exporter=exporter)


def test_propagation_round_trip_through_a_carrier_map():
    exp = InMemorySpanExporter()
    tel = _tel(exp)
    parent = tel.tracer.start_span("router")
    carrier = otel.inject({}, otel.trace.set_span_in_context(parent))
    assert carrier["traceparent"].startswith("00-")
    g = pb.GenerateRequest(trace_context=carrier)  # the protobuf map carries it as well as NATS headers do
    ctx = otel.extract_first(None, {}, dict(g.trace_context))
    child = tel.tracer.start_span("engine", context=ctx, kind=SpanKind.SERVER)
    child.end()
    parent.end()
    tel.flush()
    spans = {s.name: s for s in exp.get_finished_spans()}
    assert spans["engine"].parent.span_id == spans["router"].context.span_id
    assert spans["engine"].context.trace_id == spans["router"].context.trace_id
    assert spans["engine"].resource.attributes["service.name"] == "talaria-test"
    assert spans["engine"].resource.attributes["service.instance.id"] == "t-0"
    assert otel.extract({}) is None and otel.extract({"traceparent": "garbage"}) is None
    assert dict(otel.grpc_metadata(otel.trace.set_span_in_context(parent)))["traceparent"] == carrier["traceparent"]
    tel.shutdown()


class _Exploding(SpanExporter):
    def export(self, spans):
        raise ConnectionError("collector on fire")

    def shutdown(self):
        raise RuntimeError("also on fire")


def test_exporter_errors_are_swallowed_and_counted():
    tel = _tel(_Exploding())
    for i in range(5):
        tel.tracer.start_span(f"s{i}").end()
    tel.flush()
    assert tel.stats.ended == 5 and tel.stats.failed == 5 and tel.stats.errors == {"ConnectionError": 1}
    tel.shutdown()  # does not raise


def test_jsonl_file_export_and_read_back(tmp_path):
    tel = _tel(None, traces_dir=str(tmp_path))
    assert tel.destination.startswith("file:")
    with tel.tracer.start_as_current_span("outer", attributes={"gen_ai.response.finish_reasons": ["stop"]}):
        tel.tracer.start_span("inner").end()
    tel.shutdown()
    spans = otel.read_spans(tmp_path)
    assert {s["name"] for s in spans} == {"outer", "inner"}
    (tid,) = otel.traces_by_id(spans)
    outer = next(s for s in spans if s["name"] == "outer")
    assert next(s for s in spans if s["name"] == "inner")["parent_span_id"] == outer["span_id"]
    assert outer["attributes"]["gen_ai.response.finish_reasons"] == ["stop"] and outer["resource"]["service.name"] == "talaria-test"


class _Stalled(SpanExporter):
    """A collector that never answers: export blocks until the test releases it."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: set[int] = set()

    def export(self, spans):
        self.threads.add(threading.get_ident())
        self.entered.set()
        self.release.wait()
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


def _bounded(fn, limit_s: float = 60.0) -> None:
    """Run fn in a thread; fail (instead of hanging the suite) if it never returns. A hang check, not a speed test."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"{fn.__name__} never returned"


def test_a_stalled_collector_costs_callers_nothing():
    exp = _Stalled()
    tel = _tel(exp, max_queue_spans=256)
    callers: set[int] = set()

    def call_spans():
        callers.add(threading.get_ident())
        for i in range(3000):  # more than the queue holds: the excess is dropped, never waited for
            tel.tracer.start_span("call", attributes={"i": i}).end()

    _bounded(call_spans)
    assert exp.entered.wait(30), "the batch worker never tried to export"
    # Every span was ended while the only export in progress was still blocked: no caller waited on it.
    assert not exp.release.is_set() and tel.stats.ended == 3000 and tel.stats.exported == 0
    assert exp.threads and not (exp.threads & callers), "a caller thread ran the exporter"
    _bounded(tel.shutdown)  # bounded by export_timeout_s even while the collector never answers
    exp.release.set()


def test_dead_otlp_endpoint_exports_nothing_and_shuts_down():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    tel = _tel(None, otlp_endpoint=f"http://127.0.0.1:{port}", export_timeout_s=0.5, max_queue_spans=256)
    assert tel.destination.startswith("otlp:")

    def call_spans():
        for i in range(1000):
            tel.tracer.start_span("call", attributes={"i": i}).end()

    _bounded(call_spans)
    _bounded(tel.shutdown)
    assert tel.stats.exported == 0 and tel.stats.ended == 1000


def test_collector_errors_are_one_warning_until_an_export_succeeds(caplog):
    """Issue 43: with no collector every batch and metrics interval logged an error (with a traceback); now
    the first is one warning naming the cause, the rest are counted, and a successful export re-arms it."""
    import logging

    otel.EXPORT_ERRORS.install()
    otel.EXPORT_ERRORS.rearm()
    grpc_log = logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter")
    metrics_log = logging.getLogger("opentelemetry.sdk.metrics._internal.export")
    before = otel.EXPORT_ERRORS.suppressed
    with caplog.at_level(logging.DEBUG):
        for _ in range(5):
            grpc_log.error("Failed to export %s to %s, error code: %s", "traces", "localhost:4317", "UNAVAILABLE")
            try:
                raise ConnectionError("connection refused")
            except ConnectionError:
                metrics_log.exception("Exception while exporting metrics")
        grpc_log.warning("Exporter already shutdown, ignoring call")  # not an export error: passes
        otel._SafeExporter(InMemorySpanExporter(), otel.ExportStats()).export([])  # a success re-arms
        metrics_log.error("Exception while exporting metrics")
    otl = [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING]
    assert [r.levelname for r in otl] == ["WARNING", "WARNING", "WARNING"], [r.getMessage() for r in otl]
    assert "collector unreachable (Failed to export traces to localhost:4317" in otl[0].getMessage()
    assert otl[0].exc_info is None and "already shutdown" in otl[1].getMessage()
    assert "collector unreachable" in otl[2].getMessage()
    assert otel.EXPORT_ERRORS.suppressed - before == 9


def test_disabled_is_a_no_op():
    tel = otel.setup("x", "y", TelemetryConfig(enabled=False))
    assert not tel.enabled and tel.destination == "off"
    tel.tracer.start_span("nothing").end()
    tel.shutdown()


def test_decision_attributes_are_the_placement_span_attributes():
    """``Decision.attributes()``: the values the router's placement span carried when they were read off the
    decision by name (the same dict, key for key), for a ranked decision and one that placed nothing."""
    a = cost_breakdown(instance_id="a", delta_r=0.3, c_kv=0.1, c_act=0.1, queue_s=0.2, kv_source="device", act="active", predicted_ttft_s=0.4, pages_needed=3)
    b = cost_breakdown(instance_id="b", delta_r=1.0, c_kv=0.5, c_act=0.5, queue_s=0.0, kv_source="recompute", act="open", predicted_ttft_s=2.0,
                       pages_needed=7, eq2_gain=0.1, eq2_threshold=0.2, reject="eq2")
    at = Decision("a", "full", "cost", lease="expired", costs=(a, b)).attributes()
    assert at == {
        "talaria.placement.reason": "cost", "talaria.placement.instance": "a", "talaria.placement.policy": "full",
        "talaria.placement.lease": "expired", "talaria.placement.opens_model": False, "talaria.placement.switches_model": False,
        "talaria.placement.avoidable_open": False, "talaria.placement.joins_rotation": False, "talaria.placement.candidates": ["a", "b"], "talaria.placement.cost.total": 0.5,
        "talaria.placement.cost.delta_r": 0.3, "talaria.placement.cost.c_kv": 0.1, "talaria.placement.cost.c_act": 0.1,
        "talaria.placement.cost.queue_s": 0.2, "talaria.placement.cost.kv_source": "device", "talaria.placement.cost.act": "active",
        "talaria.placement.cost.reject": "",
        "talaria.placement.costs": '[{"instance_id":"a","total":0.5,"delta_r":0.3,"c_kv":0.1,"c_act":0.1,"queue_s":0.2,"kv_source":"device",'
                                   '"act":"active","reject":""},{"instance_id":"b","total":2.0,"delta_r":1.0,"c_kv":0.5,"c_act":0.5,'
                                   '"queue_s":0.0,"kv_source":"recompute","act":"open","reject":"eq2"}]',
    }
    assert Decision(None, "full", "no-instance").attributes() == {
        "talaria.placement.reason": "no-instance", "talaria.placement.policy": "full", "talaria.placement.lease": "none",
        "talaria.placement.opens_model": False, "talaria.placement.switches_model": False, "talaria.placement.avoidable_open": False,
        "talaria.placement.joins_rotation": False,
    }


def test_call_trace_spans_and_call_records():
    exp = InMemorySpanExporter()
    tel = _tel(exp)
    records = []
    g = pb.GenerateRequest(request_id="r1", session_id="s1", model="m", sampling=pb.SamplingParams(max_tokens=4, temperature=0.5), trace_context={})
    ct = CallTrace(tel.tracer, g, True, "router-0", records.append)
    assert "traceparent" in g.trace_context  # handed to the engine
    call = SimpleNamespace(instance_id="e0", accepted=pb.TokenChunk(accepted=True, usage=cpb.Usage(prompt_tokens=9)))
    chosen = cost_breakdown(instance_id="e0", delta_r=0.1, c_kv=0.0, c_act=0.0, queue_s=0.0, kv_source="device", act="active",
                            predicted_ttft_s=0.1, pages_needed=1)
    ct.placed(Decision("e0", "full", "lease", lease="hit", costs=(chosen,)), call)
    ct.chunk(pb.TokenChunk(seq=1, token_ids=[1, 2], text="ab"))
    ct.chunk(pb.TokenChunk(seq=2, token_ids=[3], finished=True, finish_reason="length", usage=cpb.Usage(prompt_tokens=9, completion_tokens=3, cached_tokens=4)))
    ct.end()
    ct.end()  # idempotent
    tel.flush()
    spans = {s.name: s for s in exp.get_finished_spans()}
    root = spans["chat m"]
    assert root.kind == SpanKind.SERVER and root.attributes["talaria.session.id"] == "s1" and root.attributes["talaria.instance.id"] == "e0"
    assert root.attributes["gen_ai.usage.output_tokens"] == 3 and root.attributes["gen_ai.usage.cache_read.input_tokens"] == 4
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",) and "gen_ai.server.time_to_first_token" in root.attributes
    assert spans["talaria.placement"].parent.span_id == root.context.span_id and spans["talaria.placement"].attributes["talaria.placement.lease"] == "hit"
    assert [r.phase for r in records] == ["start", "end"]
    assert records[0].lease == "hit" and records[0].instance_id == "e0" and records[0].trace_id == f"{root.context.trace_id:032x}"
    assert (records[0].placement_reason, records[0].kv_source, records[0].opens_model) == ("lease", "device", False)
    end = records[1]
    assert end.error == "" and end.usage.completion_tokens == 3 and end.end_unix >= end.first_token_unix >= end.arrival_unix > 0


def test_call_trace_of_a_refused_call_is_an_error():
    exp = InMemorySpanExporter()
    tel = _tel(exp)
    records = []
    ct = CallTrace(tel.tracer, pb.GenerateRequest(request_id="r2", model="m"), False, "router-0", records.append)
    ct.end(SimpleNamespace(code="overloaded", status=429))
    tel.flush()
    (span,) = exp.get_finished_spans()
    assert span.name == "text_completion m" and span.status.is_ok is False and span.attributes["error.type"] == "overloaded"
    assert [(r.phase, r.error, r.http_status) for r in records] == [("end", "overloaded", 429)]
