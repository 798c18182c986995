"""Call tracing of the engine: the spans and metrics of one finished call, written after the fact.

A call's ``talaria.engine.call`` span (child of the router's span) is opened by the service at arrival so that
work on other threads (host KV restore and checkpoint, kvstore RPCs) can be its children; :meth:`CallTracer.trace`
adds its attributes and the phase spans ``intake`` / ``queue`` / ``prefill`` / ``decode`` when it ends. Step start
times (``step_started``, called by the executor thread) split queueing from prefill. No NATS, never raises.
"""

from __future__ import annotations

import collections
import logging
import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from talaria import otel

log = logging.getLogger(__name__)


class CallTracer:
    def __init__(self, telemetry: otel.Telemetry, instance_id: str, pool: str) -> None:
        self.telemetry = telemetry
        self.instruments = otel.ServerInstruments(telemetry.meter)
        self.instance_id, self.pool = instance_id, pool
        self.step_marks: collections.deque[int] = collections.deque(maxlen=512)

    def step_started(self) -> None:
        """Mutates: the recent step start times (executor thread)."""
        self.step_marks.append(time.time_ns())

    def first_step_after(self, t_ns: int) -> int:
        """Start of the first executor step that began at or after ``t_ns`` (0 if no longer known)."""
        marks = list(self.step_marks)
        if not marks or (marks[0] > t_ns and len(marks) == self.step_marks.maxlen):
            return 0
        return next((m for m in marks if m >= t_ns), 0)

    def trace(self, call, reason: str, usage, error: str | None, restored_tokens: int = 0, message: str = "", end_ns: int | None = None) -> None:
        """The engine's spans of one finished call, written after the fact from its timestamps:
        ``talaria.engine.call`` (child of the router's span) with ``intake`` (decode, tokenize, validate),
        ``queue`` (until the first executor step after intake), ``prefill`` (until the first token) and
        ``decode`` (until the end). Never raises."""
        try:
            end = end_ns or time.time_ns()  # end_ns: when the finished chunk went out (spans built later end there)
            prompt = int(usage.prompt_tokens) if usage is not None else call.prompt_tokens
            out = int(usage.completion_tokens) if usage is not None else 0
            cached = int(usage.cached_tokens) if usage is not None else 0
            ttft = (call.first_token_ns - call.arrival_ns) / 1e9 if call.first_token_ns else None
            tpot = (end - call.first_token_ns) / 1e9 / (out - 1) if call.first_token_ns and out > 1 else None
            self.instruments.record(call.model, self.instance_id, ttft, tpot, (end - call.arrival_ns) / 1e9, prompt, out, error)
            if not self.telemetry.enabled:
                return
            source = "host" if restored_tokens else ("device" if cached else "recompute")
            attrs = {
                otel.GEN_AI_OPERATION: "generate",
                otel.GEN_AI_PROVIDER: "talaria",
                otel.GEN_AI_REQUEST_MODEL: call.model,
                otel.GEN_AI_RESPONSE_MODEL: call.model,
                otel.REQUEST_ID: call.request_id,
                otel.INSTANCE_ID: self.instance_id,
                "talaria.pool": self.pool,
                otel.GEN_AI_USAGE_INPUT_TOKENS: prompt,
                otel.GEN_AI_USAGE_OUTPUT_TOKENS: out,
                otel.GEN_AI_USAGE_CACHE_READ: cached,
                otel.GEN_AI_RESPONSE_FINISH_REASONS: [reason or "stop"],
                otel.KV_SOURCE: source,
            }
            if call.session_id:
                attrs[otel.SESSION_ID] = call.session_id
                attrs[otel.GEN_AI_CONVERSATION_ID] = call.session_id
                attrs["talaria.router.believed_prefix_tokens"] = call.believed_prefix  # vs cache.read: a stale belief
            if call.lease_id:
                attrs["talaria.lease.id"] = call.lease_id
            if ttft is not None:
                attrs[otel.GEN_AI_SERVER_TTFT] = ttft
            if tpot is not None:
                attrs[otel.GEN_AI_SERVER_TPOT] = tpot
            tracer = self.telemetry.tracer
            span = call.span
            if span is None:
                span = tracer.start_span("talaria.engine.call", context=call.trace_parent, kind=SpanKind.SERVER, start_time=call.arrival_ns, attributes=attrs)
            else:
                span.set_attributes(attrs)
            if error:
                span.set_attribute(otel.ERROR_TYPE, error)
                span.set_status(Status(StatusCode.ERROR, message or error))
            ctx = trace.set_span_in_context(span)
            accepted = call.accepted_ns or call.arrival_ns
            step = self.first_step_after(accepted) if call.accepted_ns else 0
            queue_end = min(step, call.first_token_ns or end) if step else accepted
            phases = [("talaria.engine.intake", call.arrival_ns, accepted, {})]
            if call.accepted_ns:
                phases.append(("talaria.engine.queue", accepted, queue_end, {otel.QUEUE_SECONDS: (queue_end - accepted) / 1e9, "talaria.queue.exact": bool(step)}))
                prefill_end = call.first_token_ns or end
                phases.append(("talaria.engine.prefill", queue_end, prefill_end, {
                    otel.GEN_AI_USAGE_INPUT_TOKENS: prompt,
                    otel.GEN_AI_USAGE_CACHE_READ: cached,
                    otel.PREFILL_COMPUTED: max(0, prompt - cached),
                    "talaria.prefill.restored_tokens": int(restored_tokens),
                    otel.KV_SOURCE: source,
                    "talaria.kv.device_hit": bool(cached and not restored_tokens),
                }))
                if call.first_token_ns:
                    phases.append(("talaria.engine.decode", call.first_token_ns, end, {otel.GEN_AI_USAGE_OUTPUT_TOKENS: out, **({otel.GEN_AI_SERVER_TPOT: tpot} if tpot is not None else {})}))
            for name, t0, t1, a in phases:
                tracer.start_span(name, context=ctx, start_time=t0, attributes=a).end(end_time=max(t0, t1))
            span.end(end_time=end)
        except Exception:  # noqa: BLE001 - tracing never breaks serving
            log.debug("trace of %s not recorded", call.request_id, exc_info=True)
