"""The OpenAI-compatible HTTP API of the router (FastAPI).

Thin layer, HTTP only: parse and validate at the edge, encode the wire request (a value the wire cannot carry
is a 400 naming its field), let the call's admission (``LeaseService.admit`` -> ``gateway.Admission``:
Algorithm 1 or a baseline, the start-now fallback, the overload policy, retries; the leases its decisions
judge settled by ``lease_service.py``) say where to forward, forward over NATS (``engine_client``), encode the
token stream as OpenAI JSON or SSE. Every failure is an OpenAI-style error body with a meaningful status (see
``services/router/README.md``); unknown routes and methods included. An exception nothing expected becomes a JSON 500 that keeps the
keep-alive connection (``errors.CatchAll``). A client that goes away cancels its engine work, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router import auth, resume
from services.router.engine_client import SCHEMA_VERSION, EngineCall, EngineUnavailable, TooLargeForBus
from services.router.errors import APIError, CatchAll, anthropic_path, unencodable, wire_field
from services.router.fanout import fan_out, wants_fanout
from services.router.gateway import Admission, OverloadPolicy, Step
from services.router.session_api import SESSION_END_HEADER, session_end_header, session_routes
from services.router.openai_format import ChatOutput, ChunkEvents, Logprobs, chat_output, echo_prefix, reasoning_usage
from services.router.openai_routes import make_router
from services.router.anthropic_routes import anthropic_routes
from services.router.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from services.router.tracing import CallTrace, incoming_context
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


def _put(msg, name: str, value, param: str | None = None) -> None:
    """Set one wire field (``extend`` for a repeated one) under ``wire_field``: mutates ``msg``."""
    with wire_field(param or name):
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)


class Placed:
    """A call the engine accepted: the engine call, its first chunk, the decision and admission step."""

    __slots__ = ("call", "first", "step")

    def __init__(self, call: EngineCall, first: pb.TokenChunk, step: Step):
        self.call, self.first, self.step = call, first, step

    def headers(self) -> dict[str, str]:
        d = self.step.decision
        assert d is not None
        h = {"X-Talaria-Instance": self.call.instance_id, "X-Talaria-Placement": d.reason}
        if d.lease != "none":  # the session's lease and how placement judged it (``policy.Decision.lease``)
            h["X-Talaria-Lease"] = d.lease
        if self.step.deadline_risk_s is not None:
            h["X-Talaria-Deadline-Risk"] = f"predicted-ttft={self.step.deadline_risk_s:.1f}s"
        return h


# a harness whose model does not emit parseable tool calls (a replay of recorded calls, plain
# completions) names the tool the call's output invokes; the router keys the session's lease by it as if the
# engine had parsed it (``LeaseService.declare_tool``; a parsed tool call in the hook wins).
TOOL_HEADER = "X-Talaria-Tool"
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class RouterAPI:
    """The handlers' logic over ``RouterState``; ``create_app`` wires it to routes. Mutates the state's
    counters; the gateway and the leases only through a call's admission (``LeaseService.admit``)."""

    def __init__(self, state):  # state: services.router.service.RouterState
        self.state = state
        self.cfg = state.cfg.router
        pc = self.cfg.placement
        self.overload = OverloadPolicy(pc.overload, pc.queue_max, pc.queue_timeout_s)
        self._closing: set[asyncio.Future] = set()  # calls being closed after their answer (close_soon), disconnect watchers ending

    # ------------------------------------------------------------------------------ parse / encode
    async def read_json(self, request: Request) -> dict:
        body = await request.body()
        if len(body) > self.cfg.max_request_bytes:
            raise APIError(413, f"request body of {len(body)} bytes exceeds the limit of {self.cfg.max_request_bytes}", code="request_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return data

    def base_request(self, request: Request, req, max_tokens: int | None) -> pb.GenerateRequest:
        """The wire request without its prompt; every client value is set under ``wire_field``."""
        limit = self.cfg.max_tokens_limit
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, limit)
        if not 1 <= max_tokens <= limit:
            raise APIError(400, f"max_tokens must be between 1 and {limit}, got {max_tokens}", code="invalid_value", param="max_tokens")
        with wire_field("sampling"):  # schemas.py checked the wire bounds; this is the net under it
            sp = req.sampling_proto(max_tokens)
        g = pb.GenerateRequest(schema_version=SCHEMA_VERSION, request_id=uuid.uuid4().hex, stream=req.stream, sampling=sp)
        _put(g, "model", req.model)
        principal = auth.principal_of(request)  # API key -> tenant; the key may not use every model
        auth.KeyRing.authorize_model(principal, req.model)
        _put(g, "session_id", auth.scope_session(principal.tenant, req.session_key(request.headers.get("x-session-id"))), "session_id")
        g.tenant = principal.tenant
        if req.cache_salt:  # vLLM's cache_salt, within the tenant (the engine salts the hashes)
            _put(g, "cache_salt", req.cache_salt, "cache_salt")
        hints = req.hints().proto()  # validated (400 naming the field), aliases resolved
        if hints is not None:
            g.hints.CopyFrom(hints)
        g.ttft_target_s, g.tpot_target_s = req.ttft_target_s or 0.0, req.tpot_target_s or 0.0  # per-call token deadlines (validated)
        g.end_session = session_end_header(request.headers.get(SESSION_END_HEADER), g.session_id)
        g.deadline_unix = time.time() + self.cfg.request_timeout_s
        g.trace_context.update(incoming_context(request.headers))
        tool = request.headers.get(TOOL_HEADER)
        if tool is not None and not TOOL_NAME.fullmatch(tool):  # the tool this call's output invokes, for outputs the engine cannot parse
            raise APIError(400, f"{TOOL_HEADER} must be 1-64 characters of letters, digits, '_', '-', '.'", code="invalid_value", param=TOOL_HEADER)
        return g

    # ------------------------------------------------------------------------------------ placing
    async def start_call(self, request: Request, g: pb.GenerateRequest, prompt_tokens: int, exact: bool, trace: CallTrace | None = None,
                         text_bytes: int = 0, param: str = "prompt") -> Placed:
        """Admit, place and forward; a forward the engine does not accept is retried elsewhere. The request's
        resume token and declared tool go to the call's admission (``LeaseService.admit``), which settles every
        lease its decisions judge. ``trace`` records the call's router queue time and when it was forwarded
        (attribution). ``text_bytes``: UTF-8 bytes of prompt text the engine tokenizes verbatim (the early
        context check's lower bound); ``param``: the field an over-context 413 names."""
        adm = self.state.leases.admit(g, prompt_tokens, self.overload, request.headers.get(resume.HEADER), request.headers.get(TOOL_HEADER),
                                      prompt_exact=exact, prompt_bytes=text_bytes, prompt_param=param)
        try:
            while True:
                step = await adm.step()
                if step.kind == "wait":
                    t_wait = time.monotonic()
                    await asyncio.sleep(step.wait_s)
                    if trace is not None:
                        trace.queued(time.monotonic() - t_wait)
                    continue
                if step.kind == "reject":
                    headers = {"Retry-After": str(max(1, math.ceil(step.retry_after_s)))} if step.retry_after_s > 0 else None
                    raise APIError(step.status, step.message, code=step.code or None, param=step.param, headers=headers)
                if trace is not None:
                    trace.forwarding()
                placed = await self.forward(g, step, adm)
                if placed is not None:
                    return placed
        finally:
            adm.close()

    async def forward(self, g: pb.GenerateRequest, step: Step, adm: Admission) -> Placed | None:
        """Send the call to the decision's instance; None (and ``adm.failed``/``adm.fenced``) when it did not
        accept. The step's consumed lease (id, engine epoch) goes with it: the engine checks the epoch (fencing)."""
        state, d = self.state, step.decision
        assert d is not None and d.instance_id is not None
        inst = d.instance_id
        entry = state.sessions.get(g.session_id) if g.session_id else None
        g.ClearField("prefix")
        if entry is not None and entry.model == g.model:
            g.prefix.CopyFrom(cpb.PrefixHandle(model=entry.model, committed_tokens=entry.committed_tokens))
        g.lease_id = step.lease_id
        g.resume_epoch = step.lease_epoch if d.lease == "hit" else 0  # fencing: the engine refuses a lease from another epoch
        adm.commit(d, g.request_id)
        if step.deadline_risk_s is not None:
            log.info("call %s placed on %s past admission: predicted TTFT %.1fs (deadline risk)", g.request_id, inst, step.deadline_risk_s)
        call = EngineCall(state.inbox_mux(), state.subjects, inst, g)
        view = state.registry.instances[inst]
        try:
            await call.start()
            first = await call.wait_accepted(self.cfg.accept_timeout_s, lambda: state.registry.alive(view))
        except TooLargeForBus as e:  # about the message, not the engine: no health change, no retry
            await call.close()
            state.gateway.call_ended(g.request_id, inst)  # never sent: out of the in-flight overlay
            state.counters["too_large_for_bus"] += 1
            raise APIError(413, str(e), code="request_too_large") from None
        except EngineUnavailable as e:
            await call.close()
            if e.bus:  # the router's own NATS connection: every instance is as unreachable
                state.gateway.call_ended(g.request_id, inst)
                state.counters["bus_unavailable"] += 1
                raise APIError(503, f"the message bus is unavailable: {e}", code="engine_unavailable", headers={"Retry-After": "1"}) from None
            if call.no_responders:
                state.registry.mark_gone(inst, "NATS: no responders to a call (process gone)")
            else:
                state.registry.mark_suspect(inst, self.cfg.accept_timeout_s)
            state.counters["engine_unavailable"] += 1
            log.warning("instance %s did not accept %s: %s", inst, g.request_id, e)
            adm.failed(inst, str(e))
            return None
        except BaseException:
            await call.close()
            raise
        if first.HasField("error"):
            await call.close()
            err = first.error
            if err.code == "resume_fenced":  # the engine restarted since the lease: place again without it
                state.counters["resume_fenced"] += 1
                adm.fenced(inst)
                return None
            headers = {"Retry-After": "1"} if err.http_status in (429, 503) else None
            raise APIError(err.http_status or 500, err.message, code=err.code or None, param=err.param or None, headers=headers)
        return Placed(call, first, step)

    # ------------------------------------------------------------------------------------ serving
    async def serve(self, request: Request, g: pb.GenerateRequest, req, chat: bool, prompt_tokens: int, exact: bool = False,
                    text_bytes: int = 0) -> Response:
        ct = CallTrace(self.state.tracer(), g, chat, self.cfg.id, self.state.publish_call)  # one trace per call; ended by call.close()
        try:
            placed = await self.start_call(request, g, prompt_tokens, exact, ct, text_bytes, "messages" if chat else "prompt")
        except BaseException as e:
            ct.end(e)
            raise
        call = placed.call
        ct.placed(placed.step.decision, call)
        call.trace = ct
        view = self.state.registry.instances[call.instance_id]
        alive = lambda: self.state.registry.alive(view)  # noqa: E731 - in-flight calls survive draining
        rid = ("chatcmpl-" if chat else "cmpl-") + g.request_id
        out = chat_output(req, placed.first) if chat else None  # reasoning vs content vs tool_calls
        lps = Logprobs(chat, g.sampling.logprobs)
        if g.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            sse = self.sse(call, rid, int(time.time()), g.model, chat, include_usage, alive, out, lps)
            return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **placed.headers()})
        return await self.complete(request, placed, req, rid, chat, alive, out, lps)

    async def complete(self, request: Request, placed: Placed, req, rid: str, chat: bool, alive: Callable[[], bool],
                       out: ChatOutput | None, lps: Logprobs) -> Response:
        """A non-streaming answer. A client that disconnects first cancels the engine work."""
        call, created = placed.call, int(time.time())
        collect = asyncio.ensure_future(self.collect(call, alive, lps, out))
        gone = asyncio.ensure_future(_disconnected(request))
        answered = False
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                self.state.counters["client_disconnect"] += 1
                self.state.counters["client_disconnect_nonstream"] += 1
                # Cancel on the engine before stopping the reader: ``call.finished`` also ends its loop, so
                # a cancellation lost in a race with an arriving chunk cannot keep it reading to the end.
                await call.cancel("client disconnected")
                raise APIError(499, "client disconnected", code="client_disconnected")
            content, reason, usage, stop_reason = collect.result()
            answered = True
        finally:
            gone.cancel()  # not awaited: held until it ends, so the answer does not wait a loop turn for it
            gone.add_done_callback(_retrieved)
            self._hold(gone)
            if not collect.done():
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)
            if not call.finished:  # client went away or the engine was lost: free the engine's work
                await call.cancel("client disconnected" if gone.done() else "call abandoned")
            if not answered:
                await call.close()
        try:
            return self.answer(placed, req, rid, chat, created, content, reason, usage, out, lps, stop_reason)
        except BaseException:
            await call.close()
            raise

    def answer(self, placed: Placed, req, rid: str, chat: bool, created: int, content: str, reason, usage,
               out: ChatOutput | None, lps: Logprobs, stop_reason: str = "") -> Response:
        """The JSON body of a finished non-streaming call; the call is closed (its trace ended, its inbox
        unsubscribed) by a task that runs once this one yields, after the response is written (per-call work off the answer's path). Mutates ``out`` and ``lps``."""
        call, model = placed.call, req.model
        content = echo_prefix(req) + content
        if out is not None:  # collect() fed it the chunks
            reason = out.finish(reason)[1]
        choice = (
            {"index": 0, "message": out.message(), "finish_reason": reason, "logprobs": lps.take()}
            if out is not None
            else {"index": 0, "text": content, "finish_reason": reason, "logprobs": lps.take()}
        )
        choice["stop_reason"] = _stop_reason(reason, stop_reason)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model, "choices": [choice], "usage": reasoning_usage(_usage(usage), out, usage.reasoning_tokens if usage is not None else 0)}
        headers = placed.headers()
        token = self.finished(call, usage)
        if token:
            headers[resume.HEADER] = token
        self.close_soon(call)
        return JSONResponse(body, headers=headers)

    def finished(self, call: EngineCall, usage) -> str | None:
        """A call's finished chunk arrived: record where the session's KV now is (the engine's completion hook
        confirms it later; a return that arrives first must still find it), then the signed resume token, or None
        (``LeaseService.finished``). Mutates the session table."""
        return self.state.leases.finished(call.req, call.instance_id, usage)

    async def collect(self, call: EngineCall, alive: Callable[[], bool], lps: Logprobs, out: ChatOutput | None = None) -> tuple[str, str | None, object, str]:
        """Read a call to its end: (text, finish reason, usage, the stop string that ended it or ""); mutates
        ``lps`` (adds the chunks' logprobs) and ``out`` (feeds it each chunk, so it counts reasoning tokens).
        Raises APIError on an engine error or loss."""
        text, reason, usage, stop = [], None, None, ""
        try:
            async for c in call.chunks(self.cfg.idle_chunk_timeout_s, alive):
                if c.HasField("error"):
                    raise APIError(c.error.http_status or 500, c.error.message, code=c.error.code or None)
                text.append(c.text)
                if out is not None:
                    out.feed(c.text, len(c.token_ids))
                lps.add(c.logprobs)
                if c.finished:
                    reason, usage, stop = c.finish_reason, c.usage, c.stop_reason
        except EngineUnavailable as e:
            self.state.counters["engine_lost_midcall"] += 1
            raise APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "1"}) from None
        return "".join(text), reason, usage, stop

    async def sse(self, call: EngineCall, rid: str, created: int, model: str, chat: bool, include_usage: bool, alive,
                  out: ChatOutput | None = None, lps: Logprobs | None = None) -> AsyncIterator[bytes]:
        """The SSE stream of a call. The events of one (merged) engine chunk go out as one write, and the
        finished chunk's events with ``[DONE]``: the bytes are those of one event per write, in fewer socket
        sends. A plain text / content token without logprobs is encoded from the call's template
        (``ChunkEvents``: only its text is JSON-encoded)."""
        ev = ChunkEvents(rid, created, model, chat)
        plain = lps is None or not lps.enabled  # no logprobs: a token's event is the template's

        def choice(text: str | None, reason: str | None, first: bool = False, delta: dict | None = None, stop: str | None = None) -> dict:
            lp = lps.take() if lps is not None and (text or delta or reason) else None
            if chat:
                delta = dict(delta or {})
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lp}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": lp}
            if stop is not None:
                c["stop_reason"] = stop
            return c

        try:
            if chat:
                yield ev.event([choice("", None, first=True)])
            tail: list[bytes] = []  # the last chunk's events, sent with [DONE]
            async for c in call.chunks(self.cfg.idle_chunk_timeout_s, alive):
                if c.HasField("error"):
                    err = APIError(c.error.http_status or 500, c.error.message, code=c.error.code or None)
                    tail.append(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
                    break
                parts: list[bytes] = []
                if lps is not None:
                    lps.add(c.logprobs)
                if c.text and out is not None:  # tool-call text becomes delta.tool_calls
                    for d in out.feed(c.text, len(c.token_ids)):
                        content = d.get("content") if plain and len(d) == 1 else None
                        parts.append(ev.content(content) if content is not None else ev.event([choice(None, None, delta=d)]))
                elif c.text:
                    parts.append(ev.text(c.text) if plain else ev.event([choice(c.text, None)]))
                if c.finished:
                    reason = c.finish_reason
                    if out is not None:
                        deltas, reason = out.finish(reason)
                        for d in deltas:
                            parts.append(ev.event([choice(None, None, delta=d)]))
                    parts.append(ev.event([choice(None if chat else "", reason, stop=_stop_reason(reason, c.stop_reason))], token=self.finished(call, c.usage)))
                    if include_usage:
                        parts.append(ev.event([], reasoning_usage(_usage(c.usage), out, c.usage.reasoning_tokens)))
                    tail = parts
                elif parts:
                    yield b"".join(parts)
            tail.append(b"data: [DONE]\n\n")
            yield b"".join(tail)
        except EngineUnavailable as e:
            self.state.counters["engine_lost_midcall"] += 1
            yield b"data: " + json.dumps(APIError(503, str(e), code="engine_unavailable").body()).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            # Runs on normal end and when the client disconnects (the generator is closed/cancelled).
            if not call.finished:
                self.state.counters["client_disconnect"] += 1
                await call.cancel("client disconnected")
            self.close_soon(call)  # after the stream's last write

    def close_soon(self, call: EngineCall) -> None:
        """Close ``call`` (end its trace, unsubscribe its inbox) in a task of its own, held in ``_closing``
        until it ends, so a response's last write does not wait for it. Mutates ``_closing``."""
        self._hold(asyncio.ensure_future(call.close()))

    def _hold(self, t: asyncio.Future) -> None:
        """Keep a reference to a task nobody awaits until it ends (the loop holds tasks weakly). Mutates ``_closing``."""
        if not t.done():
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)

    # ----------------------------------------------------------------------------------- handlers
    async def chat(self, request: Request) -> Response:
        data = await self.read_json(request)
        if wants_fanout(data):  # n > 1: n calls of this handler (services/router/fanout.py)
            return await fan_out(request, data, self.chat)
        req = parse_request(ChatCompletionRequest, data)
        g = self.base_request(request, req, req.effective_max_tokens())
        with wire_field("messages"):
            msgs = req.messages_proto()
        g.messages.CopyFrom(msgs)
        _put(g, "tools_json", req.tools_json(), "tools")
        opts = req.template_proto()  # vLLM's chat-template options
        if opts is not None:
            with wire_field("chat_template_kwargs"):
                g.chat_template.CopyFrom(opts)
        est = sum(len(m.content) for m in msgs.messages) // 4 + 8 * len(msgs.messages)
        # the early context check's lower bound counts the turns every chat template renders verbatim (an
        # assistant turn's reasoning may be dropped by the template, e.g. Qwen3's)
        verbatim = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in msgs.messages if m.role in ("system", "user"))
        return await self.serve(request, g, req, chat=True, prompt_tokens=est, text_bytes=verbatim)

    async def completions(self, request: Request) -> Response:
        data = await self.read_json(request)
        if wants_fanout(data):
            return await fan_out(request, data, self.completions)
        req = parse_request(CompletionRequest, data)
        g = self.base_request(request, req, req.effective_max_tokens())
        if isinstance(req.prompt, str):
            _put(g, "text", req.prompt, "prompt")
            return await self.serve(request, g, req, chat=False, prompt_tokens=len(req.prompt) // 4 + 1,
                                    text_bytes=len(req.prompt.encode("utf-8", "surrogatepass")))
        ids = pb.TokenIds()
        _put(ids, "ids", list(req.prompt), "prompt")
        g.token_ids.CopyFrom(ids)
        return await self.serve(request, g, req, chat=False, prompt_tokens=len(req.prompt), exact=True)

    def health(self) -> JSONResponse:
        """Liveness plus a summary; 503 until NATS is connected."""
        state = self.state
        ok = state.nc is not None and state.nc.is_connected
        reg = state.registry
        body = {
            "status": "ok" if ok else "degraded",
            "router": self.cfg.id,
            "instances": {i: _instance_health(reg, v) for i, v in reg.instances.items()},
            "sessions": len(state.sessions),
            "counters": dict(state.counters),
            "placement": {k: v for k, v in state.leases.metrics().items() if k != "counters"},
        }
        return JSONResponse(body, status_code=200 if ok else 503)


