"""The router process's event loop (``router.event_loop``): uvloop by default, asyncio on request; the CLI
runs the router's coroutine on the loop the setting names."""

from __future__ import annotations

import asyncio
import os
import signal

import uvloop

from talaria.cli import _run_until_signal, event_loop_factory
from talaria.config import RouterConfig, parse_config


def _loop_of(kind: str) -> asyncio.AbstractEventLoop:
    seen: list[asyncio.AbstractEventLoop] = []

    async def body(stop: asyncio.Event) -> None:
        seen.append(asyncio.get_running_loop())
        os.kill(os.getpid(), signal.SIGTERM)  # the runner's handler sets ``stop``, as for a real SIGTERM
        await asyncio.wait_for(stop.wait(), 5)

    assert _run_until_signal(body, event_loop_factory(kind)) == 0
    return seen[0]


def test_uvloop_on_request_runs_the_router_and_stops_on_sigterm():
    assert isinstance(_loop_of(parse_config({"router": {"event_loop": "uvloop"}}).router.event_loop), uvloop.Loop)


def test_the_default_is_the_standard_library_loop():
    assert RouterConfig().event_loop == "asyncio"
    loop = _loop_of(parse_config({}).router.event_loop)
    assert not isinstance(loop, uvloop.Loop) and isinstance(loop, asyncio.BaseEventLoop)
