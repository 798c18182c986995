"""Engine worker process: a thin NATS shell around one executor (``services.engine.executor.Engine``).

Threads: the asyncio loop owns NATS I/O (decode requests, encode chunks, heartbeats); one executor thread
runs ``engine.step()`` whenever there is work, because a forward pass blocks. The executor's intake
(``add_request``/``abort``) is thread-safe; its outputs come back to the loop through
``call_soon_threadsafe`` and are published in order by a single publisher task.

Per call the engine answers on the caller's reply inbox: an ``accepted`` chunk (with the prompt token
count) or one terminal error chunk, then token chunks, the last with ``finished``; after every call it
publishes a completion hook. A snapshot of the instance goes out every heartbeat period.

Graceful drain (SIGTERM): stop accepting (new calls get 503 ``draining``), let in-flight calls finish up to
``drain_timeout_s``, abort the rest, publish a last snapshot, drain the NATS connection.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.engine.streaming import next_coalesced
from services.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from talaria import otel
from talaria.config import EngineConfig, StackConfig
from talaria.natsutil import close_connection, connect
from talaria.subjects import Subjects
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

# cold-engine control failures (by class name: the service does not import the executor)
_CONTROL_ERRORS = {"UnknownModelError": ("model_not_found", 404), "ModelBusyError": ("model_busy", 409), "ArenaBudgetError": ("insufficient_memory", 507)}


class CallError(Exception):
    """A call the engine refuses; becomes an error chunk with ``status``."""

    def __init__(self, status: int, code: str, message: str, param: str = ""):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def proto(self) -> cpb.Error:
        return cpb.Error(code=self.code, message=self.message, http_status=self.status, param=self.param)


@dataclass(slots=True)
class _Call:
    request_id: str
    reply: str
    session_id: str
    model: str
    arrival_wall: float
    arrival: float
    deadline_wall: float
    prompt_tokens: int
    seq: int = 0
    first_token_at: float = 0.0
    trace_parent: object = None  # OpenTelemetry context propagated by the router (NATS headers / trace_context)
    arrival_ns: int = 0  # wall clock, for spans
    accepted_ns: int = 0
    first_token_ns: int = 0
    span: object = None  # the open ``talaria.engine.call`` span (started at arrival, ended by _trace_call)


class EngineService:
    """One serving instance on NATS. ``engine`` is any object with the executor's API (see backend.py)."""

    def __init__(self, stack: StackConfig, cfg: EngineConfig, engine, *, drain_timeout_s: float = 30.0, telemetry: otel.Telemetry | None = None):
        self.stack = stack
        self.cfg = cfg
        self.engine = engine
        self.model = cfg.models[0]
        self.subjects = Subjects(stack.namespace)
        self.drain_timeout_s = drain_timeout_s
        self.epoch = time.time_ns()
        self.seq = 0
        self.nc: NATS | None = None
        self.draining = False
        self._calls: dict[str, _Call] = {}
        self._out: asyncio.Queue = asyncio.Queue()
        self._wake = threading.Event()
        self._stop_thread = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"calls": 0, "errors": 0, "aborted": 0, "step_failures": 0, "coalesced_steps": 0}
        self.rounds_closed = 0  # slot scheduler rounds published on .round
        self.multi = hasattr(engine, "info")  # a cold engine serves several catalog models
        # Tracing (issue 7): set up in run() unless injected; step start times let a call's span split
        # queueing (until the first step after intake) from prefill (until the first token).
        self._own_telemetry = telemetry is None
        self.telemetry = telemetry if telemetry is not None else otel.disabled()
        self._instruments = otel.ServerInstruments(self.telemetry.meter)
        self._step_marks: collections.deque[int] = collections.deque(maxlen=512)

    def _serves(self, model: str) -> bool:
        return self.engine.serves(model) if self.multi else model == self.model

    def _runtime(self, model: str):
        """What accepting a call for ``model`` needs: tokenizer, vocab_size, max_context, encode_chat."""
        return self.engine.info(model) if self.multi else self.engine

    # ---------------------------------------------------------------- executor thread
    def _run_executor(self) -> None:
        assert self._loop is not None
        while not self._stop_thread.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self._step_marks.append(time.time_ns())
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failing step must fail its calls, not the process
                log.exception("engine step failed")
                self._loop.call_soon_threadsafe(self._fail_all, f"engine step failed: {type(e).__name__}: {e}")
                continue
            if outs:
                self._loop.call_soon_threadsafe(self._out.put_nowait, outs)
            if self.multi:
                recs = self.engine.take_switch_records()
                if recs:
                    self._loop.call_soon_threadsafe(lambda r=recs: asyncio.ensure_future(self._publish_switches(r)))
                rounds = self.engine.take_round_summaries() if hasattr(self.engine, "take_round_summaries") else None
                if rounds:
                    self._loop.call_soon_threadsafe(lambda r=rounds: asyncio.ensure_future(self._publish_rounds(r)))

    def _fail_all(self, message: str) -> None:
        self.counters["step_failures"] += 1
        for rid in list(self._calls):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                pass
            self._finish_with_error(rid, CallError(500, "engine_error", message))

    # ---------------------------------------------------------------- publishing
    def _switch_proto(self, r) -> pb.SwitchRecord:
        ph = r.phase_seconds
        return pb.SwitchRecord(
            schema_version=SCHEMA_VERSION, instance_id=self.cfg.id, seq=r.seq, from_model=r.from_model, to_model=r.to_model,
            reason=r.reason, path=r.path, started_unix=r.started_unix, total_seconds=r.total_seconds,
            save_teardown_seconds=ph[0], open_weights_seconds=ph[1], restore_kv_shell_seconds=ph[2],
            restore_runtime_seconds=ph[3], publish_seconds=ph[4], weight_bytes=r.weight_bytes, staged_bytes=r.staged_bytes,
            host_bytes=r.host_bytes, dirty_bytes=r.dirty_bytes, d2d_seconds=r.d2d_seconds, h2d_seconds=r.h2d_seconds,
            kv_shell_reused=r.kv_shell_reused, runtime_reused=r.runtime_reused,
        )

    async def _publish_switches(self, recs) -> None:
        assert self.nc is not None
        for r in recs:
            try:
                await self.nc.publish(self.subjects.switch(self.cfg.id), self._switch_proto(r).SerializeToString())
            except Exception as e:  # noqa: BLE001
                log.warning("switch record %s not published: %s", r.seq, e)

    def _round_proto(self, r) -> pb.RoundSummary:
        """A slot-scheduler ``RoundSummary`` (services/engine/slots/types.py) as its wire message."""
        return pb.RoundSummary(
            schema_version=SCHEMA_VERSION, instance_id=self.cfg.id, index=r.index, sent_unix=time.time(),
            wall_s=r.wall_s, active_s=r.active_s, switch_s=r.switch_s, bound_s=r.bound_s, predicted_s=r.predicted_s,
            shortfall_s=r.shortfall_s, deadline_risk=r.deadline_risk, infeasible=list(r.infeasible),
            phase_s=dict(r.phase_s), phase_count=dict(r.phase_count), sp_admitted=r.sp_admitted, sp_deferred=r.sp_deferred,
            sp_ineligible=dict(r.sp_ineligible), p_admitted=r.p_admitted, p_deferred=r.p_deferred,
            switch_paths=list(r.switch_paths), flags=dict(r.flags), num_slots=len(r.slots),
        )

    async def _publish_rounds(self, rounds) -> None:
        assert self.nc is not None
        for r in rounds:
            self.rounds_closed += 1
            try:
                await self.nc.publish(self.subjects.round(self.cfg.id), self._round_proto(r).SerializeToString())
            except Exception as e:  # noqa: BLE001
                log.warning("round summary %s not published: %s", r.index, e)

    async def _publisher(self) -> None:
        while True:
            # a lagging publisher folds every step already queued into one chunk per call (streaming.py)
            outs, steps = await next_coalesced(self._out)
            if steps > 1:
                self.counters["coalesced_steps"] += steps - 1
            for o in outs:
                await self._publish_output(o)

    async def _send(self, call: _Call, chunk: pb.TokenChunk) -> None:
        chunk.schema_version = SCHEMA_VERSION
        chunk.request_id = call.request_id
        chunk.instance_id = self.cfg.id
        chunk.seq = call.seq
        call.seq += 1
        assert self.nc is not None
        try:
            await self.nc.publish(call.reply, chunk.SerializeToString())
        except Exception as e:  # noqa: BLE001 - a lost client must not stop the publisher
            log.warning("publish to %s failed: %s", call.reply, e)

    async def _publish_output(self, o: RequestOutput) -> None:
        call = self._calls.get(o.request_id)
        if call is None:
            return  # cancelled/expired: its final chunk was already sent
        now = time.monotonic()
        if o.new_token_ids and not call.first_token_at:
            call.first_token_at = now
            call.first_token_ns = time.time_ns()
        chunk = pb.TokenChunk(token_ids=o.new_token_ids, text=o.new_text)
        if o.finished:
            del self._calls[o.request_id]
            chunk.finished = True
            reason = o.finish_reason or FinishReason.STOP
            chunk.finish_reason = reason.value
            if o.error:
                chunk.error.CopyFrom(cpb.Error(code="engine_error", message=o.error, http_status=500))
            if o.usage is not None:
                chunk.usage.CopyFrom(cpb.Usage(
                    prompt_tokens=o.usage.prompt_tokens, completion_tokens=o.usage.completion_tokens,
                    cached_tokens=o.usage.cached_tokens, restored_tokens=getattr(o.usage, "restored_tokens", 0),
                ))
            chunk.ttft_seconds = (call.first_token_at - call.arrival) if call.first_token_at else 0.0
        await self._send(call, chunk)
        if o.finished:
            self._trace_call(call, chunk.finish_reason, chunk.usage if chunk.HasField("usage") else None, chunk.error.code if chunk.HasField("error") else None, getattr(o.usage, "restored_tokens", 0))
            await self._hook(call, chunk.finish_reason, chunk.usage if chunk.HasField("usage") else None, chunk.error if chunk.HasField("error") else None, chunk.ttft_seconds)

    async def _hook(self, call: _Call, reason: str, usage, error, ttft: float) -> None:
        hook = pb.CompletionHook(
            schema_version=SCHEMA_VERSION,
            request_id=call.request_id,
            session_id=call.session_id,
            model=call.model,
            instance_id=self.cfg.id,
            finish_reason=reason,
            arrival_unix=call.arrival_wall,
            finish_unix=time.time(),
            ttft_seconds=ttft,
        )
        if usage is not None:
            hook.usage.CopyFrom(usage)
        if error is not None:
            hook.error.CopyFrom(error)
        if call.session_id:
            info = self.engine.session_info(call.session_id)
            if info is not None:
                hook.prefix.CopyFrom(self._prefix_handle(info, call.model))
        assert self.nc is not None
        try:
            await self.nc.publish(self.subjects.completed(), hook.SerializeToString())
        except Exception as e:  # noqa: BLE001
            log.warning("completion hook for %s not published: %s", call.request_id, e)

    def _prefix_handle(self, info: dict, model: str = "") -> cpb.PrefixHandle:
        return cpb.PrefixHandle(
            model=model or self.model,
            committed_tokens=int(info.get("committed_tokens", 0)),
            page_size=self.cfg.page_size,
            last_page_hash=int(info.get("last_page_hash", 0)),
            full_pages=int(info.get("full_pages", 0)),
        )

    # ---------------------------------------------------------------- tracing (issue 7)
    def _first_step_after(self, t_ns: int) -> int:
        """Start of the first executor step that began at or after ``t_ns`` (0 if no longer known)."""
        marks = list(self._step_marks)
        if not marks or (marks[0] > t_ns and len(marks) == self._step_marks.maxlen):
            return 0
        return next((m for m in marks if m >= t_ns), 0)

    def _trace_call(self, call: _Call, reason: str, usage, error: str | None, restored_tokens: int = 0, message: str = "") -> None:
        """The engine's spans of one finished call, written after the fact from its timestamps:
        ``talaria.engine.call`` (child of the router's span) with ``intake`` (decode, tokenize, validate),
        ``queue`` (until the first executor step after intake), ``prefill`` (until the first token) and
        ``decode`` (until the end). Never raises."""
        try:
            end = time.time_ns()
            prompt = int(usage.prompt_tokens) if usage is not None else call.prompt_tokens
            out = int(usage.completion_tokens) if usage is not None else 0
            cached = int(usage.cached_tokens) if usage is not None else 0
            ttft = (call.first_token_ns - call.arrival_ns) / 1e9 if call.first_token_ns else None
            tpot = (end - call.first_token_ns) / 1e9 / (out - 1) if call.first_token_ns and out > 1 else None
            self._instruments.record(call.model, self.cfg.id, ttft, tpot, (end - call.arrival_ns) / 1e9, prompt, out, error)
            if not self.telemetry.enabled:
                return
            source = "host" if restored_tokens else ("device" if cached else "recompute")
            attrs = {
                otel.GEN_AI_OPERATION: "generate",
                otel.GEN_AI_PROVIDER: "talaria",
                otel.GEN_AI_REQUEST_MODEL: call.model,
                otel.GEN_AI_RESPONSE_MODEL: self.model,
                otel.REQUEST_ID: call.request_id,
                otel.INSTANCE_ID: self.cfg.id,
                "talaria.pool": self.cfg.pool,
                otel.GEN_AI_USAGE_INPUT_TOKENS: prompt,
                otel.GEN_AI_USAGE_OUTPUT_TOKENS: out,
                otel.GEN_AI_USAGE_CACHE_READ: cached,
                otel.GEN_AI_RESPONSE_FINISH_REASONS: [reason or "stop"],
                otel.KV_SOURCE: source,
            }
            if call.session_id:
                attrs[otel.SESSION_ID] = call.session_id
                attrs[otel.GEN_AI_CONVERSATION_ID] = call.session_id
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
            step = self._first_step_after(accepted) if call.accepted_ns else 0
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

    def _finish_with_error(self, rid: str, err: CallError, reason: str = "error") -> None:
        call = self._calls.pop(rid, None)
        if call is None:
            return
        self.counters["errors"] += 1
        self._trace_call(call, reason, None, err.code)
        chunk = pb.TokenChunk(finished=True, finish_reason=reason, error=err.proto())
        asyncio.ensure_future(self._send(call, chunk))
        asyncio.ensure_future(self._hook(call, reason, None, err.proto(), 0.0))

    # ---------------------------------------------------------------- request intake
    def _sampling(self, sp: pb.SamplingParams) -> SamplingParams:
        if sp.max_tokens < 1:
            raise CallError(422, "invalid_value", "max_tokens must be at least 1", "max_tokens")
        if not 0.0 <= sp.temperature <= 2.0:
            raise CallError(422, "invalid_value", "temperature must be within [0, 2]", "temperature")
        top_p = sp.top_p if sp.top_p > 0 else 1.0
        if top_p > 1.0:
            raise CallError(422, "invalid_value", "top_p must be within (0, 1]", "top_p")
        return SamplingParams(
            temperature=sp.temperature,
            top_p=top_p,
            top_k=sp.top_k,
            seed=sp.seed if sp.has_seed else None,
            max_tokens=sp.max_tokens,
            stop=tuple(sp.stop),
            stop_token_ids=tuple(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
        )

    def _tokenize(self, req: pb.GenerateRequest) -> list[int]:
        which = req.WhichOneof("prompt")
        rt = self._runtime(req.model)
        if which == "text":
            return rt.tokenizer.encode(req.text)
        if which == "token_ids":
            ids = list(req.token_ids.ids)
            vocab = rt.vocab_size
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise CallError(422, "invalid_value", f"token id {bad[0]} is outside the vocabulary (size {vocab})", "prompt")
            return ids
        if which == "messages":
            msgs = [{"role": m.role, "content": m.content} for m in req.messages.messages]
            try:
                return rt.encode_chat(msgs)
            except Exception as e:  # noqa: BLE001 - template errors are the caller's input
                raise CallError(422, "invalid_value", f"messages cannot be rendered by the chat template: {e}", "messages") from None
        raise CallError(422, "missing_field", "request has no prompt", "prompt")

    async def _on_generate(self, msg) -> None:
        req = pb.GenerateRequest()
        try:
            req.ParseFromString(msg.data)
        except Exception:  # noqa: BLE001
            return await self._reject(msg.reply, "", CallError(400, "bad_message", "undecodable GenerateRequest"))
        if not msg.reply:
            return
        arrival_ns = time.time_ns()
        if req.schema_version > SCHEMA_VERSION:
            return await self._reject(msg.reply, req.request_id, CallError(400, "unsupported_schema", f"schema_version {req.schema_version} is newer than this engine's {SCHEMA_VERSION}"))
        if self.draining:
            return await self._reject(msg.reply, req.request_id, CallError(503, "draining", f"instance {self.cfg.id} is draining"))
        if not self._serves(req.model):
            return await self._reject(msg.reply, req.request_id, CallError(404, "model_not_found", f"instance {self.cfg.id} does not serve model '{req.model}'", "model"))
        if len(self._calls) >= self.cfg.max_queue + self.cfg.max_num_seqs:
            return await self._reject(msg.reply, req.request_id, CallError(429, "overloaded", f"instance {self.cfg.id} has {len(self._calls)} calls in flight"))
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._calls:
            return await self._reject(msg.reply, rid, CallError(409, "duplicate_request", f"request id {rid} is already in flight"))
        try:
            sampling = self._sampling(req.sampling)
            prompt = await asyncio.to_thread(self._tokenize, req)
            if not prompt:
                raise CallError(422, "invalid_value", "prompt is empty after tokenization", "prompt")
            limit = self._runtime(req.model).max_context
            if len(prompt) + sampling.max_tokens > limit:
                raise CallError(
                    413,
                    "context_length_exceeded",
                    f"prompt of {len(prompt)} tokens plus max_tokens {sampling.max_tokens} exceeds the context limit of {limit} tokens of model '{req.model}'",
                    "messages" if req.WhichOneof("prompt") == "messages" else "prompt",
                )
        except CallError as e:
            return await self._reject(msg.reply, rid, e)
        call = _Call(rid, msg.reply, req.session_id, req.model, time.time(), time.monotonic(), req.deadline_unix, len(prompt))
        call.arrival_ns = arrival_ns
        call.trace_parent = otel.extract_first(msg.headers, req.trace_context)
        trace_ctx = call.trace_parent
        if self.telemetry.enabled:
            # opened now (attributes and phases are added when it ends) so that work done for the call on other
            # threads — host KV restore and checkpoint, the kvstore's RPCs — can be its children
            call.span = self.telemetry.tracer.start_span("talaria.engine.call", context=call.trace_parent, kind=SpanKind.SERVER, start_time=arrival_ns)
            trace_ctx = trace.set_span_in_context(call.span, call.trace_parent)
        self._calls[rid] = call
        self.counters["calls"] += 1
        try:
            self.engine.add_request(EngineRequest(rid, prompt, sampling, session_id=req.session_id, arrival_time=call.arrival, model=req.model, trace_context=trace_ctx))
        except ValueError as e:
            self._calls.pop(rid, None)
            if call.span is not None:
                call.span.set_status(Status(StatusCode.ERROR, str(e)))
                call.span.end()
            status = 413 if "context" in type(e).__name__.lower() else 422
            return await self._reject(msg.reply, rid, CallError(status, "invalid_request", str(e)))
        call.accepted_ns = time.time_ns()
        self._wake.set()
        await self._send(call, pb.TokenChunk(accepted=True, usage=cpb.Usage(prompt_tokens=len(prompt))))

    async def _reject(self, reply: str, rid: str, err: CallError) -> None:
        self.counters["errors"] += 1
        if not reply:
            return
        chunk = pb.TokenChunk(schema_version=SCHEMA_VERSION, request_id=rid, seq=0, finished=True, finish_reason="error", error=err.proto(), instance_id=self.cfg.id)
        assert self.nc is not None
        await self.nc.publish(reply, chunk.SerializeToString())

    async def _on_cancel(self, msg) -> None:
        req = pb.CancelRequest()
        try:
            req.ParseFromString(msg.data)
        except Exception:  # noqa: BLE001
            return
        self._abort(req.request_id, req.reason or "cancelled")

    def _abort(self, rid: str, reason: str) -> None:
        call = self._calls.pop(rid, None)
        if call is None:
            return
        self.engine.abort(rid)
        self.counters["aborted"] += 1
        self._trace_call(call, "abort", None, "aborted", message=reason)
        asyncio.ensure_future(self._send(call, pb.TokenChunk(finished=True, finish_reason="abort")))
        asyncio.ensure_future(self._hook(call, "abort", None, None, 0.0))
        log.info("aborted %s: %s", rid, reason)

    async def _on_control(self, msg) -> None:
        req = pb.ControlRequest()
        reply = pb.ControlReply(schema_version=SCHEMA_VERSION, ok=True)
        try:
            req.ParseFromString(msg.data)
            if req.op == pb.CONTROL_DRAIN:
                self.draining = True
            elif req.op == pb.CONTROL_RESUME:
                self.draining = False
            elif req.op == pb.CONTROL_FLUSH_CACHE:
                self.engine.flush_cache()
            elif self.multi and req.op == pb.CONTROL_OPEN_MODEL:
                await asyncio.to_thread(self.engine.open_model, req.model)  # loads the bank copy if closed
                self._wake.set()
            elif self.multi and req.op == pb.CONTROL_CLOSE_MODEL:
                await asyncio.to_thread(self.engine.close_model, req.model)
            else:
                reply.ok = False
                reply.error.CopyFrom(cpb.Error(code="unsupported", message=f"control op {pb.ControlOp.Name(req.op)} is not supported by a hot instance", http_status=422))
        except Exception as e:  # noqa: BLE001
            reply.ok = False
            code, status = _CONTROL_ERRORS.get(type(e).__name__, ("bad_message", 400))
            reply.error.CopyFrom(cpb.Error(code=code, message=str(e), http_status=status))
        reply.snapshot.CopyFrom(self.snapshot())
        if msg.reply:
            await msg.respond(reply.SerializeToString())

    # ---------------------------------------------------------------- snapshots
    def snapshot(self) -> pb.InstanceSnapshot:
        st = self.engine.stats()
        self.seq += 1
        snap = pb.InstanceSnapshot(
            schema_version=SCHEMA_VERSION,
            instance_id=self.cfg.id,
            pool=pb.POOL_HOT if self.cfg.pool == "hot" else pb.POOL_COLD,
            epoch=self.epoch,
            seq=self.seq,
            sent_unix=time.time(),
            heartbeat_period_s=self.cfg.heartbeat_period_s,
            num_running=st.get("num_running", 0),
            num_waiting=st.get("num_waiting", 0),
            kv_usage=st.get("kv_usage", 0.0),
            kv_pages_total=st.get("kv_pages_total", 0),
            kv_pages_free=st.get("kv_pages_free", 0),
            draining=self.draining,
            device=self.cfg.device,
            tokens_generated=st.get("tokens_generated", 0),
            prefix_hit_rate=st.get("prefix_hit_rate", 0.0),
        )
        if self.multi:  # every loaded catalog model is served; `active` marks the resident one
            for m in st.get("models", []):
                snap.models.append(pb.ModelState(**m))
            snap.staging_slack_bytes = st.get("staging_slack_bytes", 0)
            snap.num_switches = st.get("num_switches", 0)
            for r in list(self.engine.switch_records)[-8:]:
                snap.switches.append(self._switch_proto(r))
            slots = st.get("slots")
            if slots:  # slot scheduler: overload is reported, not hidden (Talaria §3.4)
                snap.deadline_risk = bool(slots.get("deadline_risk"))
                snap.shortfall_s = float(slots.get("shortfall_s", 0.0))
                snap.round_remaining_s = float(slots.get("round_remaining_s", 0.0))
                snap.infeasible.extend(slots.get("infeasible", []))
                snap.rounds = self.rounds_closed
        else:
            snap.models.append(
                pb.ModelState(model=self.model, loaded=True, active=True, max_context=self.engine.max_context, num_running=snap.num_running, num_waiting=snap.num_waiting)
            )
        for s in st.get("sessions", []):
            snap.sessions.append(pb.SessionState(session_id=s["session_id"], model=s.get("model") or self.model, committed_tokens=s["committed_tokens"], state=pb.KV_DEVICE, last_use_unix=s.get("last_use_unix", 0.0)))
        prof = st.get("profile") or {}
        snap.profile.CopyFrom(pb.CostProfile(prefill_per_token=prof.get("prefill_per_token", 0.0), decode_step=prof.get("decode_step", 0.0), switch_by_path=prof.get("switch_by_path", {})))
        self._add_host_kv_state(snap, st)
        return snap

    def _add_host_kv_state(self, snap: pb.InstanceSnapshot, st: dict) -> None:
        """Sessions whose KV left the device: ``host`` (restorable from the kvstore) or ``missing`` (the
        store restarted, or is unreachable); plus the measured restore cost per token."""
        hk = st.get("host_kv")
        if not hk:
            return
        snap.profile.restore_per_token = hk.get("restore_per_token", 0.0)
        on_device = {s.session_id for s in snap.sessions}
        for s in hk.get("sessions", []):
            if s["session_id"] in on_device:
                continue
            state = pb.KV_HOST if s["state"] == "host" else pb.KV_MISSING
            snap.sessions.append(pb.SessionState(session_id=s["session_id"], model=s.get("model") or self.model, committed_tokens=s["committed_tokens"], state=state, last_use_unix=s.get("last_use_unix", 0.0)))

    async def _heartbeats(self) -> None:

        assert self.nc is not None
        while True:
            try:
                await self.nc.publish(self.subjects.heartbeat(self.cfg.id), self.snapshot().SerializeToString())
            except Exception as e:  # noqa: BLE001 - keep beating through reconnects
                log.warning("heartbeat not published: %s", e)
            await asyncio.sleep(self.cfg.heartbeat_period_s)

    async def _deadlines(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for rid, call in list(self._calls.items()):
                if call.deadline_wall and now > call.deadline_wall:
                    self._abort(rid, "deadline passed")

    # ---------------------------------------------------------------- lifecycle
    async def run(self, stop: asyncio.Event, url: str) -> None:
        self._loop = asyncio.get_running_loop()
        if self._own_telemetry:
            self.telemetry = otel.setup("talaria-engine", self.cfg.id, self.stack.telemetry, self.stack.namespace)
            self._instruments = otel.ServerInstruments(self.telemetry.meter)
        self.nc = await connect(url, f"engine-{self.cfg.id}", self.stack.nats)
        self._thread = threading.Thread(target=self._run_executor, name=f"executor-{self.cfg.id}", daemon=True)
        self._thread.start()
        subs = [
            await self.nc.subscribe(self.subjects.generate(self.cfg.id), cb=self._on_generate),
            await self.nc.subscribe(self.subjects.cancel(self.cfg.id), cb=self._on_cancel),
            await self.nc.subscribe(self.subjects.control(self.cfg.id), cb=self._on_control),
        ]
        tasks = [asyncio.create_task(t) for t in (self._publisher(), self._heartbeats(), self._deadlines())]
        print(f"engine {self.cfg.id} serving {', '.join(self.cfg.models) if self.multi else self.model} on {self.cfg.device}", flush=True)
        try:
            await stop.wait()
        finally:
            await self._drain(subs, tasks)

    async def _drain(self, subs, tasks) -> None:
        self.draining = True
        assert self.nc is not None
        try:
            await self.nc.publish(self.subjects.heartbeat(self.cfg.id), self.snapshot().SerializeToString())
        except Exception:  # noqa: BLE001
            pass
        deadline = time.monotonic() + self.drain_timeout_s
        while self._calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._calls):
            self._abort(rid, "engine shutting down")
        await asyncio.sleep(0.05)  # let the publisher flush final chunks
        self._stop_thread.set()
        self._wake.set()
        for t in tasks:
            t.cancel()
        await close_connection(self.nc, subs)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._own_telemetry:
            await asyncio.to_thread(self.telemetry.shutdown)  # bounded by telemetry.export_timeout_s