def _retrieved(t: asyncio.Future) -> None:
    """Done callback of a task nobody awaits: its exception is taken (as ``gather(return_exceptions=True)``
    took it), so asyncio does not log it as never retrieved."""
    if not t.cancelled():
        t.exception()


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body was already read)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _instance_health(reg, v) -> dict:
    return {
        "healthy": reg.healthy(v),
        "alive": reg.alive(v),
        "state": reg.state(v),
        "running": v.snapshot.num_running,
        "waiting": v.snapshot.num_waiting,
        "inflight_overlay": v.inflight,
        "draining": v.snapshot.draining,
        "kv_usage": round(v.snapshot.kv_usage, 4),
        "models": [m.model for m in v.snapshot.models],
        "kernels": {k.name: k.state for k in v.snapshot.kernels},  # which kernels the engine runs
    }


def create_app(state) -> FastAPI:  # state: services.router.service.RouterState
    app = FastAPI(title="Talaria router", docs_url=None, redoc_url=None, openapi_url=None)
    api = RouterAPI(state)
    cfg = api.cfg
    auth.install(app, state)  # API keys, tenants, rate limits
    _install_error_handlers(app, state)

    @app.get("/health")
    async def health() -> JSONResponse:
        return api.health()

    @app.get("/router/metrics")
    async def router_metrics() -> JSONResponse:
        """Placement accounting as JSON (avoidable cold opens, same-instance returns, lease hits/misses/expiries)."""
        return JSONResponse({"router": cfg.id, "sessions": len(state.sessions), "placement": state.leases.metrics()})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text: vLLM-named serving metrics of every engine this router hears
        (``talaria/vllm_metrics.py``), labelled ``model_name`` and ``engine``."""
        return Response(state.serving_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/decisions")
    async def router_decisions() -> JSONResponse:
        """The most recent placement decisions with their cost breakdowns (newest last)."""
        return JSONResponse({"router": cfg.id, "decisions": list(state.gateway.decisions)})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Ready when NATS is connected and at least one instance is healthy."""
        models = state.registry.models()
        ok = state.nc is not None and state.nc.is_connected and bool(models)
        return JSONResponse({"ready": ok, "models": sorted(models)}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        allowed = auth.principal_of(request).models  # a key with an allow-list sees only its models
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "talaria", "max_model_len": ctx}
            for m, ctx in sorted(state.registry.models().items())
            if allowed is None or m in allowed
        ]
        return JSONResponse({"object": "list", "data": data})

    # the two hot endpoints as plain Starlette routes: they take the Request and return a Response, so FastAPI's
    # per-call route machinery (dependency solving, its route context) would do nothing for them
    app.add_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_route("/v1/completions", api.completions, methods=["POST"])
    app.include_router(make_router(state, app))  # /v1/responses, /v1/models/{id}, /tokenize, /detokenize
    app.include_router(session_routes(state))  # DELETE /v1/sessions/{id}
    app.include_router(anthropic_routes(state, app))  # /v1/messages, /v1/messages/count_tokens
    return app


