"""``n > 1``: n independent samples of one prompt, as n calls of the same handler with ``n = 1``.

Choice ``i`` is the sub-call with seed ``seed + i`` (when a seed is given; else each sub-call's engine seed
derives from its own request id), so the choices differ under sampling and are reproducible with a seed.
Only choice 0 carries the session (a session has one continuation); the others run session-less. The
prompt's KV is shared through the engine's prefix cache where the sub-calls land on the same instance after
the first one's prefill is cached; they are not forked copy-on-write inside one engine step (the engine
admits them as separate calls). Usage: ``prompt_tokens`` and ``cached_tokens`` of choice 0 (the prompt is
one prompt), ``completion_tokens`` summed over the choices.

Streaming interleaves the sub-streams' chunks as they arrive, with each choice's ``index`` rewritten, one
usage chunk at the end (if asked) and one ``[DONE]``; closing the stream closes every sub-stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.router.errors import APIError
from services.router.openai_routes import inner_request

MAX_N = 16


def wants_fanout(data: dict) -> bool:
    n = data.get("n")
    return isinstance(n, int) and not isinstance(n, bool) and n > 1


def _sub_bodies(data: dict) -> list[dict]:
    n = data["n"]
    if n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}", code="invalid_value", param="n")
    if data.get("best_of") not in (None, 1):
        raise APIError(400, "best_of is not supported", code="unsupported_parameter", param="best_of")
    subs = []
    for i in range(n):
        b = {**data, "n": 1}
        if isinstance(data.get("seed"), int) and not isinstance(data.get("seed"), bool):
            b["seed"] = data["seed"] + i
        if i > 0:
            for k in ("session_id", "user", "prompt_cache_key", "safety_identifier"):
                b.pop(k, None)
            if b.get("stream"):
                b["stream_options"] = {"include_usage": True}
        elif b.get("stream"):
            b["stream_options"] = {"include_usage": True}
        subs.append(b)
    return subs


def _inner(request: Request, body: dict, drop_session_header: bool) -> Request:
    """One sub-call's request: ``body`` as its JSON, the outer client's disconnects passed through; calls
    after the first drop ``X-Session-ID`` (only choice 0 keeps the session)."""
    inner = inner_request(request, request.scope["path"], json.dumps(body).encode())
    if drop_session_header:
        inner.scope["headers"] = [(k, v) for k, v in inner.scope["headers"] if k.lower() != b"x-session-id"]
    return inner


def _sum_usage(usages: list[dict]) -> dict:
    first = dict(usages[0])
    comp = sum(u.get("completion_tokens", 0) for u in usages)
    first["completion_tokens"] = comp
    first["total_tokens"] = first.get("prompt_tokens", 0) + comp
    return first


async def fan_out(request: Request, data: dict, handler) -> Response:
    """Serve ``data`` (with ``n > 1``) as n calls of ``handler(request)``; mutates nothing shared."""
    subs = _sub_bodies(data)
    if not data.get("stream"):
        tasks = [asyncio.ensure_future(handler(_inner(request, b, i > 0))) for i, b in enumerate(subs)]
        try:
            resps = await asyncio.gather(*tasks)
        except BaseException:  # one choice failed (or the client left): the others' engine work is cancelled
            for t in tasks:
                t.cancel()
            raise
        bodies = [json.loads(r.body) for r in resps]
        out = bodies[0]
        out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        out["usage"] = _sum_usage([b["usage"] for b in bodies])
        return JSONResponse(out, headers={k: v for k, v in resps[0].headers.items() if k.lower().startswith("x-talaria-")})
    resps = []
    try:
        for i, b in enumerate(subs):
            resps.append(await handler(_inner(request, b, i > 0)))
    except BaseException:
        for r in resps:
            try:
                await r.body_iterator.aclose()
            except RuntimeError:  # already closed by its cancelled pump
                pass
        raise
    include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_merge(resps, include_usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _pump(i: int, resp: StreamingResponse, q: asyncio.Queue) -> None:
    buf = b""
    try:
        async for piece in resp.body_iterator:
            buf += piece if isinstance(piece, bytes) else piece.encode()
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if ev.startswith(b"data: ") and ev[6:] != b"[DONE]":
                    await q.put((i, json.loads(ev[6:])))
    finally:
        await q.put((i, None))


async def _merge(resps: list[StreamingResponse], include_usage: bool) -> AsyncIterator[bytes]:
    q: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, r, q)) for i, r in enumerate(resps)]
    usages: dict[int, dict] = {}
    live = len(tasks)
    last = None
    try:
        while live:
            i, chunk = await q.get()
            if chunk is None:
                live -= 1
                continue
            if chunk.get("usage"):
                usages[i] = chunk["usage"]
            if "error" in chunk:
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                break
            if chunk.get("choices"):
                chunk["choices"] = [{**c, "index": i} for c in chunk["choices"]]
                chunk.pop("usage", None)
                last = chunk
                yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        if include_usage and last is not None and len(usages) == len(resps):
            tail = {**last, "choices": [], "usage": _sum_usage([usages[k] for k in sorted(usages)])}
            yield b"data: " + json.dumps(tail, separators=(",", ":")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for r in resps:
            try:
                await r.body_iterator.aclose()
            except RuntimeError:  # already closed by its cancelled pump
                pass
