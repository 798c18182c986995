"""The cold engine's per-model call queues and its intake (Talaria §4.2: calls of inactive models wait, holding no pages).

Design NOTE. A call is accepted for any loaded model at any time, from any thread (``add``), and waits until its
model's slot admits it to the model's shell. Two stages, one owner:

* **intake** (any thread, under one lock): new calls and aborts land in ``_pending`` / ``_pending_aborts``; the
  live table (request id -> model) holds every call accepted and not yet finished, queued or in flight, so a
  duplicate id is refused and ``close_model`` can tell a busy model;
* **per-model queues** (executor thread only): the executor moves the intake into its model's queue at a step
  boundary (``take_intake`` then ``enqueue``) and takes admitted calls out in queue order (``take``).

Readers on other threads (the heartbeat's ``stats()``) use only the lock-guarded counts (``live_counts``) or
``total_waiting`` (a snapshot of lengths). Nothing outside this class touches the deques.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Iterable, Iterator

from services.engine.api import DuplicateRequestError
from services.engine.types import EngineRequest


class ModelQueues:
    def __init__(self, models: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._pending: list[EngineRequest] = []
        self._pending_aborts: list[str] = []
        self._live: dict[str, str] = {}  # request id -> model (queued or in flight); guarded by _lock
        self._queues: dict[str, deque[EngineRequest]] = {m: deque() for m in models}

    # ------------------------------------------------------------------ intake (any thread)
    def add(self, req: EngineRequest) -> None:
        """Accept ``req`` (its ``model`` already resolved); raises DuplicateRequestError for an id in flight.
        Mutates: the live table and the intake."""
        with self._lock:
            if req.request_id in self._live:
                raise DuplicateRequestError(f"request id {req.request_id!r} is already in flight")
            self._live[req.request_id] = req.model
            self._pending.append(req)

    def abort(self, request_id: str) -> None:
        """Ask for ``request_id`` to end (its ABORT output comes from the next step); unknown ids are ignored."""
        with self._lock:
            if request_id in self._live:
                self._pending_aborts.append(request_id)

    def finish(self, request_id: str) -> None:
        """The call ended (its final output was produced). Mutates: the live table."""
        with self._lock:
            self._live.pop(request_id, None)

    def has_live(self) -> bool:
        """Any call accepted and not finished (queued, at a shell, or still in the intake)."""
        with self._lock:
            return bool(self._live)

    def live_counts(self) -> dict[str, int]:
        """Unfinished calls per model (any thread)."""
        out: dict[str, int] = {}
        with self._lock:
            for m in self._live.values():
                out[m] = out.get(m, 0) + 1
        return out

    # ------------------------------------------------------------------ the queues (executor thread)
    def take_intake(self) -> tuple[list[EngineRequest], list[str]]:
        """The calls and aborts that arrived since the last call, in arrival order. Mutates: the intake."""
        with self._lock:
            new, self._pending = self._pending, []
            aborts, self._pending_aborts = self._pending_aborts, []
        return new, aborts

    def open(self, model: str) -> None:
        """Give ``model`` a queue (a model opened after start). Mutates: the queue table."""
        self._queues.setdefault(model, deque())

    def enqueue(self, req: EngineRequest) -> None:
        """``req`` waits in its model's queue (last). Mutates: that queue."""
        self._queues.setdefault(req.model, deque()).append(req)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a queued call out (an abort); None when it is not queued (it is at a shell, or gone)."""
        for q in self._queues.values():
            for r in q:
                if r.request_id == request_id:
                    q.remove(r)
                    return r
        return None

    def take(self, model: str, ids: Collection[str] | None) -> list[EngineRequest]:
        """Take ``model``'s queued calls named in ``ids`` (None: all of them), in queue order. Mutates: its queue."""
        q = self._queues.get(model)
        if not q:
            return []
        out = [r for r in q if ids is None or r.request_id in ids]
        for r in out:
            q.remove(r)
        return out

    def waiting(self, model: str) -> deque[EngineRequest] | tuple[()]:
        """``model``'s queued calls, oldest first (the queue itself: read, do not mutate; executor thread)."""
        return self._queues.get(model, ())

    def all_waiting(self) -> Iterator[EngineRequest]:
        """Every queued call, model by model (executor thread)."""
        for q in self._queues.values():
            yield from q

    def counts(self) -> dict[str, int]:
        """Queued calls per model, models with none included (executor thread)."""
        return {m: len(q) for m, q in self._queues.items()}

    def oldest(self) -> dict[str, float]:
        """The arrival time of each model's oldest queued call, models with a queue only."""
        return {m: q[0].arrival_time for m, q in self._queues.items() if q}

    def others_waiting(self, model: str) -> bool:
        """Whether a model other than ``model`` has queued calls (the next switch would take ``model`` away)."""
        return any(q for k, q in self._queues.items() if k != model)

    def total_waiting(self) -> int:
        """Queued calls of every model (any thread: a snapshot of the lengths)."""
        return sum(len(q) for q in list(self._queues.values()))

    def items(self):
        """(model, queue) pairs (executor thread; read only)."""
        return self._queues.items()
