"""OpenTelemetry for every Talaria process: providers, exporters, trace-context propagation, attribute names.

One :class:`Telemetry` per process (router, engine, kvstore, telemetry service), built by :func:`setup` from
``StackConfig.telemetry`` and handed to the code that records spans — no global providers are installed, so
several stacks (or tests) can live in one interpreter.

Export never blocks or fails serving:

- spans go through a ``BatchSpanProcessor`` with a bounded queue (``max_queue_spans``); a full queue drops
  spans instead of waiting; export runs on the processor's own thread;
- the exporter is wrapped (:class:`_SafeExporter`): an exception or a failed export is swallowed and counted
  in :class:`ExportStats`; one OTLP attempt gives up after ``export_timeout_s``;
- :meth:`Telemetry.shutdown` flushes for at most ``export_timeout_s`` and never raises.

Where spans go: OTLP (gRPC or HTTP/protobuf) when an endpoint is configured (``telemetry.otlp_endpoint`` or
the standard ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``), else one JSONL file per process under
``telemetry.traces_dir`` (``<service>-<instance>-<pid>.jsonl``; :func:`read_spans` loads a directory of them
and is what tests and report tools use to assemble traces across processes).

Propagation is W3C trace context (``traceparent``/``tracestate``): :func:`inject` writes it into a plain
``dict`` — used for NATS message headers and for ``GenerateRequest.trace_context`` — and :func:`extract`
reads it back (NATS headers first, the protobuf map as a fallback, see :func:`extract_first`). gRPC calls
(kvstore) carry it as metadata: :func:`grpc_metadata` / :func:`extract` over ``dict(metadata)``.
"""

from __future__ import annotations

import json
import logging
import re
import os
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Meter, NoOpMeter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider

    from talaria.config import TelemetryConfig

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ attribute names
# OpenTelemetry GenAI semantic conventions where one exists, ``talaria.*`` otherwise.
GEN_AI_OPERATION = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"  # = the Talaria session id
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_SERVER_TTFT = "gen_ai.server.time_to_first_token"
GEN_AI_SERVER_TPOT = "gen_ai.server.time_per_output_token"
GEN_AI_SERVER_DURATION = "gen_ai.server.request.duration"
ERROR_TYPE = "error.type"

SESSION_ID = "talaria.session.id"
REQUEST_ID = "talaria.request.id"
INSTANCE_ID = "talaria.instance.id"
ROUTER_ID = "talaria.router.id"
KV_SOURCE = "talaria.kv.source"  # "device" | "host" | "recompute"
PREFILL_COMPUTED = "talaria.prefill.computed_tokens"
QUEUE_SECONDS = "talaria.queue.seconds"

_PROPAGATOR = TraceContextTextMapPropagator()


# ------------------------------------------------------------------------------------------ propagation
def inject(carrier: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """W3C ``traceparent`` (+ ``tracestate``) of ``context`` (default: the current one) into ``carrier``."""
    carrier = {} if carrier is None else carrier
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The remote parent carried by ``carrier`` (NATS headers, a protobuf map, gRPC metadata), or None."""
    if not carrier or "traceparent" not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def extract_first(*carriers: Mapping[str, str] | None) -> Context | None:
    """The first carrier that holds a valid trace context (e.g. NATS headers, then ``req.trace_context``)."""
    for c in carriers:
        ctx = extract(c)
        if ctx is not None:
            return ctx
    return None


def grpc_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """Trace context as gRPC call metadata (kvstore calls)."""
    return list(inject({}, context).items())


# ------------------------------------------------------------------------------------------ exporters
@dataclass
class ExportStats:
    """Counters of one process's span export (read by health endpoints and tests)."""

    ended: int = 0  # spans handed to the export queue
    exported: int = 0
    failed: int = 0  # spans in batches that raised or came back FAILURE (swallowed)
    errors: dict[str, int] = field(default_factory=dict)  # exception type -> count
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1, error: str | None = None) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)
            if error:
                self.errors[error] = self.errors.get(error, 0) + 1

    @property
    def dropped_or_queued(self) -> int:
        return max(0, self.ended - self.exported - self.failed)

    def as_dict(self) -> dict[str, Any]:
        return {"ended": self.ended, "exported": self.exported, "failed": self.failed, "errors": dict(self.errors)}


