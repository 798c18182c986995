"""Calls into engines over NATS: publish a GenerateRequest with a private reply inbox, then read the
TokenChunk stream from it. Liveness is bounded at every step: the engine must accept within
``accept_timeout``, chunks must keep coming within ``idle_timeout`` (a ``keepalive`` chunk, which an engine
sends for a call it holds in its queue, counts: only a silent engine times out), and the call is abandoned
as soon as the registry declares the instance gone (``alive()``), so a dead engine costs a bounded wait,
never a hang.

Token path: a reader that lags (its HTTP writes or the event loop were busy) does not pay
per token: :meth:`EngineCall.chunks` takes every chunk already queued and, when several are next in order,
yields them merged into one (:func:`merge_chunks`), so the caller encodes one JSON / SSE event for them.
Nothing waits for more tokens; a reader that keeps up sees the engine's chunks unchanged.

Reply inboxes: a router process subscribes once to ``<ns>.inbox.<router>.*``
(:class:`InboxMux`) and hands each call's chunks to it by the inbox's last token, instead of a subscription
per call. A per-call subscription cost a SUB and an UNSUB through the server on every call, one more write
from the router and a nats-py reader task created and cancelled per call. The engine's liveness probe of
an inbox (``PROBE_HEADER``) still gets "no responders" when the router process is gone; while it lives the
mux answers the probe: ``live`` for a call it still reads, ``gone`` for one it dropped (the engine aborts).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable

from nats.aio.client import Client as NATS
from nats.errors import MaxPayloadError

from talaria.subjects import PROBE_GONE, PROBE_HEADER, PROBE_LIVE, Subjects
from talaria.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)
# A chunk still missing this long after the call's last one arrived is lost, not late: one engine publishes a
# call's chunks in order on one connection, so NATS delivers them in order or not at all; the grace only covers
# a publisher that interleaved two of them. The call then fails at once instead of at the silence timeout.
LOST_CHUNK_GRACE_S = 1.0

SCHEMA_VERSION = 1


def merge_chunks(chunks: list[pb.TokenChunk]) -> pb.TokenChunk:
    """One chunk for consecutive in-order ``chunks``: token ids, text and logprobs concatenated; seq,
    finished, finish reason, ttft and every message field of the last (usage, error, attribution: a
    finished chunk merged with the tokens before it keeps the engine's time split). Returns the only chunk
    unchanged; mutates the first chunk otherwise (the caller owns them)."""
    if len(chunks) == 1:
        return chunks[0]
    out = chunks[0]
    texts = [out.text]
    for c in chunks[1:]:
        out.token_ids.extend(c.token_ids)
        out.logprobs.extend(c.logprobs)
        texts.append(c.text)
    last = chunks[-1]
    out.text = "".join(texts)
    out.seq = last.seq
    out.finished = last.finished
    out.finish_reason = last.finish_reason
    out.stop_reason = last.stop_reason
    out.ttft_seconds = last.ttft_seconds
    for field in _LAST_MESSAGES:
        if last.HasField(field):
            getattr(out, field).CopyFrom(getattr(last, field))
    return out


# the TokenChunk message fields a merged chunk takes from its last part (all of them: a new one is not lost)
_LAST_MESSAGES = tuple(f.name for f in pb.TokenChunk.DESCRIPTOR.fields if f.message_type is not None and not f.is_repeated)


class EngineUnavailable(Exception):
    """The engine did not accept or stopped answering; ``accepted`` says whether it had started. ``bus``: the
    cause is the router's own NATS connection (down, or lost while the call was in flight), not the engine,
    so the instance's health must not change."""

    def __init__(self, instance_id: str, message: str, accepted: bool, bus: bool = False):
        super().__init__(message)
        self.instance_id = instance_id
        self.accepted = accepted
        self.bus = bus


class TooLargeForBus(Exception):
    """The call's wire message is over the NATS server's ``max_payload``: it can never be sent, to any
    instance (a 413 naming the limit, never a health change)."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"the request is {size} bytes on the message bus, over its limit of {limit} bytes (NATS max_payload)")
        self.size, self.limit = size, limit


def wire_size(payload: bytes, headers: dict[str, str] | None) -> int:
    """Bytes the NATS server counts against ``max_payload`` for a message: payload plus header block
    (``NATS/1.0\r\n``, one ``key: value\r\n`` per header, a closing ``\r\n``)."""
    if not headers:
        return len(payload)
    return len(payload) + 12 + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


# A marker queued on every call in flight when the router's NATS connection drops (``InboxMux.bus_lost``)
_BUS_LOST = object()


class ChunkQueue:
    """A call's chunks between the NATS callback that delivers them and the one reader that takes them: a
    deque and, while the reader waits, one future the next put completes. The subset of ``asyncio.Queue``
    a call uses (unbounded, one reader) at a fraction of its Python calls per chunk: no getter/putter
    deques, no ``full`` check, no task-done count. ``get`` may be cancelled (timeouts, a closed reader);
    an item put meanwhile stays queued. Mutates itself only."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def get_nowait(self):
        """The oldest item; raises ``asyncio.QueueEmpty`` when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self):
        """The oldest item, waiting for one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class InboxMux:
    """Every reply inbox of one router process on one NATS subscription (``<prefix>.*``; see the module
    note). ``EngineCall.start`` registers a call under a fresh token and ``close`` removes it; a message on
    ``<prefix>.<token>`` goes to that call (:meth:`EngineCall.deliver`), a message for no registered call is
    counted in ``stray`` and dropped. Probes are answered (``live`` / ``gone``). The subscription is made on
    first use (:meth:`ready`) and survives reconnects (nats-py subscribes again). Mutates its call map."""

    def __init__(self, nc: NATS, prefix: str):
        self.nc = nc
        self.prefix = prefix
        self._calls: dict[str, "EngineCall"] = {}
        self._sub = None
        self._lock = asyncio.Lock()
        self.stray = 0  # messages for no registered call (a call closed before the engine's last words)

    async def ready(self) -> None:
        """Subscribe if not yet (at most once, however many calls start together)."""
        if self._sub is not None:
            return
        async with self._lock:
            if self._sub is None:
                self._sub = await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_msg)

    def register(self, call: "EngineCall") -> str:
        """A new inbox for ``call``; returns its subject."""
        token = uuid.uuid4().hex
        self._calls[token] = call
        return f"{self.prefix}.{token}"

    def unregister(self, inbox: str) -> None:
        self._calls.pop(inbox[len(self.prefix) + 1 :], None)

    def __len__(self) -> int:
        return len(self._calls)

    def bus_lost(self) -> int:
        """The NATS connection dropped (``disconnected`` callback): every registered call may have lost chunks
        that no one will send again (the server forgot this inbox's subscription until the reconnect), so each
        ends with ``EngineUnavailable(bus=True)`` once it has read what had already arrived. Returns the number
        of calls told; mutates their queues, not the call map (each call leaves it through ``close``)."""
        for call in self._calls.values():
            call.bus_lost()
        return len(self._calls)

    async def _on_msg(self, msg) -> None:
        call = self._calls.get(msg.subject[len(self.prefix) + 1 :])
        if msg.headers and PROBE_HEADER in msg.headers:  # the engine asks whether this call's requester listens
            if msg.reply:
                try:
                    await self.nc.publish(msg.reply, b"", headers={PROBE_HEADER: PROBE_LIVE if call is not None else PROBE_GONE})
                except Exception as e:  # noqa: BLE001 - the engine's probe times out and it keeps the call
                    log.debug("probe answer failed: %s", e)
            return
        if call is None:
            self.stray += 1
            return
        call.deliver(msg)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may already be closed
                pass
            self._sub = None


