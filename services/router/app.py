"""The OpenAI-compatible HTTP API of the router (FastAPI).

Thin layer: parse and validate at the edge, choose an instance (``Gateway.decide``: Algorithm 1 or a
baseline; a lease it honours is consumed in the shared store first), forward over NATS (``engine_client``),
encode the token stream as OpenAI JSON or SSE. When no candidate passes the admission checks the configured
overload policy answers: 429 with ``Retry-After``, or a bounded wait in the gateway queue then 429. Every failure is an OpenAI-style error
body with a meaningful status (see ``services/router/README.md``); nothing here raises a bare 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.router.engine_client import SCHEMA_VERSION, EngineCall, EngineUnavailable
from services.router.errors import APIError
from services.router.fanout import fan_out, wants_fanout
from services.router.openai_format import ChatOutput, Logprobs, chat_output, echo_prefix
from services.router.openai_routes import make_router
from services.router.policy import Decision
from services.router.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from services.router.tracing import CallTrace, incoming_context
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


def create_app(state) -> FastAPI:  # state: services.router.service.RouterState
    app = FastAPI(title="Talaria router", docs_url=None, redoc_url=None, openapi_url=None)
    cfg = state.cfg.router

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, e: APIError) -> JSONResponse:
        state.counters[f"error_{e.status}"] += 1
        return e.response()

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected router error")
        state.counters["error_500"] += 1
        return APIError(500, "internal router error; see router logs", code="internal_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness plus a summary; 503 until NATS is connected."""
        ok = state.nc is not None and state.nc.is_connected
        body = {
            "status": "ok" if ok else "degraded",
            "router": cfg.id,
            "instances": {
                i: {
                    "healthy": state.registry.healthy(v),
                    "alive": state.registry.alive(v),
                    "running": v.snapshot.num_running,
                    "waiting": v.snapshot.num_waiting,
                    "inflight_overlay": v.inflight,
                    "draining": v.snapshot.draining,
                    "kv_usage": round(v.snapshot.kv_usage, 4),
                    "models": [m.model for m in v.snapshot.models],
                }
                for i, v in state.registry.instances.items()
            },
            "sessions": len(state.sessions),
            "counters": dict(state.counters),
            "placement": {k: v for k, v in state.gateway.metrics().items() if k != "counters"},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/router/metrics")
    async def router_metrics() -> JSONResponse:
        """Placement accounting as JSON (avoidable cold opens, same-instance returns, lease hits/misses/expiries)."""
        return JSONResponse({"router": cfg.id, "sessions": len(state.sessions), "placement": state.gateway.metrics()})

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
    async def models() -> JSONResponse:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "talaria", "max_model_len": ctx}
            for m, ctx in sorted(state.registry.models().items())
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _read_json(request: Request) -> dict:
        body = await request.body()
        if len(body) > cfg.max_request_bytes:
            raise APIError(413, f"request body of {len(body)} bytes exceeds the limit of {cfg.max_request_bytes}", code="request_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return data

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        data = await _read_json(request)
        if wants_fanout(data):  # n > 1: n calls of this handler (services/router/fanout.py)
            return await fan_out(request, data, chat)
        req = parse_request(ChatCompletionRequest, data)
        messages = req.messages_proto()
        g = _base_request(request, req, req.effective_max_tokens())
        g.messages.CopyFrom(messages)
        g.tools_json = req.tools_json()
        est = sum(len(m.content) for m in messages.messages) // 4 + 8 * len(messages.messages)
        return await _serve(g, req, chat=True, prompt_tokens=est)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        data = await _read_json(request)
        if wants_fanout(data):
            return await fan_out(request, data, completions)
        req = parse_request(CompletionRequest, data)
        g = _base_request(request, req, req.effective_max_tokens())
        if isinstance(req.prompt, str):
            g.text = req.prompt
            est = len(req.prompt) // 4 + 1
        else:
            g.token_ids.CopyFrom(pb.TokenIds(ids=list(req.prompt)))
            est = len(req.prompt)
        return await _serve(g, req, chat=False, prompt_tokens=est)

    def _base_request(request: Request, req, max_tokens: int | None) -> pb.GenerateRequest:
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, cfg.max_tokens_limit)
        if not 1 <= max_tokens <= cfg.max_tokens_limit:
            raise APIError(400, f"max_tokens must be between 1 and {cfg.max_tokens_limit}, got {max_tokens}", code="invalid_value", param="max_tokens")
        session = req.session_key(request.headers.get("x-session-id"))
        sp = req.sampling_proto(max_tokens)
        return pb.GenerateRequest(
            schema_version=SCHEMA_VERSION,
            request_id=uuid.uuid4().hex,
            session_id=session,
            model=req.model,
            sampling=sp,
            stream=req.stream,
            deadline_unix=time.time() + state.cfg.router.request_timeout_s,
            trace_context=incoming_context(request.headers),
        )

    pc = cfg.placement

    async def _decide(req, tried: set[str]) -> tuple[Decision, str]:
        """Algorithm 1 with the lease step made atomic across router replicas: a lease the policy honours
        is consumed in the shared store first; if another replica got it, placement runs without it.
        Returns the decision and the id of the lease it consumed ("" if none)."""
        gw = state.gateway
        d, rev = gw.decide(req, tried)
        lease_id = ""
        if d.lease == "hit":
            assert rev is not None
            got = gw.leases.get(req.session_id, req.model)
            lease_id = got[0].lease_id if got is not None else ""
            if not await state.lease_store.consume(req.session_id, req.model, rev):
                gw.lease_raced()
                d, _ = gw.decide(req, tried, use_lease=False)
                return d, ""
        elif d.lease != "none" and rev is not None:
            await state.lease_store.discard(req.session_id, req.model, rev)
        gw.lease_judged(d)
        return d, lease_id

    def _overloaded(d: Decision, message: str) -> APIError:
        retry = str(max(1, math.ceil(d.retry_after_s)))
        return APIError(429, message, code="overloaded", headers={"Retry-After": retry})

    async def _start_call(g: pb.GenerateRequest, prompt_tokens: int) -> tuple[EngineCall, pb.TokenChunk, Decision]:
        """Place and forward; retries another instance when one does not accept (nothing was started)."""
        gw = state.gateway
        req = gw.request(g.session_id, g.model, prompt_tokens, g.sampling.max_tokens)
        gw.arrival(req)
        tried: set[str] = set()
        last_error: EngineUnavailable | None = None
        loop = asyncio.get_running_loop()
        queue_deadline: float | None = None
        attempts = 0
        try:
            while attempts < 3:
                decision, lease_id = await _decide(req, tried)
                if decision.instance_id is None:
                    if decision.reason != "overload":
                        break
                    # Overload policy (no admissible candidate): 429 now, or a bounded wait in the queue.
                    if pc.overload == "reject":
                        gw.stats["overload_rejected"] += 1
                        gw.log(req, decision)
                        raise _overloaded(decision, f"all instances serving '{g.model}' are over their admission budget")
                    if queue_deadline is None:
                        if gw.queued >= pc.queue_max:
                            gw.stats["overload_rejected"] += 1
                            raise _overloaded(decision, f"gateway queue for '{g.model}' is full ({pc.queue_max} waiting)")
                        gw.queued += 1
                        gw.stats["overload_queued"] += 1
                        queue_deadline = loop.time() + pc.queue_timeout_s
                    if loop.time() >= queue_deadline:
                        gw.stats["overload_queue_timeouts"] += 1
                        raise _overloaded(decision, f"no instance for '{g.model}' admitted the call within {pc.queue_timeout_s:.0f}s")
                    await asyncio.sleep(0.05)
                    continue
                if queue_deadline is not None:
                    gw.queued -= 1
                    queue_deadline = None
                attempts += 1
                inst = decision.instance_id
                tried.add(inst)
                entry = state.sessions.get(g.session_id) if g.session_id else None
                if entry is not None and entry.model == g.model:
                    g.prefix.CopyFrom(cpb.PrefixHandle(model=entry.model, committed_tokens=entry.committed_tokens))
                g.lease_id = lease_id
                gw.commit(req, decision)
                call = EngineCall(state.nc, state.subjects, cfg.id, inst, g)
                view = state.registry.instances[inst]
                try:
                    await call.start()
                    first = await call.wait_accepted(cfg.accept_timeout_s, lambda: state.registry.alive(view))
                except EngineUnavailable as e:
                    await call.close()
                    state.registry.mark_suspect(inst, cfg.accept_timeout_s)
                    state.counters["engine_unavailable"] += 1
                    log.warning("instance %s did not accept %s: %s", inst, g.request_id, e)
                    last_error = e
                    continue
                except BaseException:
                    await call.close()
                    raise
                if first.HasField("error"):
                    await call.close()
                    err = first.error
                    headers = {"Retry-After": "1"} if err.http_status in (429, 503) else None
                    raise APIError(err.http_status or 500, err.message, code=err.code or None, param=err.param or None, headers=headers)
                return call, first, decision
        finally:
            if queue_deadline is not None:
                gw.queued -= 1
        if last_error is not None:
            raise APIError(503, f"no engine answered for model '{g.model}': {last_error}", code="engine_unavailable", headers={"Retry-After": "1"})
        if gw.known_model(g.model):
            raise APIError(503, f"no healthy instance serves model '{g.model}'", code="no_healthy_instance", headers={"Retry-After": "1"})
        raise APIError(404, f"model '{g.model}' does not exist", code="model_not_found", param="model")

    async def _serve(g: pb.GenerateRequest, req, chat: bool, prompt_tokens: int) -> Response:
        ct = CallTrace(state.tracer(), g, chat, cfg.id, state.publish_call)  # one trace per call (issue 7); ended by call.close()
        try:
            call, first, decision = await _start_call(g, prompt_tokens)
        except BaseException as e:
            ct.end(e)
            raise
        ct.placed(decision, call)
        call.trace = ct
        placed = {"X-Talaria-Instance": call.instance_id, "X-Talaria-Placement": decision.reason}
        view = state.registry.instances[call.instance_id]
        view_alive = lambda: state.registry.alive(view)  # noqa: E731 - in-flight calls survive draining
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + g.request_id
        out = chat_output(req, first.tool_format) if chat else None
        if g.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(call, rid, created, g.model, chat, include_usage, view_alive, out, Logprobs(chat, g.sampling.logprobs)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **placed},
            )
        lps = Logprobs(chat, g.sampling.logprobs)
        try:
            text, reason, usage = [], None, None
            async for c in call.chunks(cfg.idle_chunk_timeout_s, view_alive):
                if c.HasField("error"):
                    raise APIError(c.error.http_status or 500, c.error.message, code=c.error.code or None)
                text.append(c.text)
                lps.add(c.logprobs)
                if c.finished:
                    reason, usage = c.finish_reason, c.usage
        except EngineUnavailable as e:
            state.counters["engine_lost_midcall"] += 1
            raise APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "1"}) from None
        finally:
            if not call.finished:  # client went away or the engine was lost: free the engine's work
                await call.cancel("call abandoned")
            await call.close()
        content = echo_prefix(req) + "".join(text)
        if out is not None:
            out.feed(content)
            reason = out.finish(reason)[1]
        choice = (
            {"index": 0, "message": out.message(), "finish_reason": reason, "logprobs": lps.take()}
            if out is not None
            else {"index": 0, "text": content, "finish_reason": reason, "logprobs": lps.take()}
        )
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": g.model,
            "choices": [choice],
            "usage": _usage(usage),
        }
        return JSONResponse(body, headers=placed)

    async def _sse(call: EngineCall, rid: str, created: int, model: str, chat: bool, include_usage: bool, alive, out: ChatOutput | None = None, lps: Logprobs | None = None) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage=None) -> bytes:
            d = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

        def choice(text: str | None, reason: str | None, first: bool = False, delta: dict | None = None) -> dict:
            lp = lps.take() if lps is not None and (text or delta or reason) else None
            if chat:
                delta = dict(delta or {})
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lp}
            return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": lp}

        try:
            if chat:
                yield event([choice("", None, first=True)])
            async for c in call.chunks(cfg.idle_chunk_timeout_s, alive):
                if c.HasField("error"):
                    err = APIError(c.error.http_status or 500, c.error.message, code=c.error.code or None)
                    yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                    break
                if lps is not None:
                    lps.add(c.logprobs)
                if c.text and out is not None:
                    for d in out.feed(c.text):
                        yield event([choice(None, None, delta=d)])
                elif c.text:
                    yield event([choice(c.text, None)])
                if c.finished:
                    reason = c.finish_reason
                    if out is not None:
                        deltas, reason = out.finish(reason)
                        for d in deltas:
                            yield event([choice(None, None, delta=d)])
                    yield event([choice(None if chat else "", reason)])
                    if include_usage:
                        yield event([], _usage(c.usage))
            yield b"data: [DONE]\n\n"
        except EngineUnavailable as e:
            state.counters["engine_lost_midcall"] += 1
            err = APIError(503, str(e), code="engine_unavailable")
            yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            # Runs on normal end and when the client disconnects (the generator is closed/cancelled).
            if not call.finished:
                state.counters["client_disconnect"] += 1
                await call.cancel("client disconnected")
            await call.close()

    app.include_router(make_router(state, app))  # /v1/responses, /v1/models/{id}, /tokenize, /detokenize
    return app


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


__all__ = ["create_app", "Counter"]
