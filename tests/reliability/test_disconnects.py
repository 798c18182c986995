"""Mass client disconnects, streaming and not (issue 18 item 3 router part): every abandoned call is
cancelled on its engine (its completion hook says ``abort``) and every engine ends idle."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import health, wait_until
from tests.reliability.conftest import MODEL, Figures, engines_idle

pytestmark = pytest.mark.slow

N = 8
ENGINES = ["rel-a", "rel-b"]


async def _open(api: str, body: dict, session: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = api.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"X-Session-ID: {session}\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    writer.write(head + data)
    await writer.drain()
    return reader, writer


async def _abandon(stack, stream: bool) -> tuple[dict[str, str], int]:
    """Start N long calls, wait until the engines run them (and, streaming, until tokens flow), close every
    connection; returns session -> finish reason of its completion hook, and the calls that had started."""
    engines_idle(stack, ENGINES)
    nc = await connect(stack.nats_url, "rel-disconnect-hooks")
    hooks = await nc.subscribe(Subjects(stack.cfg.namespace).completed())
    tag = uuid.uuid4().hex[:6]
    sessions = [f"disc-{tag}-{i}" for i in range(N)]
    body = {"model": MODEL, "prompt": "count to a large number", "max_tokens": 2048, "ignore_eos": True, "stream": stream}
    conns = [await _open(stack.api, body, s) for s in sessions]
    try:
        running = lambda: sum(health(stack)["instances"][e]["running"] for e in ENGINES)  # noqa: E731
        await asyncio.to_thread(wait_until, lambda: running() >= N, 60, 0.1)
        if stream:
            for reader, _ in conns:  # a first token event on every stream
                while b"data: " not in await asyncio.wait_for(reader.readline(), 60):
                    pass
    finally:
        for _, w in conns:
            w.close()
    reasons: dict[str, str] = {}
    try:
        while len(reasons) < N:
            hook = pb.CompletionHook.FromString((await hooks.next_msg(60)).data)
            if hook.session_id in sessions:
                reasons[hook.session_id] = hook.finish_reason
    finally:
        await nc.close()
    return reasons, N


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
async def test_mass_disconnect_cancels_every_call_and_engines_go_idle(shared_stack, stream):
    before = health(shared_stack)["counters"]
    reasons, sent = await _abandon(shared_stack, stream)
    aborted = sum(r == "abort" for r in reasons.values())
    Figures(sent=sent, clean=aborted, lost=sent - aborted)  # for the table: clean = cancelled on its engine
    figures = f"sent={sent} ok=0 clean_error=0 lost(abandoned by client)={sent} aborted_on_engine={aborted} ran_to_end={sent - aborted} 5xx=0"
    assert aborted == sent, f"{figures}; hooks: {reasons}; router counters {health(shared_stack)['counters']}"
    await asyncio.to_thread(engines_idle, shared_stack, ENGINES, 30.0)
    after = health(shared_stack)["counters"]
    gone = after.get("client_disconnect", 0) - before.get("client_disconnect", 0)
    assert gone == sent, f"{figures}; router counted {gone} disconnects"
    if not stream:
        assert after.get("client_disconnect_nonstream", 0) - before.get("client_disconnect_nonstream", 0) == sent, figures
