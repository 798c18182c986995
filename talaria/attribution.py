"""Call-level time attribution: where one call's latency went, shared by engine, router, telemetry
and bench.

Design NOTE. Attribution is *recorded*, not estimated. The engine gives every call a :class:`PhaseClock`
started when the call reaches the engine; each mechanism that changes what the call is waiting for moves it
to another :class:`Phase` (intake queue -> round wait / switch wait in a cold pool -> engine queue -> KV
restore -> prefill -> decode, preempted in between), and the clock charges the time since the previous move
to the phase it leaves. Every instant between arrival and end is charged to exactly one phase, so the engine
components sum to the engine's latency by construction; the engine reports the gap between that and the
latency its service measured (publishing the last chunk) as ``other_s``. The router adds the two components
it owns (its overload queue and placement), sets ``total_s`` to the latency it measured (HTTP arrival ->
end) and puts everything no component covers (NATS transit, encoding, client streaming) into ``other_s``.
Talaria §5 reports SCT; this split is what lets one SCT difference between two configurations be explained.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from talaria.v1 import common_pb2 as cpb


class Phase(str, Enum):
    ENGINE_QUEUE = "engine_queue_s"
    ROUND_WAIT = "round_wait_s"
    SWITCH_WAIT = "switch_wait_s"
    RESTORE = "restore_s"
    PREFILL = "prefill_s"
    DECODE = "decode_s"
    PREEMPTED = "preemption_s"


@dataclass(frozen=True, slots=True)
class CallAttribution:
    """Seconds of one call (or a sum of calls) per component; field names = the wire's ``CallAttribution``."""

    router_queue_s: float = 0.0
    placement_s: float = 0.0
    engine_queue_s: float = 0.0
    round_wait_s: float = 0.0
    switch_wait_s: float = 0.0
    restore_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    preemption_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0

    @property
    def components(self) -> dict[str, float]:
        """Every component (``other_s`` included), without ``total_s``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "total_s"}

    @property
    def engine_s(self) -> float:
        """Seconds of the engine phases (what a PhaseClock charged)."""
        return sum(float(getattr(self, p.value)) for p in Phase)

    def explained(self, total_s: float, **extra: float) -> CallAttribution:
        """This attribution with ``extra`` components set (e.g. the router's), ``total_s`` = the measured
        latency and ``other_s`` = the residual the named components leave (never negative: a component
        measured on another clock that overshoots the total shows up as ``other_s`` = 0, not as a debt)."""
        a = replace(self, **extra, other_s=0.0)
        named = sum(v for k, v in a.components.items() if k != "other_s")
        return replace(a, total_s=total_s, other_s=max(0.0, total_s - named))

    def __add__(self, o: CallAttribution) -> CallAttribution:
        return CallAttribution(**{f.name: getattr(self, f.name) + getattr(o, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---------------------------------------------------------------- wire
    def to_proto(self) -> cpb.CallAttribution:
        from talaria.v1 import common_pb2 as cpb

        return cpb.CallAttribution(**self.as_dict())

    @classmethod
    def from_proto(cls, m: cpb.CallAttribution) -> CallAttribution:
        return cls(**{f.name: float(getattr(m, f.name)) for f in fields(cls)})


def total(items: Iterable[CallAttribution]) -> CallAttribution:
    """The sum of several calls' attributions (a session's, a configuration's)."""
    out = CallAttribution()
    for a in items:
        out = out + a
    return out


def attribution_clock() -> float:
    """The clock every phase clock reads: ``time.monotonic``, the time base of the engine service's call
    arrival (``EngineRequest.arrival_time``). Attribution measures real seconds; an engine's *injected* policy
    clock (virtual in tests) is never read for it, so measuring changes no decision."""
    return time.monotonic()


def phase_start(arrival: float, policy_clock: Callable[[], float], now: float) -> float:
    """Where a call's phase clock starts: its arrival at the engine when that is on the attribution clock's
    time base (the policy clock is ``time.monotonic``, as in production), else ``now`` (intake)."""
    if policy_clock is time.monotonic and 0 < arrival <= now:
        return arrival
    return now


class PhaseClock:
    """One call's phase clock (the engine's side). ``enter`` moves it to a phase, charging the time since the
    previous move to the phase it leaves; ``stop`` closes it and gives the attribution. Not thread-safe: the
    executor thread moves it (the cold engine's queues and the shell's step both run there)."""

    __slots__ = ("phase", "since", "spent", "stopped")

    def __init__(self, start: float, phase: Phase = Phase.ENGINE_QUEUE) -> None:
        self.phase = phase
        self.since = start
        self.spent: dict[Phase, float] = {}
        self.stopped = False

    def enter(self, phase: Phase, now: float) -> None:
        """Mutates: the clock (charges ``now - since`` to the current phase). A stopped clock ignores moves."""
        if self.stopped or phase is self.phase:
            return
        self._charge(now)
        self.phase = phase

    def _charge(self, now: float) -> None:
        dt = max(0.0, now - self.since)
        self.spent[self.phase] = self.spent.get(self.phase, 0.0) + dt
        self.since = max(self.since, now)

    def stop(self, now: float) -> CallAttribution:
        """Close the clock at ``now`` (idempotent: a second stop returns the same split)."""
        if not self.stopped:
            self._charge(now)
            self.stopped = True
        return self.attribution()

    def attribution(self) -> CallAttribution:
        spent = {p.value: s for p, s in self.spent.items()}
        return CallAttribution(**spent, total_s=sum(spent.values()))


def enter_all(clocks: Iterable[PhaseClock | None], phase: Phase, now: Callable[[], float] | float) -> None:
    """Move every clock to ``phase`` at one instant (e.g. all queued calls when a switch starts)."""
    t = now() if callable(now) else now
    for c in clocks:
        if c is not None:
            c.enter(phase, t)
