"""Asynchronous copies for staging and switching (the mechanism; what to copy is decided elsewhere).

* CUDA: copies are issued on one side stream with ``non_blocking=True`` (the source is the pinned bank or
  the arena itself); readiness is a ``torch.cuda.Event`` recorded after the copy. ``wait`` makes the
  *current* stream wait on the event (no host sync) and ``sync`` blocks the host.
* CPU ("device" = host memory): a single worker thread performs the copies (``Tensor.copy_`` releases the
  GIL, so staging overlaps the forward pass); a ticket is a future.

The CUDA path cannot be exercised on the CPU-only development machines; it is written to the documented
stream/event API and kept deliberately small.

A :class:`WeightLink` (optional) paces every copy *from the host weight bank* (switch-time H2D and staging)
through one link of fixed bandwidth: such a copy completes no earlier than its bytes / bandwidth after the link
was last free. Device-to-device copies (clean staged chunks) do not cross it. It models a PCIe-, NVLink- or
disk-limited weight path on a testbed whose host-to-"device" copy is a CPU memcpy too fast to matter; the
switch records, and the costs the engine learns from them, carry the paced time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class WeightLink:
    """One host-to-device weight link of ``bytes_per_s`` (FIFO: transfers share it one after another).

    Design: a transfer of ``n`` bytes reserved at time ``t`` occupies the link from ``max(t, free_at)`` for
    ``n / bytes_per_s`` seconds; ``reserve`` returns when it may complete and ``wait_until`` sleeps the calling
    thread up to then (the real copy runs first, so the link adds only what the copy did not take). Safe from
    any thread. Clock and sleep injectable for tests."""

    def __init__(self, bytes_per_s: float, *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not bytes_per_s > 0:
            raise ValueError("a weight link needs a bandwidth > 0 bytes/s")
        self.bytes_per_s = float(bytes_per_s)
        self.clock = clock
        self.sleep = sleep
        self._free_at = float("-inf")
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on the link; returns the clock time the transfer completes. Mutates: the link's
        free time."""
        with self._lock:
            start = max(self.clock(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at

    def wait_until(self, t: float) -> None:
        """Block the calling thread until the clock reaches ``t``."""
        left = t - self.clock()
        if left > 0:
            self.sleep(left)


class Ticket:
    __slots__ = ("_future", "_event", "_link", "_not_before")

    def __init__(self, future: Future | None = None, event=None, link: WeightLink | None = None, not_before: float = float("-inf")) -> None:
        self._future = future
        self._event = event
        self._link = link  # a CUDA copy across a paced link completes no earlier than not_before
        self._not_before = not_before

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        if self._link is not None and self._link.clock() < self._not_before:
            return False
        return self._event is None or bool(self._event.query())

    def sync(self) -> None:
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()
        if self._link is not None:
            self._link.wait_until(self._not_before)

    def wait(self) -> None:
        """Order later work on the current stream after this copy (CPU: block until done)."""
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            if self._link is not None:
                self._link.wait_until(self._not_before)
            torch.cuda.current_stream().wait_event(self._event)


class Copier:
    """``submit(dst, src)`` copies in the background; ``copy(dst, src)`` copies now, in order. ``from_host``:
    the source is the host weight bank, so the copy crosses ``link`` when one is set."""

    def __init__(self, device: str | torch.device = "cpu", link: WeightLink | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.link = link
        self._copies_until = float("-inf")  # paced completion of the switch-time copies issued since the last barrier
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._pool = None
        else:
            self._stream = None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stager")

    def _pace(self, src: torch.Tensor, from_host: bool) -> float:
        """The link's completion time for this copy (-inf when it does not cross a paced link)."""
        if not from_host or self.link is None:
            return float("-inf")
        return self.link.reserve(src.numel() * src.element_size())

    def submit(self, dst: torch.Tensor, src: torch.Tensor, *, from_host: bool = False) -> Ticket:
        until = self._pace(src, from_host)
        if self.cuda:
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            return Ticket(event=ev, link=self.link if from_host else None, not_before=until)
        link, pool = self.link, self._pool
        assert pool is not None  # CPU: the stager thread
        if link is None or not from_host:
            return Ticket(future=pool.submit(dst.copy_, src))

        def paced() -> None:  # on the stager thread: the copy, then the rest of its time on the link
            dst.copy_(src)
            link.wait_until(until)

        return Ticket(future=pool.submit(paced))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, from_host: bool = False) -> None:
        """Switch-time copy: issued on the side stream (CUDA), ordered before the next ``barrier`` (which also
        waits out its time on a paced link)."""
        self._copies_until = max(self._copies_until, self._pace(src, from_host))
        if self.cuda:
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def barrier(self) -> None:
        """Everything issued so far is complete and visible to the compute stream (host sync on CUDA, so the
        switch timing record measures the real copy time)."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self._stream)
            ev.synchronize()
        elif self._pool is not None:
            self._pool.submit(lambda: None).result()
        if self.link is not None:
            until, self._copies_until = self._copies_until, float("-inf")
            self.link.wait_until(until)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
