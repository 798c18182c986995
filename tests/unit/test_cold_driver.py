"""The cold engine's parts on their own: the slot driver's turn (``cold/driver.py``) against a scripted scheduler
and a recording port, and the per-model queues (``cold/queues.py``). No torch, no model."""

from __future__ import annotations

import pytest

from services.engine.api import DuplicateRequestError
from services.engine.cold.driver import SlotDriver
from services.engine.cold.policy import ADMIT_ALL, NO_STEP, Admit, admit_only
from services.engine.cold.queues import ModelQueues
from services.engine.slots.types import Decision, InstanceView, Phase
from services.engine.types import EngineRequest, SamplingParams


class Scripted:
    """A scheduler answering the given decisions in order; records the times it was asked at."""

    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)
        self.asked: list[float] = []

    def decide(self, view: InstanceView, now: float) -> Decision:
        self.asked.append(now)
        return self.decisions.pop(0)


class Port:
    """Records every call; a switch completes ``switch_s`` later within the call, or at an event (None)."""

    def __init__(self, switch_s: float | None) -> None:
        self.switch_s = switch_s
        self.log: list[tuple] = []

    def slot_view(self, now: float) -> InstanceView:
        self.log.append(("view", now))
        return InstanceView("a", (), None, {})

    def on_decision(self, view, d, now):
        self.log.append(("decided", d.reason))

    def switch_slot(self, target, now):
        self.log.append(("switch", target, now))
        return None if self.switch_s is None else now + self.switch_s

    def run_step(self, admit, now):
        self.log.append(("step", admit, now))

    def wait(self, d, now):
        self.log.append(("wait", d.reason, now))


def test_a_switch_done_within_the_turn_opens_the_new_slot_at_once():
    sched = Scripted(Decision(Phase.SWITCH, "slot_end", switch_to="b"), Decision(Phase.P, "open", "b", admit=("r1",), run_step=True))
    port = Port(switch_s=0.5)
    d = SlotDriver(sched, port).turn(1.0)
    assert d.reason == "open" and sched.asked == [1.0, 1.5]  # the new slot decided at the switch's end
    assert port.log == [("view", 1.0), ("decided", "slot_end"), ("switch", "b", 1.0), ("view", 1.5), ("step", ("r1",), 1.5)]


def test_a_switch_completing_later_ends_the_turn():
    sched = Scripted(Decision(Phase.SWITCH, "slot_end", switch_to="b"))
    port = Port(switch_s=None)
    drv = SlotDriver(sched, port)
    assert drv.turn(2.0).switch_to == "b" and drv.last.switch_to == "b"
    assert port.log == [("view", 2.0), ("decided", "slot_end"), ("switch", "b", 2.0)]


def test_a_step_or_a_wait_is_carried_out_once():
    port = Port(switch_s=0.1)
    drv = SlotDriver(Scripted(Decision(Phase.D, "decode", "a", run_step=True), Decision(Phase.HOLD, "hold", "a", hold_s=3.0)), port)
    drv.turn(0.0)
    drv.turn(1.0)
    assert port.log == [("view", 0.0), ("decided", "decode"), ("step", (), 0.0), ("view", 1.0), ("decided", "hold"), ("wait", "hold", 1.0)]
    assert drv.last.hold_s == 3.0


def test_the_turn_is_typed():
    assert not NO_STEP.runs and ADMIT_ALL.runs and ADMIT_ALL.selection() is None
    t = admit_only(["x", "y"])
    assert t.admit is Admit.LISTED and t.runs and t.selection() == frozenset({"x", "y"})
    assert admit_only(()).runs  # no call joins, the running ones still step


def _req(rid: str, model: str, t: float = 0.0) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=t, model=model)


def test_model_queues_intake_take_and_abort():
    q = ModelQueues(["a", "b"])
    for r in (_req("1", "a", 1.0), _req("2", "b", 2.0), _req("3", "a", 3.0)):
        q.add(r)
    with pytest.raises(DuplicateRequestError):
        q.add(_req("1", "b"))
    q.abort("2")
    q.abort("unknown")  # ignored
    new, aborts = q.take_intake()
    assert [r.request_id for r in new] == ["1", "2", "3"] and aborts == ["2"]
    assert q.take_intake() == ([], [])
    for r in new:
        q.enqueue(r)
    assert q.counts() == {"a": 2, "b": 1} and q.oldest() == {"a": 1.0, "b": 2.0} and q.total_waiting() == 3
    assert q.others_waiting("a") and q.others_waiting("b")
    assert q.remove("2").request_id == "2" and q.remove("2") is None and not q.others_waiting("a")
    assert [r.request_id for r in q.take("a", frozenset({"3"}))] == ["3"]
    assert [r.request_id for r in q.take("a", None)] == ["1"] and q.take("a", None) == []
    assert q.live_counts() == {"a": 2, "b": 1} and q.has_live()  # taken calls stay live until they finish
    for rid in ("1", "2", "3"):
        q.finish(rid)
    assert not q.has_live() and q.live_counts() == {}
