"""Which asyncio event loop a Talaria process runs (``event_loop`` in the config).

Every service process (router, engine, telemetry) runs one asyncio loop that carries its NATS traffic, and the
router's also carries its HTTP server. ``uvloop`` (libuv) does the same work with less CPU per wake-up and per
socket write than the standard library's loop; on this 2-core machine the router, the engine's loop and
nats-server share the cores with the engine's step thread, so CPU saved on the loops is latency saved on the
call path (issue 20 §5; ``bench/README.md``, *Where a call's time goes*). ``auto`` takes uvloop where it is
installed (a declared dependency on Linux and macOS) and the standard loop otherwise; ``asyncio`` is the
fallback a deployment can force, ``uvloop`` fails the start when it is missing instead of running slower.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str = "auto") -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """(factory for a new event loop, the loop's name) for a config's ``event_loop``.

    Raises ``RuntimeError`` when ``uvloop`` is asked for and not installed, ``ValueError`` for an unknown choice.
    Mutates nothing (the global event loop policy is left alone: the factory is handed to ``asyncio.Runner``)."""
    if choice not in CHOICES:
        raise ValueError(f"event_loop must be one of {CHOICES}, not {choice!r}")
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise RuntimeError("event_loop is 'uvloop' but the uvloop package is not installed "
                                   "(pip install uvloop, or set event_loop: asyncio)") from None
        else:
            return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"
    return asyncio.new_event_loop, "asyncio"
