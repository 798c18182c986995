"""The heartbeat publisher: the instance snapshot every period, on a path model compute cannot starve.

Design: a router declares an instance unhealthy after missed heartbeats, so a
heartbeat must say "alive" whenever the process is, however long a step runs or however busy the service's
event loop is with token chunks, tokenization and control work. The publisher therefore has its own thread,
its own asyncio loop and its own NATS connection; it shares nothing with the executor thread or the service
loop except the ``snapshot`` callable, which must be thread-safe and must not wait for a step (the
executor's ``stats()`` reads a snapshot taken after the latest step). Beats go out at a fixed rate (the next
one is due a period after the previous one was due, not after it was sent).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from talaria.config import NatsConfig
from talaria.natsutil import connect

log = logging.getLogger(__name__)


class HeartbeatThread:
    def __init__(self, url: str, name: str, nats: NatsConfig, subject: str, snapshot: Callable[[], bytes], period_s: float) -> None:
        self.url, self.name, self.nats, self.subject = url, name, nats, subject
        self.snapshot = snapshot
        self.period_s = period_s
        self.sent = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()

    def start(self, timeout: float = 15.0) -> None:
        """Start the thread and wait until its connection is up (raises TimeoutError otherwise)."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name=f"heartbeat-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"heartbeat connection {self.name} not up within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop beating and close the connection (blocking; call it off the service loop)."""
        loop, ev = self._loop, self._stop
        if loop is not None and ev is not None:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # the loop already ended
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await connect(self.url, self.name, self.nats)
        self._ready.set()
        due = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    await nc.publish(self.subject, self.snapshot())
                    self.sent += 1
                except Exception as e:  # noqa: BLE001 - keep beating through reconnects and snapshot errors
                    log.warning("heartbeat not published: %s", e)
                due = max(due + self.period_s, time.monotonic())
                try:
                    await asyncio.wait_for(self._stop.wait(), due - time.monotonic())
                except asyncio.TimeoutError:
                    pass
        finally:
            try:
                await nc.drain()
            except Exception:  # noqa: BLE001
                await nc.close()
