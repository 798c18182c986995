"""One preemptive transfer scheduler for the host→device channel (JointServe §4.3).

Design NOTE. Three traffic classes share one channel: target-model prefetch (``PREFETCH``), the streaming
shard refill of a hot-swap (``STREAM``, §4.4) and KV offload/restore of live sessions (``KV``). Left
unordered, a weight burst would starve the restore of a session already in service, so:

* static priority ``PREFETCH > STREAM > KV``;
* transfers are split into chunks (the bank's chunks for weights) and the channel is re-arbitrated at every
  chunk boundary, so a higher-priority transfer preempts an in-flight lower one between two chunks;
* a κ-floor (15% by default) reserves a minimum share for KV: whenever KV work waits and KV received less
  than κ of the bytes served in the recent window, the next chunk is a KV chunk. It is a lower bound on what
  KV gets, not a cap on what weights may use when no KV waits.

:class:`TransferQueue` is the pure arbitration (no threads, no torch: tests drive it directly).
:class:`TransferScheduler` is the mechanism: one worker thread serving chunks in the queue's order and
measuring the channel (bytes/s per class, EWMA); each task's :class:`TransferTicket` completes when all of
its chunks are copied. :class:`ScheduledCopier` gives the substrate's ``Copier`` interface on top of it, so
staging and switch-time copies go through the same channel.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from talaria.ewma import Ewma


class TrafficClass(IntEnum):
    PREFETCH = 0
    STREAM = 1
    KV = 2


@dataclass(slots=True)
class _Task:
    id: int
    cls: TrafficClass
    chunks: deque  # of (nbytes, payload)
    ticket: "TransferTicket"
    label: str = ""


class TransferQueue:
    """Pure arbitration of chunked transfers (mutates only itself)."""

    def __init__(self, kappa: float = 0.15, window_bytes: int = 64 << 20) -> None:
        if not 0 <= kappa < 1:
            raise ValueError("kappa must be in [0, 1)")
        self.kappa = kappa
        self.window_bytes = window_bytes
        self._queues: dict[TrafficClass, deque[_Task]] = {c: deque() for c in TrafficClass}
        self._served: deque[tuple[TrafficClass, int]] = deque()  # recent (class, bytes), ~window_bytes total
        self._served_bytes = 0
        self._kv_bytes = 0
        self._ids = 0
        self.floor_picks = 0  # chunks given to KV by the floor (not by priority)

    def submit(self, cls: TrafficClass, chunks: list[tuple[int, object]], ticket: "TransferTicket", label: str = "") -> _Task:
        self._ids += 1
        t = _Task(self._ids, TrafficClass(cls), deque(chunks), ticket, label)
        self._queues[t.cls].append(t)
        return t

    def pending(self) -> bool:
        return any(self._queues.values())

    def pick(self) -> tuple[_Task, int, object] | None:
        """The next chunk to copy: (task, nbytes, payload), or None. Mutates: queues, window."""
        kvq = self._queues[TrafficClass.KV]
        if kvq and self._served_bytes and self._kv_bytes < self.kappa * self._served_bytes:
            task = kvq[0]
            self.floor_picks += 1
        else:
            task = next((q[0] for c, q in sorted(self._queues.items()) if q), None)
            if task is None:
                return None
        nbytes, payload = task.chunks.popleft()
        if not task.chunks:
            self._queues[task.cls].popleft()
        self._account(task.cls, nbytes)
        return task, nbytes, payload

    def _account(self, cls: TrafficClass, nbytes: int) -> None:
        self._served.append((cls, nbytes))
        self._served_bytes += nbytes
        self._kv_bytes += nbytes if cls is TrafficClass.KV else 0
        while self._served and self._served_bytes - self._served[0][1] >= self.window_bytes:
            c, b = self._served.popleft()
            self._served_bytes -= b
            self._kv_bytes -= b if c is TrafficClass.KV else 0


class TransferTicket:
    """Completion of one task (all its chunks). ``done``/``sync``/``wait`` like ``copier.Ticket``."""

    __slots__ = ("_event", "_left", "_error", "done_at", "label")

    def __init__(self, n_chunks: int, label: str = "") -> None:
        self._event = threading.Event()
        self._left = n_chunks
        self._error: BaseException | None = None
        self.done_at: float | None = None
        self.label = label
        if n_chunks == 0:
            self._finish()

    def _finish(self) -> None:
        self.done_at = time.perf_counter()
        self._event.set()

    def _chunk_done(self, error: BaseException | None = None) -> None:
        self._left -= 1
        if error is not None:
            self._error = error
        if self._left <= 0 or error is not None:
            self._finish()

    def done(self) -> bool:
        return self._event.is_set()

    def sync(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error

    wait = sync


@dataclass
class ChannelStats:
    bytes_by_class: dict[str, int] = field(default_factory=lambda: {c.name: 0 for c in TrafficClass})
    chunks: int = 0
    preemptions: int = 0  # a chunk of a higher class served while a lower-class task was part-way


class TransferScheduler:
    """The worker serving :class:`TransferQueue` picks. ``copy_fn(payload)`` performs one chunk's copy (default:
    ``dst.copy_(src)`` for a ``(dst, src)`` payload) — tests inject a slow one."""

    def __init__(self, queue: TransferQueue | None = None, copy_fn: Callable[[object], None] | None = None) -> None:
        self.queue = queue or TransferQueue()
        self.copy_fn = copy_fn or (lambda p: p() if callable(p) else p[0].copy_(p[1]))
        self.rate = Ewma(2e9)  # measured bytes/s of the channel
        self.stats = ChannelStats()
        self._cv = threading.Condition()
        self._closed = False
        self._partial: _Task | None = None
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="transfer", daemon=True)
        self._thread.start()

    def submit(self, cls: TrafficClass, chunks: list[tuple[int, object]], label: str = "") -> TransferTicket:
        """Queue a transfer of ``chunks`` ((nbytes, payload) in order). Mutates: the queue."""
        ticket = TransferTicket(len(chunks), label)
        if chunks:
            with self._cv:
                self.queue.submit(cls, chunks, ticket, label)
                self._cv.notify_all()
        return ticket

    def submit_kv(self, chunks: list[tuple[int, object]]) -> TransferTicket:
        """A live session's KV restore (class ``KV``: protected by the κ-floor)."""
        return self.submit(TrafficClass.KV, chunks, "kv_restore")

    def _run(self) -> None:
        from services.engine.intra_op import set_thread_count  # torch: the queue above stays torch-free

        set_thread_count(1)  # one OpenMP pool per process: the executor's (intra_op.py)
        while True:
            with self._cv:
                while not self.queue.pending() and not self._closed:
                    self._cv.wait()
                if self._closed and not self.queue.pending():
                    return
                task, nbytes, payload = self.queue.pick()
                if self._partial is not None and self._partial is not task and self._partial.chunks and task.cls < self._partial.cls:
                    self.stats.preemptions += 1
                self._partial = task
                self._busy = True
            t0 = time.perf_counter()
            err = None
            try:
                self.copy_fn(payload)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                err = e
            dt = time.perf_counter() - t0
            if dt > 0 and nbytes:
                self.rate.add(nbytes / dt)
            self.stats.bytes_by_class[task.cls.name] += nbytes
            self.stats.chunks += 1
            task.ticket._chunk_done(err)
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def drain(self) -> None:
        """Block until everything queued so far is copied."""
        with self._cv:
            while self.queue.pending() or self._busy:
                self._cv.wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)


class ScheduledCopier:
    """The substrate's ``Copier`` interface over one :class:`TransferScheduler` (CPU path): ``submit`` is a
    ``PREFETCH`` transfer (staging), ``copy`` a switch-time transfer ordered before the next ``barrier``."""

    def __init__(self, sched: TransferScheduler, device="cpu") -> None:
        import torch

        self.sched = sched
        self.device = torch.device(device)
        self.cuda = False
        self.link = None  # no paced weight link (substrate/copier.WeightLink) on this path
        self._outstanding: list[TransferTicket] = []

    def submit(self, dst, src, *, from_host: bool = False) -> TransferTicket:  # no weight link here: a cold engine refuses one with partial layers
        return self.sched.submit(TrafficClass.PREFETCH, [(dst.numel() * dst.element_size(), (dst, src))], "stage")

    def copy(self, dst, src, *, from_host: bool = False) -> None:
        self._outstanding.append(self.sched.submit(TrafficClass.PREFETCH, [(dst.numel() * dst.element_size(), (dst, src))], "switch"))

    def barrier(self) -> None:
        out, self._outstanding = self._outstanding, []
        for t in out:
            t.sync()

    def close(self) -> None:
        self.sched.close()