class _SafeExporter(SpanExporter):
    """Wraps any exporter: exceptions never escape, outcomes are counted."""

    def __init__(self, inner: SpanExporter, stats: ExportStats):
        self.inner = inner
        self.stats = stats

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as e:  # noqa: BLE001 - telemetry must never fail serving
            self.stats.add("failed", len(spans), type(e).__name__)
            return SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.stats.add("exported", len(spans))
            EXPORT_ERRORS.rearm()
        else:
            self.stats.add("failed", len(spans), "export_failure")
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:  # noqa: BLE001
            return False


class _CountingProcessor(SpanProcessor):
    def __init__(self, stats: ExportStats):
        self.stats = stats

    def on_end(self, span: ReadableSpan) -> None:
        self.stats.add("ended")


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """One span as a JSON-able dict (the JSONL file format; ids in lowercase hex as in W3C traceparent)."""
    ctx = span.get_span_context()
    assert ctx is not None  # an SDK span always carries its context
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_unix_nano": span.start_time,
        "end_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description or "",
        "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()},
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
        "links": [{"trace_id": f"{l.context.trace_id:032x}", "span_id": f"{l.context.span_id:016x}"} for l in span.links],
        "resource": dict(span.resource.attributes) if span.resource is not None else {},
    }


class JsonlSpanExporter(SpanExporter):
    """Appends spans to a JSONL file (runs on the batch processor's thread). Rotates past ``max_bytes``."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = 64 << 20):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s), separators=(",", ":"), default=str) + "\n" for s in spans)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                if self.path.stat().st_size > self.max_bytes:
                    self.path.replace(self.path.with_name(self.path.name + ".1"))
            except FileNotFoundError:
                pass
            with self.path.open("a") as f:
                f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_spans(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every span in the JSONL files of ``directory`` (all processes), in file order; bad lines skipped."""
    out: list[dict[str, Any]] = []
    for p in sorted(Path(directory).glob("*.jsonl*")):
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def traces_by_id(spans: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        out.setdefault(s["trace_id"], []).append(s)
    return out


# ------------------------------------------------------------------------------------------ providers
def otlp_endpoint(cfg: TelemetryConfig | None) -> tuple[str | None, str]:
    """(endpoint, protocol) after the standard OTEL_* environment overrides."""
    env = os.environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or (cfg.otlp_endpoint if cfg else None)
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or (cfg.otlp_protocol if cfg else "grpc")
    return endpoint or None, protocol


def _otlp_span_exporter(endpoint: str, protocol: str, timeout_s: float) -> SpanExporter:
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=url, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://") or "://" not in endpoint, timeout=timeout_s)


def _otlp_meter_provider(endpoint: str, protocol: str, cfg: TelemetryConfig, resource: Resource) -> MeterProvider:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader

    exporter: MetricExporter

    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

        url = endpoint if endpoint.rstrip("/").endswith("/v1/metrics") else endpoint.rstrip("/") + "/v1/metrics"
        exporter = HttpMetrics(endpoint=url, timeout=cfg.export_timeout_s)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

        exporter = GrpcMetrics(endpoint=endpoint, insecure=endpoint.startswith("http://") or "://" not in endpoint, timeout=cfg.export_timeout_s)
    reader = PeriodicExportingMetricReader(
        exporter, export_interval_millis=cfg.metrics_export_interval_s * 1000, export_timeout_millis=cfg.export_timeout_s * 1000
    )
    return MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)


