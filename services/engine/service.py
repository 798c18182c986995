"""Engine worker process: a thin NATS shell around one executor (``services.engine.executor.Engine``).

Threads: the asyncio loop owns NATS I/O (decode requests, encode chunks); one executor thread runs
``engine.step()`` whenever there is work, because a forward pass blocks; heartbeats go out from their own
thread, loop and connection (``heartbeat.py``), so neither a long step nor a busy loop can starve them. The executor's intake
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
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from http.server import ThreadingHTTPServer
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.engine.streaming import ExecutorHold, coalesce_outputs, next_coalesced
from talaria.tokenizer import RESERVED_TEMPLATE_VARS, SessionTokens, align_to_previous, chat_message_dict, continue_final_message
from services.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from services.engine import wire
from services.engine.api import ContextLengthError, Executor, ExecutorError, KvLocation, ModelInfo, ModelPool, UnsupportedOperationError
from services.engine.heartbeat import HeartbeatThread
from services.engine.tracing import CallTracer
from services.engine.kv.retention import Hint, RetentionBook
from services.engine.tool_watch import ToolWatch
from services.engine.wire import SCHEMA_VERSION, CallError
from talaria import call_hints, otel, reasoning_parsers
from talaria.config import EngineConfig, StackConfig
from talaria.natsutil import close_connection, connect
from talaria.subjects import PROBE_GONE, PROBE_HEADER, Subjects
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from talaria.vllm_metrics import ServingMetrics

if TYPE_CHECKING:
    from services.engine.grammar import GrammarFactory
    from services.engine.slots.types import RoundSummary
    from services.engine.substrate.switch import SwitchRecord
    from services.engine.types import Logprob

log = logging.getLogger(__name__)

REQUESTER_PROBE_S = 2.0  # how often calls older than this check that their requester still listens



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
    trace_parent: Context | None = None  # OpenTelemetry context propagated by the router (NATS headers / trace_context)
    arrival_ns: int = 0  # wall clock, for spans
    accepted_ns: int = 0
    first_token_ns: int = 0
    span: Span | None = None  # the open ``talaria.engine.call`` span (started at arrival, ended by CallTracer.trace)
    last_sent: float = 0.0  # monotonic time of the last chunk published on the reply inbox (keepalives)
    token_ids: list[int] | None = None  # session calls: prompt + generated ids, kept for prompt alignment
    lease_id: str = ""  # the lease the router honoured for this call
    believed_prefix: int = 0  # committed tokens the router believed the session holds (may be stale)
    tenant: str = ""
    hints: pb.AgentCallHints | None = None  # the call's AgentCallHints (echoed in the hook), or None
    end_session: bool = False  # X-Session-End: the session ends with this call
    stream: bool = True  # GenerateRequest.stream: False = the router reads only the whole answer
    held: RequestOutput | None = None  # non-streaming: outputs after the first token, merged, sent at the end
    tools: ToolWatch | None = None  # calls that offered tools: tool-call header / names
    reasoning: reasoning_parsers.TokenCounter | None = None  # reasoning models: their reasoning tokens, by token id
    generated: int = 0
    flush_timer: bool = False  # a ``_flush_held`` timer is pending for ``held`` (streaming, stream_interval_ms)


class EngineService:
    """One serving instance on NATS around an executor (``api.Executor``: the hot Engine or a ColdEngine)."""

    def __init__(
        self, stack: StackConfig, cfg: EngineConfig, engine: Executor, *, drain_timeout_s: float = 30.0,
        telemetry: otel.Telemetry | None = None, requester_probe_s: float = REQUESTER_PROBE_S,
    ):
        self.stack = stack
        self.cfg = cfg
        self.engine = engine
        self.model = cfg.models[0]
        self.subjects = Subjects(stack.namespace)
        self.drain_timeout_s = drain_timeout_s
        self.requester_probe_s = requester_probe_s
        self.stream_interval_s = cfg.stream_interval_ms / 1e3
        self.epoch = time.time_ns()
        self.seq = 0
        self._seq_lock = threading.Lock()  # snapshot() runs on the heartbeat thread and the loop
        self._beat: HeartbeatThread | None = None
        self.nc: NATS | None = None
        self.draining = False
        self._calls: dict[str, _Call] = {}
        self._out: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()  # fire-and-forget work of finished calls (``_spawn``)
        self._wake = threading.Event()
        self._stop_thread = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"calls": 0, "errors": 0, "aborted": 0, "step_failures": 0, "coalesced_steps": 0}
        self._hold = ExecutorHold()  # non-streaming calls' outputs merged on the executor thread
        self.rounds_closed = 0  # slot scheduler rounds published on .round
        self.multi = cfg.pool == "cold"  # a cold engine serves several catalog models
        # Tracing: set up in run() unless injected; step start times let a call's span split
        # queueing (until the first step after intake) from prefill (until the first token).
        self._own_telemetry = telemetry is None
        self.telemetry = telemetry if telemetry is not None else otel.disabled()
        self.tracer = CallTracer(self.telemetry, cfg.id, cfg.pool)
        self._grammars: dict[str, GrammarFactory] = {}  # model -> GrammarFactory (structured output)
        self._session_ids = SessionTokens()  # session -> last call's prompt + output ids (prompt alignment)
        self._ending: dict[str, str] = {}  # session -> tenant, ended while a call of it was in flight
        self.retention = RetentionBook(time.time)  # router hints: evict by predicted return
        self.serving_metrics = ServingMetrics()  # this engine's vLLM-named /metrics (cfg.metrics_port)
        self.metrics_server: tuple[ThreadingHTTPServer, threading.Thread] | None = None  # (HTTP server, thread) once run() started it

    def _serves(self, model: str) -> bool:
        return self.engine.serves(model)

    def _runtime(self, model: str) -> ModelInfo:
        """What accepting a call for ``model`` needs: tokenizer, vocab_size, max_context, encode_chat."""
        return self.engine.info(model)

    # ---------------------------------------------------------------- executor thread
    def _run_executor(self) -> None:
        assert self._loop is not None
        while not self._stop_thread.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.tracer.step_started()
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failing step must fail its calls, not the process
                log.exception("engine step failed")
                self._loop.call_soon_threadsafe(self._fail_all, f"engine step failed: {type(e).__name__}: {e}")
                continue
            pool = self.engine.pool()
            if not outs and pool is not None:  # a cold slot held open for expected returns: sleep until a call arrives or the hold ends
                pause = pool.idle_wait_s()
                if pause > 0:
                    self._wake.wait(min(pause, 0.05))
                    self._wake.clear()
            outs = self._hold.filter(outs)  # held calls' steps never wake the loop (streaming.ExecutorHold)
            if outs:
                self._loop.call_soon_threadsafe(self._out.put_nowait, outs)
            if pool is None:
                continue
            recs = pool.take_switch_records()
            if recs:
                self._loop.call_soon_threadsafe(self._publish_later, self._publish_switches(recs))
            rounds = pool.take_round_summaries()
            if rounds:
                self._loop.call_soon_threadsafe(self._publish_later, self._publish_rounds(rounds))

    @staticmethod
    def _publish_later(coro: Coroutine[Any, Any, None]) -> None:
        """On the loop: run a publishing coroutine the executor thread handed over."""
        asyncio.ensure_future(coro)

    def _fail_all(self, message: str) -> None:
        self.counters["step_failures"] += 1
        for rid in list(self._calls):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                pass
            self._finish_with_error(rid, CallError(500, "engine_error", message))

    # ---------------------------------------------------------------- publishing
    async def _publish_switches(self, recs: Sequence[SwitchRecord]) -> None:
        assert self.nc is not None
        for r in recs:
            try:
                await self.nc.publish(self.subjects.switch(self.cfg.id), wire.switch_record(r, self.cfg.id).SerializeToString())
            except Exception as e:  # noqa: BLE001
                log.warning("switch record %s not published: %s", r.seq, e)

    async def _publish_rounds(self, rounds: Sequence[RoundSummary]) -> None:
        assert self.nc is not None
        for r in rounds:
            self.rounds_closed += 1
            try:
                await self.nc.publish(self.subjects.round(self.cfg.id), wire.round_summary(r, self.cfg.id).SerializeToString())
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

    def _flush_held(self, call: _Call) -> None:
        """Timer of a streaming call's held tokens (``stream_interval_ms``): an empty output queued behind
        the outputs already waiting, so the publisher sends what is held, in order, if nothing did."""
        if call.flush_timer and self._calls.get(call.request_id) is call:
            call.flush_timer = False  # a hold after this one sets its own timer
            self._out.put_nowait([RequestOutput(call.request_id, [], "")])

    async def _send(self, call: _Call, chunk: pb.TokenChunk) -> None:
        chunk.schema_version = SCHEMA_VERSION
        chunk.request_id = call.request_id
        chunk.instance_id = self.cfg.id
        chunk.seq = call.seq
        call.seq += 1
        call.last_sent = time.monotonic()
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
        call.generated += len(o.new_token_ids)
        if call.tools is not None and call.tools.feed(o.new_text, call.generated):
            self._publish_intent(call)  # as the header streams, even when the tokens below are held
        timer = not (o.new_token_ids or o.new_text or o.finished)  # ``_flush_held``'s output: send what is held
        if call.first_token_at and not o.finished and (not call.stream or (now < call.last_sent + self.stream_interval_s and not timer)):
            # a non-streaming call's reader wants the whole answer, so after its first token
            # (sent at once: TTFT stays observable) its outputs are merged and go out with the finished
            # one -- two token messages per call instead of one per token; keepalives cover the silence.
            # A streaming call with ``stream_interval_ms`` holds its tokens until that long after its last
            # message (a timer sends them if no step comes sooner)
            call.held = o if call.held is None else coalesce_outputs([[call.held], [o]])[0]
            if call.stream and not call.flush_timer:
                call.flush_timer = True
                asyncio.get_running_loop().call_at(call.last_sent + self.stream_interval_s, self._flush_held, call)
            return
        call.flush_timer = False
        if timer and call.held is None:
            return  # a step sent the held tokens before the timer fired
        if call.held is not None:
            o, call.held = coalesce_outputs([[call.held], [o]])[0], None
        if o.new_token_ids and not call.first_token_at:
            call.first_token_at = now
            call.first_token_ns = time.time_ns()
            if not call.stream and call.tools is None and not o.finished:
                self._hold.hold(call.request_id)  # its reader wants the rest at the end: merged on the executor
        chunk = pb.TokenChunk(token_ids=o.new_token_ids, text=o.new_text)
        if o.logprobs:
            self._add_logprobs(chunk, o.logprobs, call.model)
        if call.token_ids is not None:
            call.token_ids += o.new_token_ids
        if call.reasoning is not None:
            call.reasoning.feed(o.new_token_ids)
        if o.finished:
            del self._calls[o.request_id]
            self._hold.release(o.request_id)
            if call.token_ids is not None and not o.error:
                self._session_ids.put(call.session_id, call.model, call.token_ids)
            chunk.finished = True
            reason = o.finish_reason or FinishReason.STOP
            chunk.finish_reason = reason.value
            chunk.stop_reason = o.stop_reason
            if o.error:
                chunk.error.CopyFrom(cpb.Error(code="engine_error", message=o.error, http_status=500))
            if o.usage is not None:
                chunk.usage.CopyFrom(cpb.Usage(
                    prompt_tokens=o.usage.prompt_tokens, completion_tokens=o.usage.completion_tokens,
                    cached_tokens=o.usage.cached_tokens, restored_tokens=o.usage.restored_tokens,
                    reasoning_tokens=call.reasoning.count if call.reasoning is not None else 0,
                ))
            chunk.ttft_seconds = (call.first_token_at - call.arrival) if call.first_token_at else 0.0
            if o.attribution is not None:  # the executor's phases; other_s = what they leave of our latency
                chunk.attribution.CopyFrom(o.attribution.explained(max(0.0, time.monotonic() - call.arrival)).to_proto())
        sent_ns = time.time_ns() if o.finished else 0  # the call's end, as its spans record it
        await self._send(call, chunk)
        if o.finished:
            # the call's spans and hook are built after the finished chunk is on the wire (per-call
            # work off the token path): a task that runs once the NATS flusher has written the chunk; the
            # hook still follows the chunk on this connection
            self._spawn(self._after_call(call, chunk, o.usage.restored_tokens if o.usage is not None else 0, sent_ns))

    async def _after_call(self, call: _Call, chunk: pb.TokenChunk, restored: int, sent_ns: int) -> None:
        """A finished call's completion hook (``_hook``: first, routers install the session's lease from it)
        and spans (``CallTracer.trace``), which end at ``sent_ns`` (when the finished chunk went out: inside
        the router's call span, which ends after it received that chunk)."""
        usage = chunk.usage if chunk.HasField("usage") else None
        await self._hook(call, chunk.finish_reason, usage, chunk.error if chunk.HasField("error") else None, chunk.ttft_seconds,
                         chunk.attribution if chunk.HasField("attribution") else None)
        self.tracer.trace(call, chunk.finish_reason, usage, chunk.error.code if chunk.HasField("error") else None, restored, end_ns=sent_ns)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task held in ``_tasks`` until it ends (a bare ensure_future can be collected)."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _add_logprobs(self, chunk: pb.TokenChunk, entries: list[Logprob], model: str) -> None:
        """Sampler log-probabilities as wire entries, each token decoded alone (mutates ``chunk``)."""
        tok = self._runtime(model).tokenizer
        for tid, lp, alts in entries:
            e = chunk.logprobs.add(token_id=tid, token=tok.decode([tid]), logprob=lp)
            for aid, alp in alts:
                e.top.add(token_id=aid, token=tok.decode([aid]), logprob=alp)

    async def _hook(self, call: _Call, reason: str, usage: cpb.Usage | None, error: cpb.Error | None, ttft: float,
                    attribution: cpb.CallAttribution | None = None) -> None:
        ended = await self._end_after(call)
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
        if call.tools is not None and error is None:
            hook.tool_names.extend(call.tools.finish())
            hook.tool_call_count = len(hook.tool_names)
        if error is not None:
            hook.error.CopyFrom(error)
        if attribution is not None:
            hook.attribution.CopyFrom(attribution)
        if call.session_id:
            info = self.engine.session_info(call.session_id)
            if info is not None and info.where is KvLocation.DEVICE:
                hook.prefix.CopyFrom(wire.prefix_handle(info, call.model, self.cfg.page_size))
        if call.hints is not None:
            hook.hints.CopyFrom(call.hints)
        hook.session_ended = ended
        hook.kv_restore_verify_failures = self.engine.stats().kv_restore_verify_failures
        self.serving_metrics.observe_hook(hook)
        assert self.nc is not None
        try:
            await self.nc.publish(self.subjects.completed(), hook.SerializeToString())
        except Exception as e:  # noqa: BLE001
            log.warning("completion hook for %s not published: %s", call.request_id, e)

    # ---------------------------------------------------------------- session end
    async def _end_after(self, call: _Call) -> bool:
        """At a call's end: end its session when the call carried ``end_session`` or the session was ended
        (CONTROL_END_SESSION) while it ran, unless another call of the session still runs (that one ends it).
        Returns whether the session ended now. Mutates ``_ending``."""
        sid = call.session_id
        if not sid or not (call.end_session or sid in self._ending):
            return False
        tenant = self._ending.pop(sid, call.tenant)
        if any(c.session_id == sid for c in self._calls.values()):
            self._ending[sid] = tenant
            return False
        await self._end_now(sid, tenant, call.model)
        return True

    async def _end_now(self, session_id: str, tenant: str, model: str) -> None:
        ids = self._session_ids.pop(session_id, model) or ()
        freed = await asyncio.to_thread(self.engine.end_session, session_id, tenant, ids)  # waits for the running step
        self.counters["sessions_ended"] = self.counters.get("sessions_ended", 0) + 1
        log.info("session %s ended: %d device pages freed", session_id, freed)

    async def _on_end_session(self, req: pb.ControlRequest) -> None:
        """CONTROL_END_SESSION: end now, or after the session's in-flight calls (the last one's hook says so).
        Idempotent: ending an unknown or ended session frees nothing and succeeds."""
        if not req.session_id:
            raise ValueError("CONTROL_END_SESSION needs session_id")
        if any(c.session_id == req.session_id for c in self._calls.values()):
            self._ending[req.session_id] = req.tenant
            return
        self._ending.pop(req.session_id, None)
        await self._end_now(req.session_id, req.tenant, req.model or self.model)

    def _publish_intent(self, call: _Call) -> None:
        """A tool-call header streamed (``ToolWatch``): tell the routers now, before the call ends. Fire and forget; mutates nothing."""
        assert call.tools is not None and self.nc is not None
        intent = pb.ToolIntent(
            schema_version=SCHEMA_VERSION, request_id=call.request_id, session_id=call.session_id, model=call.model,
            instance_id=self.cfg.id, tool_name=call.tools.intent, seen_unix=time.time(), prompt_tokens=call.prompt_tokens,
            generated_tokens=call.generated,
        )
        self.counters["tool_intents"] = self.counters.get("tool_intents", 0) + 1

        nc = self.nc

        async def send() -> None:
            try:
                await nc.publish(self.subjects.intent(), intent.SerializeToString())
            except Exception as e:  # noqa: BLE001
                log.warning("tool intent for %s not published: %s", call.request_id, e)

        asyncio.ensure_future(send())

    async def _on_retention(self, msg: Msg) -> None:
        """A router's ``RetentionHint``: the session cache evicts by predicted return (``kv/retention.py``)."""
        h = pb.RetentionHint()
        try:
            h.ParseFromString(msg.data)
        except Exception:  # noqa: BLE001 - one bad message must not stop the subscription
            return
        if h.session_id:
            self.retention.note(h.session_id, Hint(h.t_done_unix, h.gap_mu, h.gap_sigma, h.window_s, h.model))

    def _finish_with_error(self, rid: str, err: CallError, reason: str = "error") -> None:
        call = self._calls.pop(rid, None)
        if call is None:
            return
        self._hold.release(rid)
        self.counters["errors"] += 1
        self.tracer.trace(call, reason, None, err.code)
        chunk = pb.TokenChunk(finished=True, finish_reason=reason, error=err.proto())
        asyncio.ensure_future(self._send(call, chunk))
        asyncio.ensure_future(self._hook(call, reason, None, err.proto(), 0.0))

    # ---------------------------------------------------------------- request intake
    def _intake(self, req: pb.GenerateRequest) -> tuple[SamplingParams, list[int], bool]:
        """Decode, tokenize and compile the call's constraint (runs on a worker thread; raises CallError).
        Range checks are the executor's (``validate_request``)."""
        sampling = wire.sampling_params(req.sampling)
        prompt, opens, closes = self._tokenize(req)
        if req.sampling.constraint.kind:
            sampling = dataclasses.replace(sampling, grammar=self._grammar(req))
        if req.sampling.constraint.kind or req.sampling.thinking_token_budget:
            sampling = dataclasses.replace(sampling, reasoning_gate=self._reasoning_gate(req, opens, closes, req.sampling.thinking_token_budget))
        return sampling, prompt, opens

    def _reasoning_gate(self, req: pb.GenerateRequest, opens: bool, closes: bool, budget: int) -> tuple[int, int, bool, int] | None:
        """The reasoning gate of a reasoning model's constrained or budgeted chat call (the markers' ids, whether
        the prompt opened the reasoning, the budget): its grammar starts after the reasoning, which ends at the
        budget. None where the prompt closed the reasoning (nothing to gate or cap) or, without a budget, where
        the markers are not single tokens (the grammar starts at the first token; the output holds no
        reasoning). Raises CallError 400 for a budget it cannot enforce (no reasoning parser, markers that are
        not single tokens). Pure."""
        fmt = self.reasoning_format(req.model) if req.WhichOneof("prompt") == "messages" else ""
        ids = reasoning_parsers.marker_ids(fmt, self._runtime(req.model).tokenizer.token_to_id) if fmt else None
        if budget and ids is None:
            why = "has no reasoning parser" if not fmt else "has reasoning markers that are not single tokens"
            raise CallError(400, "unsupported_parameter", f"model '{req.model}' {why}: thinking_token_budget cannot be enforced", "thinking_token_budget")
        if ids is None or closes:
            return None
        return (*ids, opens, budget)

    def reasoning_format(self, model: str) -> str:
        """The reasoning format of ``model``'s output ("" = none): ``reasoning_parsers`` of this engine's
        config names it per model, else it is detected from the chat template (talaria/reasoning_parsers.py)."""
        fmt = self.cfg.reasoning_parsers.get(model)
        if fmt is None:
            return reasoning_parsers.detect_format(self._runtime(model).tokenizer.chat_template)
        return "" if fmt == reasoning_parsers.NONE else fmt

    def _effort_kwargs(self, req: pb.GenerateRequest) -> dict[str, Any]:
        """The chat-template variables for the call's ``reasoning_effort`` ({} when not asked). Raises
        CallError 400 naming the field when the model does not reason or its template has no switch."""
        effort = req.chat_template.reasoning_effort
        if not effort:
            return {}
        if effort not in reasoning_parsers.EFFORTS:
            raise CallError(400, "invalid_value", f"reasoning_effort must be one of {', '.join(reasoning_parsers.EFFORTS)}, got {effort!r}", "reasoning_effort")
        if not self.reasoning_format(req.model):
            if effort == "none":
                return {}  # no reasoning asked of a model that does not reason: nothing to switch
            raise CallError(400, "unsupported_parameter", f"model '{req.model}' has no reasoning parser: reasoning_effort cannot be honoured", "reasoning_effort")
        kw = reasoning_parsers.effort_kwargs(self._runtime(req.model).tokenizer.chat_template, effort)
        if kw is None:
            raise CallError(400, "unsupported_parameter", f"the chat template of model '{req.model}' has no reasoning switch "
                            "(enable_thinking or reasoning_effort): reasoning_effort cannot be honoured", "reasoning_effort")
        return kw

    def _grammar(self, req: pb.GenerateRequest) -> object:
        """Compile the call's structured-output constraint (bounded time; see grammar.py). Mutates the
        per-model grammar-factory cache."""
        from services.engine.grammar import GrammarError, GrammarFactory

        rt = self._runtime(req.model)
        factory = self._grammars.get(req.model)
        if factory is None:
            factory = self._grammars[req.model] = GrammarFactory(rt.tokenizer, rt.vocab_size, list(rt.tokenizer.eos_token_ids))
        c = req.sampling.constraint
        try:
            tools = json.loads(req.tools_json) if req.tools_json else []
            return factory.compile(c.kind, c.json_schema, tools, c.tool_choice, rt.tokenizer.tool_format)
        except GrammarError as e:
            raise CallError(400, "invalid_value", str(e), e.param) from None

    def _tokenize(self, req: pb.GenerateRequest) -> tuple[list[int], bool, bool]:
        """The prompt's token ids, and whether its text ends inside an unclosed reasoning block / right after a
        closed one (chat only)."""
        which = req.WhichOneof("prompt")
        rt = self._runtime(req.model)
        if which == "text":
            return rt.tokenizer.encode(req.text), False, False
        if which == "token_ids":
            return list(req.token_ids.ids), False, False  # the executor checks them against its vocabulary
        if which == "messages":
            msgs = [chat_message_dict(m) for m in req.messages.messages]
            tools = json.loads(req.tools_json) if req.tools_json else None
            opts = req.chat_template
            try:
                kwargs = json.loads(opts.kwargs_json) if opts.kwargs_json else {}
            except ValueError as e:
                raise CallError(400, "invalid_value", f"chat_template_kwargs is not a JSON object: {e}", "chat_template_kwargs") from None
            if not isinstance(kwargs, dict) or (reserved := set(kwargs) & RESERVED_TEMPLATE_VARS):
                name = sorted(reserved)[0] if isinstance(kwargs, dict) else ""
                raise CallError(400, "invalid_value", f"chat_template_kwargs may not set {name or 'a non-object'}: the request sets it", "chat_template_kwargs" + (f".{name}" if name else ""))
            kwargs = {**self._effort_kwargs(req), **kwargs}  # explicit chat_template_kwargs win over reasoning_effort
            try:
                text = rt.tokenizer.render_chat_template(msgs, tools=tools, add_generation_prompt=not opts.no_generation_prompt
                                                         and not opts.continue_final_message, **kwargs)
            except Exception as e:  # noqa: BLE001 - template errors are the caller's input
                raise CallError(400, "invalid_value", f"messages cannot be rendered by the chat template: {e}", "messages") from None
            if opts.continue_final_message:
                try:
                    text = continue_final_message(text, msgs)
                except ValueError as e:
                    raise CallError(400, "invalid_value", str(e), "continue_final_message") from None
            fmt = self.reasoning_format(req.model)
            opens, closes = reasoning_parsers.prompt_opens_reasoning(text, fmt), reasoning_parsers.prompt_closes_reasoning(text, fmt)
            return align_to_previous(rt.tokenizer, self._session_ids.get(req.session_id, req.model), text), opens, closes
        raise CallError(400, "missing_field", "request has no prompt", "prompt")

    def _fence(self, req: pb.GenerateRequest) -> CallError | None:
        """Fencing: a call placed on a lease (resume token) names the epoch of the engine that
        served the session; after a restart this engine no longer holds that KV, so it refuses the call and
        the router places it again without the lease. Mutates ``counters`` when it refuses."""
        if not req.resume_epoch or req.resume_epoch == self.epoch:
            return None
        self.counters["resume_fenced"] = self.counters.get("resume_fenced", 0) + 1
        return CallError(503, "resume_fenced", f"instance {self.cfg.id} restarted since the resumed call (epoch {req.resume_epoch}, now {self.epoch})")

    async def _on_generate(self, msg: Msg) -> None:
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
        if (fenced := self._fence(req)) is not None:
            return await self._reject(msg.reply, req.request_id, fenced)
        if not self._serves(req.model):
            return await self._reject(msg.reply, req.request_id, CallError(404, "model_not_found", f"instance {self.cfg.id} does not serve model '{req.model}'", "model"))
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._calls:
            return await self._reject(msg.reply, rid, CallError(409, "duplicate_request", f"request id {rid} is already in flight"))
        try:
            # tokenizing text, rendering a chat template or compiling a grammar runs on a worker thread; a
            # token-id prompt without a constraint is decoded here (no thread hop per call)
            cheap = req.WhichOneof("prompt") == "token_ids" and not req.sampling.constraint.kind
            sampling, prompt, opens = self._intake(req) if cheap else await asyncio.to_thread(self._intake, req)
        except CallError as e:
            return await self._reject(msg.reply, rid, e)
        if len(self._calls) >= self.cfg.max_queue + self.cfg.max_num_seqs:
            # a call that can never fit is 413 even now: a client retrying a 429 would loop forever
            limit = self._runtime(req.model).max_context
            err = (CallError(413, "context_length_exceeded", str(ContextLengthError(len(prompt), sampling.max_tokens, limit, req.model)), "prompt")
                   if len(prompt) + sampling.max_tokens > limit else
                   CallError(429, "overloaded", f"instance {self.cfg.id} has {len(self._calls)} calls in flight"))
            return await self._reject(msg.reply, rid, err)
        call = _Call(rid, msg.reply, req.session_id, req.model, time.time(), time.monotonic(), req.deadline_unix, len(prompt))
        call.token_ids = list(prompt) if req.session_id else None
        call.arrival_ns = arrival_ns
        call.lease_id = req.lease_id
        call.stream = req.stream
        call.believed_prefix = req.prefix.committed_tokens if req.HasField("prefix") and req.prefix.model == req.model else 0
        call.tenant, call.end_session = req.tenant, req.end_session
        call.hints = req.hints if req.HasField("hints") else None
        call.trace_parent = otel.extract_first(msg.headers, req.trace_context)
        trace_ctx = call.trace_parent
        if self.telemetry.enabled:
            # opened now (attributes and phases are added when it ends) so that work done for the call on other
            # threads — host KV restore and checkpoint, the kvstore's RPCs — can be its children
            call.span = self.telemetry.tracer.start_span("talaria.engine.call", context=call.trace_parent, kind=SpanKind.SERVER, start_time=arrival_ns)
            trace_ctx = trace.set_span_in_context(call.span, call.trace_parent)
            call.span.set_attributes({**call_hints.span_attributes(call.hints), **({call_hints.SESSION_END: True} if req.end_session else {})})
        self._calls[rid] = call
        self.counters["calls"] += 1
        try:
            self.engine.add_request(EngineRequest(
                rid, prompt, sampling, session_id=req.session_id, arrival_time=call.arrival, model=req.model, trace_context=trace_ctx,
                tenant=req.tenant, cache_salt=req.cache_salt, priority=req.hints.priority if req.hints.has_priority else 0,
                latency_sensitivity_s=req.hints.latency_sensitivity_s, ttft_target_s=req.ttft_target_s, tpot_target_s=req.tpot_target_s,
            ))
        except ExecutorError as e:  # validation happens here, once (executor.validate_request)
            self._calls.pop(rid, None)
            if call.span is not None:
                call.span.set_status(Status(StatusCode.ERROR, str(e)))
                call.span.end()
            param = "messages" if e.param == "prompt" and req.WhichOneof("prompt") == "messages" else e.param
            return await self._reject(msg.reply, rid, CallError(e.status, e.code, str(e), param))
        call.accepted_ns = time.time_ns()
        self._wake.set()
        tool_format = self._runtime(req.model).tokenizer.tool_format if req.tools_json else ""
        if tool_format and req.session_id:
            call.tools = ToolWatch(tool_format)
        reasoning = self.reasoning_format(req.model) if req.WhichOneof("prompt") == "messages" else ""
        call.reasoning = reasoning_parsers.token_counter(reasoning, self._runtime(req.model).tokenizer.token_to_id, opens)
        await self._send(call, pb.TokenChunk(accepted=True, usage=cpb.Usage(prompt_tokens=len(prompt)), tool_format=tool_format,
                                             reasoning_format=reasoning, reasoning_open=opens,
                                             constraint_after_reasoning=sampling.grammar is not None and sampling.reasoning_gate is not None))

    async def _reject(self, reply: str, rid: str, err: CallError) -> None:
        self.counters["errors"] += 1
        if not reply:
            return
        chunk = pb.TokenChunk(schema_version=SCHEMA_VERSION, request_id=rid, seq=0, finished=True, finish_reason="error", error=err.proto(), instance_id=self.cfg.id)
        assert self.nc is not None
        await self.nc.publish(reply, chunk.SerializeToString())

    async def _on_cancel(self, msg: Msg) -> None:
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
        self._hold.release(rid)
        self.engine.abort(rid)
        self.counters["aborted"] += 1
        self.tracer.trace(call, "abort", None, "aborted", message=reason)
        asyncio.ensure_future(self._send(call, pb.TokenChunk(finished=True, finish_reason="abort")))
        asyncio.ensure_future(self._hook(call, "abort", None, None, 0.0))
        log.info("aborted %s: %s", rid, reason)

    async def _on_control(self, msg: Msg) -> None:
        req = pb.ControlRequest()
        reply = pb.ControlReply(schema_version=SCHEMA_VERSION, ok=True)
        try:
            req.ParseFromString(msg.data)
            if req.op == pb.CONTROL_DRAIN:
                self.draining = True
            elif req.op == pb.CONTROL_RESUME:
                self.draining = False
            elif req.op == pb.CONTROL_FLUSH_CACHE:
                await asyncio.to_thread(self.engine.flush_cache)  # waits for the running step: never on the loop
            elif req.op == pb.CONTROL_OPEN_MODEL:
                await asyncio.to_thread(self._model_pool("open another").open_model, req.model)  # loads the bank copy if closed
                self._wake.set()
            elif req.op == pb.CONTROL_CLOSE_MODEL:
                await asyncio.to_thread(self._model_pool("close it").close_model, req.model)
            elif req.op == pb.CONTROL_END_SESSION:
                await self._on_end_session(req)
            else:
                reply.ok = False
                reply.error.CopyFrom(cpb.Error(code="unsupported", message=f"control op {pb.ControlOp.Name(req.op)} is not supported by a hot instance", http_status=422))
        except ExecutorError as e:
            reply.ok = False
            reply.error.CopyFrom(cpb.Error(code=e.code, message=str(e), http_status=e.status, param=e.param))
        except Exception as e:  # noqa: BLE001 - e.g. an undecodable request
            reply.ok = False
            reply.error.CopyFrom(cpb.Error(code="bad_message", message=str(e), http_status=400))
        reply.snapshot.CopyFrom(self.snapshot())
        if msg.reply:
            await msg.respond(reply.SerializeToString())

    def _model_pool(self, what: str) -> ModelPool:
        """The executor's model pool for a control op (raises UnsupportedOperationError on a hot instance)."""
        pool = self.engine.pool()
        if pool is None:
            raise UnsupportedOperationError(f"a hot instance serves one pinned model: it cannot {what}")
        return pool

    # ---------------------------------------------------------------- snapshots
    def snapshot(self) -> pb.InstanceSnapshot:
        """The instance snapshot (thread-safe: the heartbeat thread and the loop both call it)."""
        st = self.engine.stats()
        with self._seq_lock:
            self.seq += 1
            seq = self.seq
        pool = self.engine.pool()
        switches = pool.recent_switch_records(8) if pool is not None else ()
        snap = wire.instance_snapshot(self.cfg, st, switches, epoch=self.epoch, seq=seq, draining=self.draining, rounds=self.rounds_closed)
        self.serving_metrics.observe_snapshot(snap)
        self.serving_metrics.observe_host_kv(self.cfg.id, st.host_kv_counters)
        return snap

    def start_metrics_server(self) -> int | None:
        """Serve this engine's ``/metrics`` on ``cfg.metrics_port`` (a daemon thread; 0 = a free port) unless
        it is None. Sets ``metrics_server``; returns the bound port."""
        if self.cfg.metrics_port is None:
            return None
        from talaria.vllm_metrics import serve_metrics

        self.metrics_server = serve_metrics(self.serving_metrics.exposition, self.cfg.metrics_host, self.cfg.metrics_port)
        port = self.metrics_server[0].server_port
        log.info("engine %s: Prometheus /metrics on %s:%d", self.cfg.id, self.cfg.metrics_host, port)
        return port


    async def _deadlines(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for rid, call in list(self._calls.items()):
                if call.deadline_wall and now > call.deadline_wall:
                    self._abort(rid, "deadline passed")
            await self._keepalives()

    async def _keepalives(self) -> None:
        """A ``keepalive`` chunk (no seq, no tokens) to every accepted call silent for a heartbeat period
        (queued, or waiting for its model's slot), so the router's silence timeout only fires for a silent
        engine. Mutates each such call's ``last_sent``."""
        assert self.nc is not None
        quiet = time.monotonic() - self.cfg.heartbeat_period_s
        for call in list(self._calls.values()):
            if call.seq == 0 or call.last_sent > quiet:
                continue  # not accepted yet (seq 0 is the accepted chunk), or spoke recently
            call.last_sent = time.monotonic()
            ka = pb.TokenChunk(schema_version=SCHEMA_VERSION, request_id=call.request_id, instance_id=self.cfg.id, keepalive=True)
            try:
                await self.nc.publish(call.reply, ka.SerializeToString())
            except Exception as e:  # noqa: BLE001 - a lost client must not stop the loop
                log.debug("keepalive to %s failed: %s", call.reply, e)

    async def _requesters(self) -> None:
        """Abort calls whose requester is gone (its router died, or it dropped the call without a cancel):
        every ``requester_probe_s`` each call at least that old probes its reply inbox with a request;
        NATS answers "no responders" when nobody subscribes to it any more."""
        while True:
            await asyncio.sleep(self.requester_probe_s)
            now = time.monotonic()
            old = [(rid, c.reply) for rid, c in self._calls.items() if now - c.arrival >= self.requester_probe_s]
            if old:
                await asyncio.gather(*(self._probe(rid, reply) for rid, reply in old))

    async def _probe(self, rid: str, reply: str) -> None:
        assert self.nc is not None
        try:
            answer = await self.nc.request(reply, b"", timeout=min(1.0, self.requester_probe_s), headers={PROBE_HEADER: "1"})
        except NoRespondersError:
            self._abort(rid, "requester gone: nobody listens on its reply inbox")
            return
        except Exception:  # noqa: BLE001 - a timeout means someone listens (a requester that does not answer probes)
            return
        if answer.headers and answer.headers.get(PROBE_HEADER) == PROBE_GONE:
            self._abort(rid, "requester gone: its router dropped the call")

    # ---------------------------------------------------------------- lifecycle
    async def run(self, stop: asyncio.Event, url: str) -> None:
        self._loop = asyncio.get_running_loop()
        if self._own_telemetry:
            self.telemetry = otel.setup("talaria-engine", self.cfg.id, self.stack.telemetry, self.stack.namespace)
            self.tracer = CallTracer(self.telemetry, self.cfg.id, self.cfg.pool)
        self.nc = await connect(url, f"engine-{self.cfg.id}", self.stack.nats)
        # a cold engine's initial activation happened before there was a connection: it goes out now, in
        pool = self.engine.pool()
        if pool is not None:
            await self._publish_switches(pool.take_switch_records())  # order, not at the first step
        self._thread = threading.Thread(target=self._run_executor, name=f"executor-{self.cfg.id}", daemon=True)
        self._thread.start()
        subs = [
            await self.nc.subscribe(self.subjects.generate(self.cfg.id), cb=self._on_generate),
            await self.nc.subscribe(self.subjects.cancel(self.cfg.id), cb=self._on_cancel),
            await self.nc.subscribe(self.subjects.control(self.cfg.id), cb=self._on_control),
            await self.nc.subscribe(self.subjects.retention(self.cfg.id), cb=self._on_retention),
        ]
        self.engine.attach_retention(self.retention)
        await self.nc.flush()  # the subscriptions are in place before the first beat says "serving"
        self._beat = HeartbeatThread(
            url, f"engine-{self.cfg.id}-heartbeat", self.stack.nats, self.subjects.heartbeat(self.cfg.id),
            lambda: self.snapshot().SerializeToString(), self.cfg.heartbeat_period_s,
        )
        await asyncio.to_thread(self._beat.start)
        self.start_metrics_server()
        tasks = [asyncio.create_task(t) for t in (self._publisher(), self._deadlines(), self._requesters())]
        print(f"engine {self.cfg.id} serving {', '.join(self.cfg.models) if self.multi else self.model} on {self.cfg.device}", flush=True)
        try:
            await stop.wait()
        finally:
            await self._drain(subs, tasks)

    async def _drain(self, subs: list[Subscription], tasks: list[asyncio.Task[None]]) -> None:
        self.draining = True
        assert self.nc is not None
        if self._beat is not None:
            await asyncio.to_thread(self._beat.stop)  # the last beats below come from this loop, in order
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
        if self._tasks:  # and the finished calls' hooks go out
            await asyncio.wait(set(self._tasks), timeout=self.drain_timeout_s)
        self._stop_thread.set()
        self._wake.set()
        for t in tasks:
            t.cancel()
        await close_connection(self.nc, subs)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.metrics_server is not None:
            self.metrics_server[0].shutdown()
            self.metrics_server[0].server_close()
        if self._own_telemetry:
            await asyncio.to_thread(self.telemetry.shutdown)  # bounded by telemetry.export_timeout_s