class EngineCall:
    """One in-flight call. Iterate ``chunks()``; call ``cancel()`` if the client goes away. Its chunks arrive
    through ``mux`` (the router's :class:`InboxMux`), whose NATS connection it publishes on (None: a call
    that is only read from, as in unit tests of the chunk stream)."""

    def __init__(self, mux: InboxMux | None, subjects: Subjects, instance_id: str, req: pb.GenerateRequest):
        self.nc = mux.nc if mux is not None else None
        self.subjects = subjects
        self.instance_id = instance_id
        self.req = req
        self.mux = mux
        self.inbox = ""  # set by start(): <ns>.inbox.<router>.<token>
        self._queue = ChunkQueue()  # TokenChunk; None: NATS no-responders; _BUS_LOST
        self.no_responders = False  # the engine's process is gone (its subscription with it)
        self.accepted: pb.TokenChunk | None = None
        self.finished = False
        self.keepalives = 0  # keepalive chunks seen (the engine held the call without tokens)
        self.trace = None  # services.router.tracing.CallTrace: sees every chunk, ended by close()

    def deliver(self, msg) -> None:
        """One message on this call's inbox (from the mux): a chunk, or NATS's no-responders status."""
        if msg.headers and msg.headers.get("Status") == "503" and not msg.data:
            self.no_responders = True  # NATS: nobody subscribes to the engine's generate subject
            self._queue.put_nowait(None)
            return
        chunk = pb.TokenChunk()
        try:
            chunk.ParseFromString(msg.data)
        except Exception:  # noqa: BLE001 - a corrupt chunk must not kill the subscription
            log.warning("undecodable chunk on %s", self.inbox)
            return
        self._queue.put_nowait(chunk)

    def bus_lost(self) -> None:
        """The router's NATS connection dropped while this call was in flight (from the mux): the reader
        ends with ``EngineUnavailable(bus=True)`` after the chunks already queued. Mutates the queue."""
        if not self.finished:
            self._queue.put_nowait(_BUS_LOST)

    async def start(self) -> None:
        """Register with the mux and publish the request (mutates the mux's call map). Raises
        ``TooLargeForBus`` for a message over the server's ``max_payload`` (nothing sent), and
        ``EngineUnavailable(bus=True)`` when the connection is down or refuses the publish: neither is about
        the engine."""
        assert self.mux is not None, "EngineCall.start needs the router's InboxMux"
        headers = dict(self.req.trace_context) or None  # W3C trace context also as NATS headers
        payload = self.req.SerializeToString()
        limit = self.nc.max_payload  # the server's, from its INFO (updated on every reconnect)
        size = wire_size(payload, headers)
        if limit > 0 and size > limit:
            raise TooLargeForBus(size, limit)
        # No flush round trip (a PING/PONG through the server on every call's path); a
        # connection that is down now (NATS restarting) is refused here instead of by a flush timeout.
        try:
            if not self.nc.is_connected:
                raise ConnectionError("not connected")
            await self.mux.ready()
            self.inbox = self.mux.register(self)
            if not self.nc.is_connected:  # dropped while subscribing: its bus_lost() may have missed this call
                raise ConnectionError("not connected")
            await self.nc.publish(self.subjects.generate(self.instance_id), payload, reply=self.inbox, headers=headers)
        except MaxPayloadError:  # a server with a smaller limit since the check (reconnected elsewhere)
            raise TooLargeForBus(size, self.nc.max_payload) from None
        except Exception as e:  # noqa: BLE001 - NATS restarting (subscribe refused, connection closed or down): not a 500
            raise EngineUnavailable(self.instance_id, f"NATS did not take the call to {self.instance_id}: {type(e).__name__}", False, bus=True) from None

    def _ended(self, marker) -> EngineUnavailable:
        """The exception for a queued end marker (no-responders or bus lost)."""
        if marker is _BUS_LOST:
            return EngineUnavailable(self.instance_id, f"the router lost its NATS connection while the call to {self.instance_id} was in flight "
                                     "(its remaining chunks cannot be recovered)", self.accepted is not None, bus=True)
        return EngineUnavailable(self.instance_id, f"engine {self.instance_id} is gone (NATS: no responders)", self.accepted is not None)

    async def _next(self, timeout: float, alive: Callable[[], bool], what: str) -> pb.TokenChunk:
        if not self._queue.empty():  # fast path: a chunk is already here (no timer, no task per chunk)
            chunk = self._queue.get_nowait()
            if chunk is None or chunk is _BUS_LOST:  # an end marker (engine gone / bus lost) came first
                raise self._ended(chunk)
            return chunk
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise EngineUnavailable(self.instance_id, f"engine {self.instance_id} {what} within {timeout:.0f}s", self.accepted is not None)
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
                # races with an arriving chunk, and the reader then runs on to the end of the call
                async with asyncio.timeout(min(left, 0.25)):
                    chunk = await self._queue.get()
                if chunk is None or chunk is _BUS_LOST:
                    raise self._ended(chunk)
                return chunk
            except TimeoutError:
                if not alive():
                    raise EngineUnavailable(self.instance_id, f"engine {self.instance_id} is gone (no heartbeats, or NATS has no responders for it)", self.accepted is not None) from None

    async def _late(self, missing: int, last: int, grace: float) -> pb.TokenChunk:
        """The next chunk within ``grace`` seconds while chunk ``missing`` is absent and the call's last chunk
        (``last``) already arrived; raises EngineUnavailable naming the lost chunk when none comes."""
        try:
            async with asyncio.timeout(grace):
                chunk = await self._queue.get()
        except TimeoutError:
            raise EngineUnavailable(self.instance_id, f"chunk {missing} of the call to {self.instance_id} was lost on the bus (the "
                                    f"call's last chunk, {last}, arrived and {grace:g}s passed)", True) from None
        if chunk is None or chunk is _BUS_LOST:
            raise self._ended(chunk)
        return chunk

    async def wait_accepted(self, timeout: float, alive: Callable[[], bool]) -> pb.TokenChunk:
        """First chunk: ``accepted`` or a terminal error. Raises EngineUnavailable on silence."""
        chunk = await self._next(timeout, alive, "did not accept the call")
        if chunk.accepted:
            self.accepted = chunk
        else:
            self.finished = True  # an error chunk is terminal
        return chunk

    def _ready(self) -> list[pb.TokenChunk]:
        """Every chunk already queued (no wait). An end marker stays queued for ``_next``."""
        out = []
        while not self._queue.empty():
            c = self._queue.get_nowait()
            if c is None or c is _BUS_LOST:
                self._queue.put_nowait(c)
                break
            out.append(c)
        return out

    async def chunks(self, idle_timeout: float, alive: Callable[[], bool]) -> AsyncIterator[pb.TokenChunk]:
        """Token chunks after acceptance, in order, up to and including the finished one; the chunks that
        are next in order and already here come merged into one (see the module note)."""
        expected = 1
        pending: dict[int, pb.TokenChunk] = {}
        while not self.finished:
            if expected not in pending:
                last = next((q for q, c in pending.items() if c.finished or c.HasField("error")), None)
                if last is not None:  # the call's last chunk is here but not one before it: lost on the bus
                    got = [await self._late(expected, last, min(idle_timeout, LOST_CHUNK_GRACE_S)), *self._ready()]
                else:
                    got = [await self._next(idle_timeout, alive, "sent nothing"), *self._ready()]
                for chunk in got:
                    if chunk.keepalive:
                        self.keepalives += 1  # the engine holds the call (queued): it restarted the silence timer
                    else:
                        pending[chunk.seq] = chunk
            run: list[pb.TokenChunk] = []
            while expected in pending:
                c = pending[expected]
                if c.HasField("error") and run:
                    break  # an error chunk goes alone, after the tokens before it
                del pending[expected]
                expected += 1
                run.append(c)
                if c.finished or c.HasField("error"):
                    break
            if not run:
                continue
            c = merge_chunks(run)
            if c.finished or c.HasField("error"):
                self.finished = True
            if self.trace is not None:
                self.trace.chunk(c)
            yield c

    async def cancel(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        try:
            msg = pb.CancelRequest(schema_version=SCHEMA_VERSION, request_id=self.req.request_id, reason=reason)
            await self.nc.publish(self.subjects.cancel(self.instance_id), msg.SerializeToString())
        except Exception as e:  # noqa: BLE001 - cancellation is best effort; the engine's deadline is the backstop
            log.warning("cancel of %s failed: %s", self.req.request_id, e)

    async def close(self) -> None:
        """End the call's trace and leave the mux (later messages on its inbox are strays)."""
        if self.trace is not None:
            self.trace.end()
        if self.mux is not None and self.inbox:
            self.mux.unregister(self.inbox)
