"""The Anthropic Messages endpoints, registered on the router app with one ``include_router`` line:
``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

``/v1/messages`` runs the app's own ``/v1/chat/completions`` handler in-process on the translated body
(``anthropic_api.py``), like ``/v1/responses``: same validation, session, placement, tool parsing and
constrained decoding. A chat error is re-raised naming the Anthropic field it came from, and every error of
these paths is answered in Anthropic's shape (``errors.anthropic_path``). A streaming chat response is read
chunk by chunk and re-emitted as Anthropic events; closing our stream closes the chat stream (which cancels
the engine's work). ``count_tokens`` renders the chat template with the model's tokenizer on the router's
host (as ``/tokenize`` does) and counts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.router import anthropic_api
from services.router.errors import APIError
from services.router.openai_routes import _body, _endpoint, _sse_json, _talaria_headers, _tokenizer, inner_request


def anthropic_routes(state, app: FastAPI) -> APIRouter:  # state: services.router.service.RouterState
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await _body(request)
        tr = anthropic_api.to_chat(body)
        inner = inner_request(request, "/v1/chat/completions", json.dumps(tr.chat).encode())
        try:
            resp = await _endpoint(app, "/v1/chat/completions")(inner)
        except APIError as e:  # the chat path's field names -> the request's own
            e.param = tr.anthropic_param(e.param)
            raise
        model = tr.chat["model"]
        if not isinstance(resp, StreamingResponse):
            return JSONResponse(anthropic_api.from_chat(model, json.loads(resp.body)), headers=_talaria_headers(resp))
        return StreamingResponse(_stream(model, resp), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **_talaria_headers(resp)})

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        body = await _body(request)
        tr = anthropic_api.to_chat(body, count_only=True)
        model = tr.chat["model"]
        if model not in state.registry.models():
            raise APIError(404, f"model '{model}' does not exist", code="model_not_found", param="model")
        tok = _tokenizer(state, model)
        msgs = tr.chat["messages"]
        cont = bool(tr.chat.get("continue_final_message"))
        switch = {}
        if tr.chat.get("reasoning_effort"):  # the prompt as the engine renders it: with the template's reasoning switch
            from talaria.reasoning_parsers import effort_kwargs

            switch = effort_kwargs(tok.chat_template, tr.chat["reasoning_effort"]) or {}
        try:
            text = tok.render_chat_template(msgs, add_generation_prompt=not cont, tools=tr.chat.get("tools"), **switch)
            if cont:
                from talaria.tokenizer import continue_final_message

                text = continue_final_message(text, msgs)
        except Exception as e:  # noqa: BLE001 - the template's errors are the caller's input
            raise APIError(400, f"messages cannot be rendered by the chat template: {e}", code="invalid_value", param="messages") from None
        return JSONResponse({"input_tokens": len(tok.encode(text, add_special_tokens=False))})

    return router


def _sse(ev: dict) -> bytes:
    return f"event: {ev['type']}\ndata: ".encode() + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"


async def _stream(model: str, resp: StreamingResponse) -> AsyncIterator[bytes]:
    tr = anthropic_api.StreamTranslator(model)
    chunks = _sse_json(resp)
    try:
        for ev in tr.start():
            yield _sse(ev)
        async for chunk in chunks:
            if "error" in chunk:  # the chat stream's error event (engine lost, engine error): Anthropic's
                err = chunk["error"]
                status = {"engine_unavailable": 503, "overloaded": 429}.get(err.get("code"), 500)
                yield _sse(APIError(status, err.get("message", "error"), code=err.get("code")).anthropic_body())
                return
            for ev in tr.feed(chunk):
                yield _sse(ev)
        for ev in tr.finish():
            yield _sse(ev)
    finally:
        await chunks.aclose()
        await resp.body_iterator.aclose()
