"""The slot driver: build the view, decide, carry out -- once, for every instance the slot scheduler drives.

Design NOTE. The slot scheduler (``slots/``, or ``slots/deadlines.py``) is a pure ``decide(view, now) ->
Decision``. Three mechanisms carry its decisions out: the real cold engine (``cold/slotted.py``), the
discrete-event simulator's instance (``sim/cluster.py``) and the virtual-clock test fake
(``tests/fakes/slot_executor.py``). They differ in how time passes -- the engine measures it, the simulator
schedules a completion event, the fake advances a manual clock -- but not in the turn itself, which lives here:

1. the port builds the scheduler's ``InstanceView`` (``slot_view``) and the scheduler decides;
2. the port sees the decision before anything is carried out (``on_decision``: traces, the engine's early
   write-back when a slot enters its final drain);
3. exactly one of: a switch at a slot boundary (``switch_slot``), or the admitted calls join the active model's
   batch for one step (``run_step``), or nothing runs (``wait``: idle, or a slot held for returns).

A switch that completes within the call (the engine's: it blocks until the five phases are done) returns the
time it ended; the new slot then opens in the same turn -- the scheduler decides again at once and its step,
if any, runs. A switch that completes later (the simulator's event, the fake's clock) returns None, and the
next turn asks again. Measurements (``observe_step`` / ``observe_switch``) stay with the ports: only they
know when a step's or a switch's time is known.

Pure: no torch, no threads, no clock of its own.
"""

from __future__ import annotations

from typing import Protocol

from services.engine.slots.types import Decision, InstanceView


class SlotScheduling(Protocol):
    """The scheduler side: ``SlotScheduler`` or ``DeadlineScheduler`` (``slots/deadlines.make_scheduler``)."""

    def decide(self, view: InstanceView, now: float) -> Decision: ...


class SlotPort(Protocol):
    """What the slot driver needs from an instance (the real cold engine, the simulator's, the test fake)."""

    def slot_view(self, now: float) -> InstanceView:
        """The scheduler's view of the instance now (queued calls, the active batch, free KV, staged fractions)."""
        ...

    def on_decision(self, view: InstanceView, decision: Decision, now: float) -> None:
        """Seen before the decision is carried out (the first decision of a turn only)."""
        ...

    def switch_slot(self, target: str, now: float) -> float | None:
        """Carry out a slot switch to ``target``. Returns the time it ended if it completed within the call (the
        new slot opens in this turn), else None (it completes later; the next turn asks again)."""
        ...

    def run_step(self, admit: tuple[str, ...], now: float) -> None:
        """The queued calls ``admit`` (of the active model) join its batch, and the batch runs one step."""
        ...

    def wait(self, decision: Decision, now: float) -> None:
        """Nothing runs: the scheduler is idle, or holds the slot for expected returns (``decision.hold_s``)."""
        ...


class SlotDriver:
    """One turn of a slot-scheduled instance. ``last``: the decision of the latest turn (after a switch that
    completed in the turn, the new slot's)."""

    def __init__(self, scheduler: SlotScheduling, port: SlotPort) -> None:
        self.scheduler = scheduler
        self.port = port
        self.last: Decision | None = None

    def turn(self, now: float) -> Decision:
        """Build the view, decide, carry out. Mutates: the instance (through its port) and the scheduler."""
        view = self.port.slot_view(now)
        d = self.scheduler.decide(view, now)
        self.last = d
        self.port.on_decision(view, d, now)
        if d.switch_to is not None:
            ended = self.port.switch_slot(d.switch_to, now)
            if ended is None:
                return d
            d = self.scheduler.decide(self.port.slot_view(ended), ended)  # the new slot opens (P)
            self.last = d
            if d.run_step:
                self.port.run_step(d.admit, ended)
            return d
        if d.run_step:
            self.port.run_step(d.admit, now)
        else:
            self.port.wait(d, now)
        return d
