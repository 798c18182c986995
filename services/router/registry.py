"""Instance registry: the router's view of engine instances, built from heartbeats (InstanceSnapshot).

Health that tells slow from dead (Talaria §4.1: "an instance that misses heartbeats is excluded from new
non-reserved placements"). Per instance, from the silence since its last
snapshot and what the router learned otherwise:

* ``ok`` — heartbeats on time: takes new calls.
* ``suspect`` — silent longer than the miss limit (``miss_limit_s`` seconds, and at least ``miss_limit``
  heartbeat periods), or it failed to accept a call (``mark_suspect``): no new placements, but its
  in-flight calls go on. A loaded engine is late, not gone.
* ``dead`` — really gone: NATS said no one listens on its subjects (``mark_gone``: the process exited, its
  connection closed), or silent longer than ``dead_after_s``. Only now are its in-flight calls aborted
  (``alive`` is False).
* ``draining`` — visible, takes no new calls, in-flight calls go on.

A newer snapshot (or a restarted engine's new epoch) clears suspicion and death. A snapshot from an older
epoch or with a sequence number not newer than the last one is out of order and ignored. Between ``ok`` and
``suspect``, an instance whose snapshot is *stale* (received more than ``stale_after`` periods ago, or sent
long before it arrived) is still healthy, so a live lease to it is honoured, but it gets no new
non-reserved calls until fresh telemetry arrives. ``sweep`` reports every state change once, for the log.

In-flight overlay (§4.1): calls this router forwarded are stamped with the wall time; a snapshot sent
after a forward already counts that call, so only forwards newer than the snapshot stay in the overlay.
Completions correct it the other way (a session's return must not queue behind its own finished
call): a completion hook removes its call from the overlay when no snapshot has counted it yet, and when the
last snapshot was sent before the call finished (it still counts the call as running) the call is kept in
``done`` until a snapshot sent after its finish arrives; ``running`` is the snapshot's count less those.

Change feed: every mutation through ``observe`` / ``forwarded`` / ``mark_suspect`` / ``mark_gone`` records
the instance id in a set that ``take_changed`` drains, and ``deadlines`` gives the clock times at which an
instance's health or freshness can flip without a new event; the gateway uses both to rebuild only what
changed.

Pure state plus an injected clock: no NATS here (the service feeds ``observe`` and runs the probes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from talaria.clock import Clock
from talaria.v1 import engine_pb2 as pb


@dataclass(slots=True)
class InstanceView:
    instance_id: str
    snapshot: pb.InstanceSnapshot
    received_at: float
    received_wall: float = 0.0
    overlay: dict[str, float] = field(default_factory=dict)  # call id -> wall time of calls forwarded since the snapshot
    done: dict[str, float] = field(default_factory=dict)  # call id -> finish time of calls the snapshot still counts
    ended: dict[str, tuple[float, float]] = field(default_factory=dict)  # call id -> (forwarded, finished) of overlay calls that ended
    suspect_until: float = 0.0  # set when a call to it timed out; cleared by a newer snapshot
    gone: str = ""  # why it is known dead (NATS no-responders); cleared by a newer snapshot

    @property
    def inflight(self) -> int:
        """In-flight overlay: calls this router forwarded that the last snapshot does not count yet."""
        return len(self.overlay)

    @property
    def running(self) -> int:
        """Calls running per the snapshot, less those whose completion arrived after it was sent."""
        return max(0, self.snapshot.num_running - len(self.done))

    def serves(self, model: str) -> bool:
        return any(m.model == model and m.loaded for m in self.snapshot.models)

    def max_context(self, model: str) -> int:
        for m in self.snapshot.models:
            if m.model == model:
                return m.max_context
        return 0

    def max_token_bytes(self, model: str) -> int:
        """The instance's bound on prompt-text bytes per token of ``model`` (0 = not reported)."""
        for m in self.snapshot.models:
            if m.model == model:
                return m.max_token_bytes
        return 0


