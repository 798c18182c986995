"""Extra OpenAI-surface endpoints, registered on the router app with one ``include_router`` line:
``/v1/responses``, ``/v1/models/{id}``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes).

``/v1/responses`` runs the app's own ``/v1/chat/completions`` handler in-process (same validation,
placement, tool parsing, structured output) on the translated body (``responses_api.py``); a streaming
chat response is consumed chunk by chunk and re-emitted as Responses events, and closing our stream closes
the chat stream (which cancels the engine's work). ``store: true`` writes the response to the
tenant-scoped store (``responses_store.py``), ``previous_response_id`` continues a stored one as the same
session, ``GET`` / ``DELETE /v1/responses/{id}`` read and remove them (another tenant's id: 404).

``/tokenize`` and ``/detokenize`` use the model's tokenizer and chat template from the checkpoint directory
under ``models_dir`` on the router's host (the same code the engine renders prompts with); a model with no
checkpoint there is a 404 naming it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request as StarletteRequest

from services.router import auth, responses_api
from services.router.errors import APIError
from services.router.responses_store import RESPONSE_ID
from services.router.schemas import UINT32_MAX, _bad_string


def _endpoint(app: FastAPI, path: str):
    for r in app.routes:
        if getattr(r, "path", None) == path and "POST" in getattr(r, "methods", ()):
            return r.endpoint
    raise RuntimeError(f"no POST {path} route")


def inner_request(request: Request, path: str, body: bytes) -> StarletteRequest:
    """A request for another route of this app with ``body``; disconnects of the outer client pass through."""
    scope = dict(request.scope)
    scope["path"] = path
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return StarletteRequest(scope, receive)


async def _sse_json(resp: StreamingResponse) -> AsyncIterator[dict]:
    """The JSON payloads of a chat SSE stream (``[DONE]`` ends it)."""
    buf = b""
    async for piece in resp.body_iterator:
        buf += piece if isinstance(piece, bytes) else piece.encode()
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                    yield json.loads(line[6:])


def _tokenizer(state, model: str):
    from talaria.tokenizer import Tokenizer

    cache = state.__dict__.setdefault("_tokenizers", {})
    if model not in cache:
        path = Path(state.cfg.model_path(model)) if model and "/" not in model and ".." not in model else None
        if path is None or not (path / "tokenizer.json").exists():
            raise APIError(404, f"model '{model}' has no checkpoint on this router's host", code="model_not_found", param="model")
        cache[model] = Tokenizer.from_dir(path)
    return cache[model]


async def _body(request: Request) -> dict:
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    bad = _bad_string(data, "")
    if bad is not None:
        raise APIError(400, f"'{bad}' contains a lone UTF-16 surrogate", code="invalid_value", param=bad)
    return data


def make_router(state, app: FastAPI) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        models = state.registry.models()
        if model_id not in models:
            raise APIError(404, f"model '{model_id}' does not exist", code="model_not_found", param="model")
        return JSONResponse({"id": model_id, "object": "model", "created": 0, "owned_by": "talaria", "max_model_len": models[model_id]})

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await _body(request)
        tenant = auth.principal_of(request).tenant
        keep = await _chain(state, body, tenant)
        body = {**body, "store": keep.keep}  # the answer's ``store`` says what happened (absent: OpenAI's default)
        history, session = (keep.previous["messages"], keep.previous["session"]) if keep.previous else (None, None)
        if keep.keep and session is None and not any(body.get(k) for k in _SESSION_KEYS):
            session = "responses-" + keep.rid  # a stored chain is a session even when the client names none
        chat_body = responses_api.to_chat(body, history, session)
        keep.session = request.headers.get("x-session-id") or chat_body.get("session_id") or next((body[k] for k in _SESSION_KEYS if body.get(k)), "")
        inner = inner_request(request, "/v1/chat/completions", json.dumps(chat_body).encode())
        try:
            resp = await _endpoint(app, "/v1/chat/completions")(inner)
        except APIError as e:  # the chat path's field names -> the request's own
            e.param = responses_api.responses_param(e.param)
            raise
        if not isinstance(resp, StreamingResponse):
            out = responses_api.from_chat(body, json.loads(resp.body), keep.rid)
            await keep.save(body, chat_body, out)
            return JSONResponse(out, headers=_talaria_headers(resp))
        return StreamingResponse(_stream(body, resp, keep, chat_body), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **_talaria_headers(resp)})

    @router.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> JSONResponse:
        rec = await _stored(state, auth.principal_of(request).tenant, response_id)
        return JSONResponse(rec["response"])

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> JSONResponse:
        tenant = auth.principal_of(request).tenant
        await _stored(state, tenant, response_id)
        await state.responses.delete(tenant, response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await _body(request)
        tok = _tokenizer(state, body.get("model", ""))
        if "messages" in body:
            text = tok.render_chat_template(body["messages"], add_generation_prompt=body.get("add_generation_prompt", True), tools=body.get("tools"))
            ids = tok.encode(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        else:
            raise APIError(400, "tokenize needs 'prompt' (a string) or 'messages'", code="missing_field", param="prompt")
        max_len = state.registry.models().get(body.get("model"), 0)
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await _body(request)
        tok = _tokenizer(state, body.get("model", ""))
        ids = body.get("tokens")
        if not isinstance(ids, list) or any(not isinstance(t, int) or not 0 <= t < min(tok.vocab_size, UINT32_MAX) for t in ids):
            raise APIError(400, f"tokens must be a list of token ids in [0, {tok.vocab_size})", code="invalid_value", param="tokens")
        return JSONResponse({"prompt": tok.decode(ids)})

    return router


_SESSION_KEYS = ("session_id", "prompt_cache_key", "user", "safety_identifier")  # the chat path's order, after the header


class _Keep:
    """One Responses call's storage: its id, whether it is stored, the record it continues, the
    session it runs as. ``save`` writes the record (mutates the response's ``store`` when it could not)."""

    def __init__(self, store, tenant: str, rid: str, keep: bool, previous: dict | None) -> None:
        self.store, self.tenant, self.rid, self.keep, self.previous = store, tenant, rid, keep, previous
        self.session = ""

    async def save(self, body: dict, chat_body: dict, resp: dict) -> None:
        if not self.keep:
            return
        rec = {"response": resp, "messages": responses_api.conversation(body, chat_body, resp), "session": self.session}
        if not await self.store.put(self.tenant, self.rid, rec):
            resp["store"] = False  # over the record cap, or the bucket is full: said, not hidden


async def _chain(state, body: dict, tenant: str) -> _Keep:
    """Validate ``store`` / ``previous_response_id`` and load the record a call continues (400 / 404 naming the field)."""
    store = getattr(state, "responses", None)
    keep = body.get("store")
    if keep is None:  # OpenAI's default is to store (the Agents SDK's previous_response_id mode relies on it)
        keep = store is not None
    if keep not in (False, True):
        raise APIError(400, "'store' must be a boolean", code="invalid_value", param="store")
    if keep and store is None:
        raise APIError(400, "'store' is not available: the router's response store is off (router.responses.store)", code="unsupported_parameter", param="store")
    prev_id = body.get("previous_response_id")
    previous = None
    if prev_id is not None:
        if store is None:
            raise APIError(400, "'previous_response_id' is not available: the router's response store is off", code="unsupported_parameter", param="previous_response_id")
        if not isinstance(prev_id, str):
            raise APIError(400, "'previous_response_id' must be a string", code="invalid_value", param="previous_response_id")
        previous = await _stored(state, tenant, prev_id, "previous_response_id")
    return _Keep(store, tenant, responses_api.new_id(), bool(keep), previous)


async def _stored(state, tenant: str, response_id: str, param: str = "response_id") -> dict:
    """The stored record of ``response_id`` for ``tenant``; 404 naming ``param`` when absent (another
    tenant's, expired, deleted, never stored) or when the store is off."""
    store = getattr(state, "responses", None)
    rec = await store.get(tenant, response_id) if store is not None and RESPONSE_ID.match(response_id) else None
    if rec is None:
        raise APIError(404, f"no stored response '{response_id}'", code="response_not_found", param=param)
    return rec


def _talaria_headers(resp: Response) -> dict:
    return {k: v for k, v in resp.headers.items() if k.lower().startswith("x-talaria-")}


async def _stream(body: dict, resp: StreamingResponse, keep: _Keep | None = None, chat_body: dict | None = None) -> AsyncIterator[bytes]:
    tr = responses_api.StreamTranslator(body, keep.rid if keep is not None else None)

    def sse(ev: dict) -> bytes:
        return f"event: {ev['type']}\ndata: ".encode() + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"

    chunks = _sse_json(resp)
    try:
        for ev in tr.start():
            yield sse(ev)
        async for chunk in chunks:
            if "error" in chunk:
                yield sse({"type": "error", "sequence_number": tr.seq, **chunk["error"]})
                return
            for ev in tr.feed(chunk):
                yield sse(ev)
        events = tr.finish()
        if keep is not None and chat_body is not None:
            await keep.save(body, chat_body, tr.resp)  # before the final event, which carries ``store``
        for ev in events:
            yield sse(ev)
    finally:
        await chunks.aclose()
        await resp.body_iterator.aclose()