@dataclass
class Telemetry:
    """The tracer and meter of one process, plus export counters. ``tracer`` is a no-op when disabled."""

    service: str
    instance_id: str
    tracer: Tracer
    meter: Meter
    stats: ExportStats
    destination: str  # "otlp:<endpoint>" | "file:<path>" | "memory" | "off"
    tracer_provider: TracerProvider | None = None
    meter_provider: Any = None
    _processor: BatchSpanProcessor | None = None
    timeout_s: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.tracer_provider is not None

    def flush(self, timeout_s: float | None = None) -> None:
        """Export what is queued now (tests); bounded, never raises."""
        if self._processor is None:
            return
        t = threading.Thread(target=self._processor.force_flush, daemon=True)
        t.start()
        t.join(timeout_s if timeout_s is not None else self.timeout_s)

    def shutdown(self) -> None:
        """Flush and stop exporting, waiting at most ``export_timeout_s`` per provider; never raises."""

        def _stop() -> None:
            try:
                if self._processor is not None:
                    inner = getattr(self._processor, "_batch_processor", None)  # the SDK's shutdown() takes no timeout
                    if inner is not None and hasattr(inner, "shutdown"):
                        inner.shutdown(timeout_millis=int(self.timeout_s * 1000))
                    else:
                        self._processor.shutdown()
                if self.meter_provider is not None:
                    self.meter_provider.shutdown(timeout_millis=self.timeout_s * 1000)
            except Exception:  # noqa: BLE001
                log.debug("telemetry shutdown failed", exc_info=True)

        t = threading.Thread(target=_stop, daemon=True, name="otel-shutdown")
        t.start()
        t.join(self.timeout_s * 2 + 0.5)


def disabled(service: str = "", instance_id: str = "") -> Telemetry:
    """A Telemetry that records nothing (no-op tracer and meter)."""
    return Telemetry(service, instance_id, trace.NoOpTracer(), NoOpMeter("talaria"), ExportStats(), "off")


def setup(service: str, instance_id: str, cfg: TelemetryConfig | None = None, namespace: str = "", *, span_exporter: SpanExporter | None = None) -> Telemetry:
    """Tracer and meter for one process of ``service`` ("talaria-router", "talaria-engine", ...).

    ``cfg`` is a ``talaria.config.TelemetryConfig`` (None: defaults). ``span_exporter`` replaces the configured
    destination (tests pass an ``InMemorySpanExporter``). Never raises: a broken exporter setup logs a warning
    and yields a no-op Telemetry, so serving starts regardless.
    """
    if cfg is None:
        from talaria.config import TelemetryConfig

        cfg = TelemetryConfig()
    if not cfg.enabled and span_exporter is None:
        return disabled(service, instance_id)
    try:
        return _setup(service, instance_id, cfg, namespace, span_exporter)
    except Exception as e:  # noqa: BLE001 - observability must not stop a service from starting
        log.warning("telemetry disabled for %s/%s: %s", service, instance_id, e)
        return disabled(service, instance_id)


def _setup(service: str, instance_id: str, cfg: TelemetryConfig, namespace: str, span_exporter: SpanExporter | None) -> Telemetry:
    resource = Resource.create(
        {
            "service.name": service,
            "service.namespace": namespace or "talaria",
            "service.instance.id": instance_id,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
    )
    stats = ExportStats()
    endpoint, protocol = otlp_endpoint(cfg)
    meter_provider = None
    if span_exporter is not None:
        exporter, dest = span_exporter, "memory"
    elif endpoint:
        exporter, dest = _otlp_span_exporter(endpoint, protocol, cfg.export_timeout_s), f"otlp:{endpoint}"
        meter_provider = _otlp_meter_provider(endpoint, protocol, cfg, resource)
    elif cfg.traces_dir:
        path = Path(cfg.traces_dir).expanduser() / f"{service}-{instance_id}-{os.getpid()}.jsonl"
        exporter, dest = JsonlSpanExporter(path, int(cfg.max_file_mb * (1 << 20))), f"file:{path}"
    else:
        return disabled(service, instance_id)
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    processor = BatchSpanProcessor(
        _SafeExporter(exporter, stats),
        max_queue_size=cfg.max_queue_spans,
        max_export_batch_size=min(512, cfg.max_queue_spans),
        schedule_delay_millis=500,
        export_timeout_millis=int(cfg.export_timeout_s * 1000),
    )
    provider.add_span_processor(_CountingProcessor(stats))
    provider.add_span_processor(processor)
    # The SDK warns once per dropped span when the queue is full; one line is enough.
    logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_OncePerMessage())
    EXPORT_ERRORS.install()  # no collector listening: one warning, not an error per batch or interval
    meter = meter_provider.get_meter("talaria") if meter_provider is not None else NoOpMeter("talaria")
    return Telemetry(
        service,
        instance_id,
        provider.get_tracer(f"talaria.{service}"),
        meter,
        stats,
        dest,
        tracer_provider=provider,
        meter_provider=meter_provider,
        _processor=processor,
        timeout_s=cfg.export_timeout_s,
    )