@dataclass
class Registry:
    clock: Clock
    miss_limit: float = 3.0
    instances: dict[str, InstanceView] = field(default_factory=dict)
    stale_after: float = 2.0  # periods after which a snapshot is too old for non-reserved placement
    wall: Callable[[], float] | None = None  # wall clock (overlay stamps, snapshot age); None: overlay cleared per snapshot
    miss_limit_s: float = 0.0  # seconds of silence before suspect (the larger of this and miss_limit periods)
    dead_after_s: float = 0.0  # seconds of silence before dead (in-flight calls aborted); 0: the miss limit
    _changed: set[str] = field(default_factory=set, init=False, repr=False)  # ids mutated since take_changed()
    _reported: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # id -> state last swept
    _anon: int = field(default=0, init=False, repr=False)  # keys of forwards without a call id

    def observe(self, snap: pb.InstanceSnapshot) -> bool:
        """Record a snapshot; returns False (and changes nothing) when it is stale. Mutates ``instances``."""
        now = self.clock.now()
        cur = self.instances.get(snap.instance_id)
        if cur is not None:
            old = cur.snapshot
            if snap.epoch < old.epoch or (snap.epoch == old.epoch and snap.seq <= old.seq):
                return False
            cur.snapshot = snap
            cur.received_at = now
            cur.received_wall = self.wall() if self.wall is not None else 0.0
            cur.suspect_until = 0.0
            cur.gone = ""
            # Forwards older than the snapshot are now part of its own counters.
            sent = snap.sent_unix if self.wall is not None else 0.0
            cur.overlay = {k: t for k, t in cur.overlay.items() if sent and t > sent}
            cur.done = {k: t for k, t in cur.done.items() if snap.sent_unix and t > snap.sent_unix}
            # Overlay calls that ended after it was sent: it counts those forwarded before it as running.
            ended, cur.ended = cur.ended, {}
            for k, (fwd, fin) in ended.items():
                if sent and fin > sent:
                    if fwd > sent:
                        cur.ended[k] = (fwd, fin)
                    else:
                        cur.done[k] = fin
            self._changed.add(snap.instance_id)
            return True
        self.instances[snap.instance_id] = InstanceView(snap.instance_id, snap, now, self.wall() if self.wall is not None else 0.0)
        self._changed.add(snap.instance_id)
        return True

    def take_changed(self) -> set[str]:
        """Ids of instances mutated (snapshot, forward, suspect) since the last call; clears the set."""
        out, self._changed = self._changed, set()
        return out

    def miss_limit_of(self, view: InstanceView) -> float:
        """Seconds of silence after which ``view`` is suspect."""
        return max(self.miss_limit_s, self.miss_limit * (view.snapshot.heartbeat_period_s or 1.0))

    def dead_limit_of(self, view: InstanceView) -> float:
        """Seconds of silence after which ``view`` is dead."""
        return max(self.dead_after_s, self.miss_limit_of(view))

    def silence(self, view: InstanceView) -> float:
        return self.clock.now() - view.received_at

    def deadlines(self, view: InstanceView) -> tuple[float, ...]:
        """Clock times (``clock.now()`` scale) at which ``alive``/``fresh``/``healthy`` may next change for
        ``view`` without any new event (miss limit, dead limit, stale limit, end of suspicion)."""
        period = view.snapshot.heartbeat_period_s or 1.0
        t = view.received_at
        out = (t + self.miss_limit_of(view), t + self.dead_limit_of(view), t + self.stale_after * period)
        return out + (view.suspect_until,) if view.suspect_until > 0 else out

    def alive(self, view: InstanceView) -> bool:
        """Not known dead: in-flight calls keep going (even while it drains or is suspect)."""
        return not view.gone and self.silence(view) <= self.dead_limit_of(view)

    def fresh(self, view: InstanceView) -> bool:
        """The snapshot is recent enough to place new non-reserved calls on (§4.1)."""
        period = view.snapshot.heartbeat_period_s or 1.0
        if self.clock.now() - view.received_at > self.stale_after * period:
            return False
        if self.wall is not None and view.snapshot.sent_unix:
            # Sent long before it arrived (a frozen or partitioned sender's backlog).
            if view.received_wall - view.snapshot.sent_unix > self.miss_limit_of(view):
                return False
        return True

    def forwarded(self, instance_id: str, call_id: str = "") -> None:
        """Add one call to an instance's in-flight overlay (``call_id`` "": an anonymous one, which only a
        snapshot removes). Mutates the view's overlay and the change feed."""
        v = self.instances.get(instance_id)
        if v is not None:
            self._anon += 1
            v.overlay[call_id or f"#{self._anon}"] = self.wall() if self.wall is not None else 0.0
            self._changed.add(instance_id)

    def completed(self, instance_id: str, call_id: str, finish_unix: float) -> None:
        """A call ended on ``instance_id`` at ``finish_unix`` (wall clock, as ``sent_unix``): it is no longer
        queue ahead of anyone. Still in the overlay (no snapshot counted it): removed from it and remembered in
        ``ended`` (a later snapshot sent before it finished counts it as running: ``observe`` moves it to
        ``done`` then); counted by a snapshot sent before it finished: kept in ``done`` until a later snapshot.
        Idempotent per call: the router reports the end when it sees the finished chunk, the engine's
        completion hook reports it again. Mutates the view's overlay / done / ended sets and the change feed."""
        v = self.instances.get(instance_id)
        if v is None or not call_id or call_id in v.ended or call_id in v.done:
            return
        fwd = v.overlay.pop(call_id, None)
        if fwd is not None:
            v.ended[call_id] = (fwd, finish_unix)
            self._changed.add(instance_id)
        elif v.snapshot.sent_unix and finish_unix > v.snapshot.sent_unix:
            v.done[call_id] = finish_unix
            self._changed.add(instance_id)

    def healthy(self, view: InstanceView) -> bool:
        """May receive new calls: heartbeats within the miss limit, not suspect, not dead, not draining."""
        if not self.alive(view) or self.silence(view) > self.miss_limit_of(view):
            return False
        if view.suspect_until > self.clock.now():
            return False
        return not view.snapshot.draining

    def state(self, view: InstanceView) -> str:
        """``ok`` | ``draining`` | ``suspect`` (late or failed to answer: no new calls) | ``dead`` (gone)."""
        if not self.alive(view):
            return "dead"
        if self.silence(view) > self.miss_limit_of(view) or view.suspect_until > self.clock.now():
            return "suspect"
        return "draining" if view.snapshot.draining else "ok"

    def why(self, view: InstanceView) -> str:
        """The reason for ``state(view)``, for the log."""
        quiet = self.silence(view)
        if view.gone:
            return view.gone
        if quiet > self.miss_limit_of(view):
            return f"no heartbeat for {quiet:.1f}s (suspect after {self.miss_limit_of(view):.1f}s, dead after {self.dead_limit_of(view):.1f}s)"
        if view.suspect_until > self.clock.now():
            return "did not accept a call in time"
        return "draining" if view.snapshot.draining else "heartbeats on time"

    def mark_suspect(self, instance_id: str, seconds: float) -> None:
        """Exclude an instance that failed to answer until a fresh snapshot or ``seconds`` pass."""
        v = self.instances.get(instance_id)
        if v is not None:
            v.suspect_until = self.clock.now() + seconds
            self._changed.add(instance_id)

    def mark_gone(self, instance_id: str, why: str) -> None:
        """Declare an instance dead now (NATS: no responders on its subjects); a newer snapshot revives it."""
        v = self.instances.get(instance_id)
        if v is not None and not v.gone:
            v.gone = why
            self._changed.add(instance_id)

    def is_silent(self, view: InstanceView) -> bool:
        """Suspect because of silence (past the miss limit) and not yet known dead."""
        return self.alive(view) and self.silence(view) > self.miss_limit_of(view)

    def silent(self) -> list[str]:
        """Instances suspect because of silence and not yet known dead: the ones worth probing."""
        return [i for i, v in self.instances.items() if self.is_silent(v)]

    def sweep(self) -> list[tuple[str, str, str, str]]:
        """State changes since the last sweep as (id, old, new, why); mutates the remembered states."""
        out = []
        for iid, v in self.instances.items():
            new = self.state(v)
            old = self._reported.get(iid, "new")
            if new != old:
                self._reported[iid] = new
                out.append((iid, old, new, self.why(v)))
        return out

    def candidates(self, model: str) -> list[InstanceView]:
        return [v for v in self.instances.values() if v.serves(model) and self.healthy(v)]

    def models(self) -> dict[str, int]:
        """Models served by at least one healthy instance -> their smallest max context."""
        out: dict[str, int] = {}
        for v in self.instances.values():
            if not self.healthy(v):
                continue
            for m in v.snapshot.models:
                if m.loaded or v.snapshot.pool == pb.POOL_COLD:  # a cold instance opens any catalog model
                    out[m.model] = min(out[m.model], m.max_context) if m.model in out else m.max_context
        return out

    def known_model(self, model: str) -> bool:
        """True if any instance (healthy or not) has ever reported the model."""
        return any(m.model == model for v in self.instances.values() for m in v.snapshot.models)
