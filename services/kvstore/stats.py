"""Publishes the store's ``KvStoreStatsRecord`` on NATS every period, for the telemetry service.

The kvstore serves gRPC on threads; NATS (nats-py) is asyncio, so the publisher owns one event loop on a
daemon thread. It is telemetry, never on the serving path: a NATS server that is down or unreachable only
means no records (connect is retried, publish errors are counted), and stopping waits at most a second.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from talaria.config import NatsConfig
from talaria.natsutil import connect

log = logging.getLogger(__name__)


class StatsPublisher:
    def __init__(self, url: str, subject: str, record: Callable[[], bytes], period_s: float, nats: NatsConfig | None = None, name: str = "kvstore") -> None:
        self.url = url
        self.subject = subject
        self.record = record
        self.period_s = period_s
        self.nats = nats
        self.name = name
        self.published = 0
        self.errors = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvstore-stats", daemon=True)

    def start(self) -> StatsPublisher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        self._halt.set()
        if self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # loop already closed
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception:  # noqa: BLE001 - telemetry must never take the store down
            log.warning("kvstore stats publisher stopped", exc_info=True)

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._halt.is_set():
            return
        nc = None
        while nc is None and not self._stop.is_set():
            try:
                nc = await connect(self.url, self.name, self.nats)
            except Exception as e:  # noqa: BLE001
                log.warning("kvstore stats: NATS at %s not reachable (%s); retrying", self.url, e)
                await self._sleep(2.0)
        try:
            while not self._stop.is_set():
                try:
                    await nc.publish(self.subject, self.record())
                    self.published += 1
                except Exception:  # noqa: BLE001
                    self.errors += 1
                    log.debug("kvstore stats not published", exc_info=True)
                await self._sleep(self.period_s)
        finally:
            if nc is not None:
                try:
                    await asyncio.wait_for(nc.drain(), 1.0)
                except Exception:  # noqa: BLE001
                    pass

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), s)
        except asyncio.TimeoutError:
            pass
