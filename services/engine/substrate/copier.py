"""Asynchronous copies for staging and switching (the mechanism; what to copy is decided elsewhere).

* CUDA: copies are issued on one side stream with ``non_blocking=True`` (the source is the pinned bank or
  the arena itself); readiness is a ``torch.cuda.Event`` recorded after the copy. ``wait`` makes the
  *current* stream wait on the event (no host sync) and ``sync`` blocks the host.
* CPU ("device" = host memory): a single worker thread performs the copies (``Tensor.copy_`` releases the
  GIL, so staging overlaps the forward pass); a ticket is a future.

The CUDA path cannot be exercised on the CPU-only development machines; it is written to the documented
stream/event API and kept deliberately small.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Ticket:
    __slots__ = ("_future", "_event")

    def __init__(self, future: Future | None = None, event=None) -> None:
        self._future = future
        self._event = event

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or bool(self._event.query())

    def sync(self) -> None:
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()

    def wait(self) -> None:
        """Order later work on the current stream after this copy (CPU: block until done)."""
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)


class Copier:
    """``submit(dst, src)`` copies in the background; ``copy(dst, src)`` copies now, in order."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._pool = None
        else:
            self._stream = None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stager")

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        if self.cuda:
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            return Ticket(event=ev)
        return Ticket(future=self._pool.submit(dst.copy_, src))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Switch-time copy: issued on the side stream (CUDA), ordered before the next ``barrier``."""
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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