def _install_error_handlers(app: FastAPI, state) -> None:
    """OpenAI error bodies for every failure: APIError, unknown route / wrong method (404/405), a value the
    wire cannot carry that no field guard caught (400), anything else (500, connection kept)."""

    @app.exception_handler(APIError)
    async def _api_error(req: Request, e: APIError) -> Response:
        state.counters[f"error_{e.status}"] += 1
        return e.response(anthropic_path(req.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, e: StarletteHTTPException) -> Response:
        state.counters[f"error_{e.status_code}"] += 1
        if e.status_code == 404:
            err = APIError(404, f"unknown route {req.method} {req.url.path}", code="unknown_route")
        elif e.status_code == 405:
            err = APIError(405, f"method {req.method} is not allowed on {req.url.path}", code="method_not_allowed", headers=dict(e.headers or {}))
        else:
            err = APIError(e.status_code, str(e.detail), code=None, headers=dict(e.headers or {}))
        return err.response(anthropic_path(req.url.path))

    @app.exception_handler(ValueError)
    async def _unencodable(req: Request, e: ValueError) -> Response:
        # the net under the per-field guards: a client value the wire could not carry is never a 500
        log.warning("request value not encodable (no field guard caught it): %s", unencodable(e))
        state.counters["error_400"] += 1
        return APIError(400, f"a request value cannot be encoded: {unencodable(e)}", code="invalid_value").response(anthropic_path(req.url.path))

    def _unexpected(e: Exception) -> None:
        log.error("unexpected router error", exc_info=e)
        state.counters["error_500"] += 1

    app.add_middleware(CatchAll, on_error=_unexpected)


def _stop_reason(finish_reason: str | None, stop: str) -> str | None:
    """vLLM's ``stop_reason`` of a choice: the stop string that ended the call, else None."""
    return stop if finish_reason == "stop" and stop else None


def _usage(u) -> dict:
    if u is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0, "restored_tokens": 0}}
    # cached_tokens (OpenAI): prompt tokens not recomputed. restored_tokens (Talaria extension): of those, the
    # ones restored from the host KV store for this call; cached - restored were already on the device.
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "restored_tokens": u.restored_tokens},
    }


__all__ = ["create_app", "Counter", "RouterAPI"]
