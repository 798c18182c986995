"""The router's part of a call's trace: one SERVER span per HTTP call, a placement span, the W3C
trace context handed to the engine in ``GenerateRequest.trace_context`` (and NATS headers, see
``engine_client``), and the call's outcome as ``gen_ai.*`` attributes.

Span tree of one call (engine spans come from the engine process, joined by the propagated context)::

    chat <model>                     router, SERVER: session, model, instance, usage, finish reason, TTFT seen here
    ├── talaria.placement            router: decision (reason, candidates, loads / cost breakdown, lease), covers
    │                                 decide + forward + the engine's accept (retries on other instances included)
    └── talaria.engine.call          engine, SERVER: queue / prefill / decode children (services/engine/service.py)

Recording never raises into serving: every method swallows its own errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.router.policy import Decision
from talaria import call_hints, otel
from talaria.attribution import CallAttribution
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import telemetry_pb2 as tpb

log = logging.getLogger(__name__)


def incoming_context(headers: Mapping[str, str]) -> dict[str, str]:
    """A client's own ``traceparent``/``tracestate`` headers (the call's trace then continues the client's)."""
    return {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k))}


class CallTrace:
    """Spans of one router call. ``end`` is idempotent (``EngineCall.close`` calls it)."""

    def __init__(self, tracer: trace.Tracer, g, chat: bool, router_id: str, publish: Callable[[tpb.CallRecord], None] | None = None):
        self.t0 = time.time_ns()
        self.publish = publish  # CallRecords for the telemetry service (fire and forget)
        self.record = tpb.CallRecord(schema_version=1, request_id=g.request_id, session_id=g.session_id, model=g.model, router_id=router_id, arrival_unix=self.t0 / 1e9)
        self.usage = None
        self.finish_reason = ""
        self.finished = False
        self.ended = False
        self.error: str | None = None
        self.first_token_ns = 0
        self.output_tokens = 0
        self.model = g.model
        self.router_queue_s = 0.0  # seconds in the gateway's overload queue
        self.forward_ns = 0  # when the call was (last) handed to an engine; placement = t0 -> here minus queue
        self.engine_attribution: CallAttribution | None = None  # the engine's phases, from the finished chunk
        self._start_attrs: dict[str, object] | None = None  # the SERVER span's request attributes, set off the forward path
        self._last: Any = None  # the finished chunk (a TokenChunk), read by end() (after the answer is written)
        try:
            op = "chat" if chat else "text_completion"
            parent = otel.extract(g.trace_context)
            attrs = {
                otel.GEN_AI_OPERATION: op,
                otel.GEN_AI_PROVIDER: "talaria",
                otel.GEN_AI_REQUEST_MODEL: g.model,
                otel.GEN_AI_REQUEST_MAX_TOKENS: int(g.sampling.max_tokens),
                otel.GEN_AI_REQUEST_TEMPERATURE: float(g.sampling.temperature),
                otel.GEN_AI_REQUEST_STREAM: bool(g.stream),
                otel.REQUEST_ID: g.request_id,
                otel.ROUTER_ID: router_id,
            }
            if g.sampling.top_p:
                attrs[otel.GEN_AI_REQUEST_TOP_P] = float(g.sampling.top_p)
            if g.sampling.has_seed:
                attrs[otel.GEN_AI_REQUEST_SEED] = int(g.sampling.seed)
            if g.session_id:
                attrs[otel.SESSION_ID] = g.session_id
                attrs[otel.GEN_AI_CONVERSATION_ID] = g.session_id
            if g.HasField("hints"):  # the call's agent hints
                attrs.update(call_hints.span_attributes(g.hints))
            if g.end_session:
                attrs[call_hints.SESSION_END] = True
            self.tracer = tracer
            # the span now (its context goes with the request), its attributes once the call is forwarded
            # (``placed`` / ``end``): attribute checks are not on the path to the engine
            self._start_attrs = attrs
            self.span = tracer.start_span(f"{op} {g.model}", context=parent, kind=SpanKind.SERVER, start_time=self.t0)
            self.ctx = trace.set_span_in_context(self.span)
            g.trace_context.clear()
            if self.span.get_span_context().is_valid:
                g.trace_context.update(otel.inject({}, self.ctx))
        except Exception:  # noqa: BLE001 - tracing never breaks a call
            log.debug("trace start failed", exc_info=True)
            self.tracer = trace.NoOpTracer()
            self.span = trace.INVALID_SPAN
            self.ctx = None

    def placed(self, decision: Decision, call) -> None:
        """The decision that placed the call (a placement span from the call's start until the engine
        accepted, with ``Decision.attributes``) and the chosen instance."""
        try:
            now = time.time_ns()
            self._set_start_attributes()
            attrs = decision.attributes()
            inst = (call.instance_id if call is not None else None) or decision.instance_id or ""
            ps = self.tracer.start_span("talaria.placement", context=self.ctx, start_time=self.t0, attributes=attrs)
            if call is not None and call.accepted is not None and call.accepted.HasField("usage"):
                ps.set_attribute(otel.GEN_AI_USAGE_INPUT_TOKENS, int(call.accepted.usage.prompt_tokens))
            ps.end(end_time=now)
            self.span.set_attribute(otel.INSTANCE_ID, inst)
            r = self.record
            r.instance_id = inst
            r.placement_reason = decision.reason
            r.lease = decision.lease or "none"
            r.avoidable_open = decision.avoidable_open
            r.opens_model = decision.opens_model
            r.switches_model = decision.switches_model
            chosen = decision.chosen()
            r.kv_source = chosen.kv_source if chosen is not None else ""
            ctx = self.span.get_span_context()
            if ctx.is_valid:
                r.trace_id = f"{ctx.trace_id:032x}"
            self._publish("start")
            self.span.set_attribute("talaria.placement.reason", attrs.get("talaria.placement.reason", ""))
            if "talaria.placement.lease" in attrs:
                self.span.set_attribute("talaria.placement.lease", attrs["talaria.placement.lease"])
        except Exception:  # noqa: BLE001
            log.debug("placement span failed", exc_info=True)

    def queued(self, seconds: float) -> None:
        """The call waited ``seconds`` in the gateway queue. Mutates ``router_queue_s``."""
        self.router_queue_s += max(0.0, seconds)

    def forwarding(self) -> None:
        """The call is being handed to an engine now (the last forward of a retried call counts)."""
        self.forward_ns = time.time_ns()

    def attribution(self, end_ns: int) -> CallAttribution | None:
        """The call's full split: the engine's phases, the router's queue and placement, the
        measured latency (arrival -> ``end_ns``) and the residual ``other_s``; None if it was never forwarded."""
        if not self.forward_ns:
            return None
        placement = max(0.0, (self.forward_ns - self.t0) / 1e9 - self.router_queue_s)
        base = self.engine_attribution or CallAttribution()
        return base.explained(max(0.0, (end_ns - self.t0) / 1e9), router_queue_s=self.router_queue_s, placement_s=placement)

    def chunk(self, c) -> None:
        """Observe one token chunk of the stream (first token time, usage, finish, errors)."""
        try:
            if not self.first_token_ns and (c.token_ids or c.text):
                self.first_token_ns = time.time_ns()
                self.span.add_event("first_token", timestamp=self.first_token_ns)
            self.output_tokens += len(c.token_ids)
            if c.HasField("error"):
                self.error = c.error.code or "engine_error"
            if c.finished:
                self.finished = True
                self.finish_reason = c.finish_reason
                if c.HasField("usage"):
                    self.usage = c.usage
                self._last = c  # its attribution and span attributes are read by end(), after the answer
        except Exception:  # noqa: BLE001
            log.debug("chunk observation failed", exc_info=True)

    def _set_start_attributes(self) -> None:
        """The request attributes on the SERVER span (once). Mutates the span."""
        if self._start_attrs is not None:
            attrs, self._start_attrs = self._start_attrs, None
            self.span.set_attributes(attrs)

    def _finished_chunk(self) -> None:
        """The finished chunk's part of the trace: the engine's time split and the response attributes
        (finish reason, model, usage, the engine's TTFT). Mutates ``engine_attribution`` and the span."""
        c, self._last = self._last, None
        if c is None:
            return
        try:
            if c.HasField("attribution"):
                self.engine_attribution = CallAttribution.from_proto(c.attribution)
            attrs = {otel.GEN_AI_RESPONSE_FINISH_REASONS: [c.finish_reason or "stop"], otel.GEN_AI_RESPONSE_MODEL: self.model}
            if c.HasField("usage"):
                attrs[otel.GEN_AI_USAGE_INPUT_TOKENS] = int(c.usage.prompt_tokens)
                attrs[otel.GEN_AI_USAGE_OUTPUT_TOKENS] = int(c.usage.completion_tokens)
                attrs[otel.GEN_AI_USAGE_CACHE_READ] = int(c.usage.cached_tokens)
            if c.ttft_seconds:
                attrs["talaria.engine.ttft_seconds"] = float(c.ttft_seconds)
            self.span.set_attributes(attrs)
        except Exception:  # noqa: BLE001
            log.debug("finished chunk observation failed", exc_info=True)

    def _publish(self, phase: str) -> None:
        if self.publish is None:
            return
        try:
            rec = tpb.CallRecord()
            rec.CopyFrom(self.record)
            rec.phase = phase
            self.publish(rec)
        except Exception:  # noqa: BLE001
            log.debug("call record not published", exc_info=True)

    def end(self, error: BaseException | str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        r = self.record
        end_ns = time.time_ns()
        try:
            self._set_start_attributes()
        except Exception:  # noqa: BLE001 - recording never breaks a call
            log.debug("span attributes failed", exc_info=True)
        self._finished_chunk()
        r.end_unix = end_ns / 1e9
        try:
            attr = self.attribution(end_ns)
            if attr is not None:
                r.attribution.CopyFrom(attr.to_proto())
        except Exception:  # noqa: BLE001 - recording never breaks a call
            log.debug("attribution failed", exc_info=True)
        r.first_token_unix = self.first_token_ns / 1e9
        r.finish_reason = self.finish_reason
        if self.usage is not None:
            r.usage.CopyFrom(cpb.Usage(
                prompt_tokens=self.usage.prompt_tokens, completion_tokens=self.usage.completion_tokens,
                cached_tokens=self.usage.cached_tokens, restored_tokens=self.usage.restored_tokens,
            ))
        if error is not None:
            r.error = error if isinstance(error, str) else str(getattr(error, "code", None) or type(error).__name__)
            r.http_status = int(getattr(error, "status", 0) or 0)
        elif self.error is not None:
            r.error = self.error
        elif not self.finished:
            r.error = "incomplete"
        self._publish("end")
        try:
            now = time.time_ns()
            if self.first_token_ns:
                ttft = (self.first_token_ns - self.t0) / 1e9
                self.span.set_attribute(otel.GEN_AI_SERVER_TTFT, ttft)
                if self.output_tokens > 1:
                    self.span.set_attribute(otel.GEN_AI_SERVER_TPOT, (now - self.first_token_ns) / 1e9 / (self.output_tokens - 1))
            if error is not None:
                kind = error if isinstance(error, str) else (getattr(error, "code", None) or type(error).__name__)
                self.span.set_attribute(otel.ERROR_TYPE, str(kind))
                status = getattr(error, "status", None)
                if status is not None:
                    self.span.set_attribute("http.response.status_code", int(status))
                self.span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
            elif self.error is not None:
                self.span.set_attribute(otel.ERROR_TYPE, self.error)
                self.span.set_status(Status(StatusCode.ERROR, self.error))
            elif not self.finished:
                self.span.set_attribute(otel.ERROR_TYPE, "incomplete")
                self.span.set_status(Status(StatusCode.ERROR, "call ended before its last chunk (client gone or engine lost)"))
            self.span.end(end_time=now)
        except Exception:  # noqa: BLE001
            log.debug("trace end failed", exc_info=True)