_EXPORT_ERROR = re.compile(r"\bexport(ing)?\b", re.I)  # "Failed to export", "while exporting" (not "Exporter ...")


class _ExportErrorsOnce(logging.Filter):
    """Turns the OpenTelemetry SDK's and exporters' export errors (one or more per batch and per metrics
    interval, with tracebacks, while no collector listens) into one warning; the next error after an export
    succeeded warns again. Other records pass. Mutates the records it lets through (message, no traceback)."""

    LOGGERS = (
        "opentelemetry.exporter.otlp.proto.grpc.exporter",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.otlp.proto.http.metric_exporter",
        "opentelemetry.exporter.otlp.proto.http._common",
        "opentelemetry.sdk.metrics._internal.export",
        "opentelemetry.sdk._shared_internal",
    )

    def __init__(self) -> None:
        super().__init__()
        self._warned = False
        self.suppressed = 0

    def install(self) -> None:
        """Attach to the exporters' loggers (idempotent; mutates those loggers' filter lists)."""
        for name in self.LOGGERS:
            lg = logging.getLogger(name)
            if self not in lg.filters:
                lg.addFilter(self)

    def rearm(self) -> None:
        self._warned = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not _EXPORT_ERROR.search(str(record.msg)):
            return True
        if self._warned:
            self.suppressed += 1
            return False
        self._warned = True
        first = (record.getMessage().strip().splitlines() or [""])[0]
        exc = record.exc_info[1] if record.exc_info else None
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}" if exc is not None else first
        record.msg, record.args, record.exc_info, record.exc_text = (
            "trace/metric collector unreachable (%s); spans and metrics are dropped and counted (telemetry /summary "
            "'export'), and further export errors are not logged until an export succeeds", (why[:300],), None, None)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


EXPORT_ERRORS = _ExportErrorsOnce()  # one per process: the exporters' loggers are process-wide


class _OncePerMessage(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


# ------------------------------------------------------------------------------------------ helpers
def unix_ns(seconds: float) -> int:
    return int(seconds * 1e9)


class ServerInstruments:
    """The GenAI server metrics of an engine, on an OpenTelemetry meter (exported over OTLP when configured;
    the Prometheus view of the same figures comes from the telemetry service, fed by completion hooks)."""

    def __init__(self, meter: Meter):
        self.ttft = meter.create_histogram(GEN_AI_SERVER_TTFT, unit="s", description="Time to generate the first token (engine arrival to first token)")
        self.tpot = meter.create_histogram(GEN_AI_SERVER_TPOT, unit="s", description="Time per output token after the first")
        self.duration = meter.create_histogram(GEN_AI_SERVER_DURATION, unit="s", description="Engine-side duration of a call")
        self.tokens = meter.create_counter("gen_ai.server.token.usage", unit="{token}", description="Input and output tokens")

    def record(self, model: str, instance: str, ttft: float | None, tpot: float | None, duration: float, input_tokens: int, output_tokens: int, error: str | None) -> None:
        try:
            attrs = {GEN_AI_REQUEST_MODEL: model, INSTANCE_ID: instance}
            if error:
                attrs[ERROR_TYPE] = error
            if ttft is not None:
                self.ttft.record(ttft, attrs)
            if tpot is not None:
                self.tpot.record(tpot, attrs)
            self.duration.record(duration, attrs)
            self.tokens.add(input_tokens, {**attrs, "gen_ai.token.type": "input"})
            self.tokens.add(output_tokens, {**attrs, "gen_ai.token.type": "output"})
        except Exception:  # noqa: BLE001
            log.debug("metric record failed", exc_info=True)
