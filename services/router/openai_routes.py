"""Extra OpenAI-surface endpoints, registered on the router app with one ``include_router`` line:
``/v1/responses``, ``/v1/models/{id}``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes).

``/v1/responses`` runs the app's own ``/v1/chat/completions`` handler in-process (same validation,
placement, tool parsing, structured output) on the translated body (``responses_api.py``); a streaming
chat response is consumed chunk by chunk and re-emitted as Responses events, and closing our stream closes
the chat stream (which cancels the engine's work).

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

from services.router import responses_api
from services.router.errors import APIError
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
        chat_body = responses_api.to_chat(body)
        inner = inner_request(request, "/v1/chat/completions", json.dumps(chat_body).encode())
        resp = await _endpoint(app, "/v1/chat/completions")(inner)
        if not isinstance(resp, StreamingResponse):
            return JSONResponse(responses_api.from_chat(body, json.loads(resp.body)), headers=_talaria_headers(resp))
        return StreamingResponse(_stream(body, resp), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **_talaria_headers(resp)})

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


def _talaria_headers(resp: Response) -> dict:
    return {k: v for k, v in resp.headers.items() if k.lower().startswith("x-talaria-")}


async def _stream(body: dict, resp: StreamingResponse) -> AsyncIterator[bytes]:
    tr = responses_api.StreamTranslator(body)

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
        for ev in tr.finish():
            yield sse(ev)
    finally:
        await chunks.aclose()
        await resp.body_iterator.aclose()
