"""The cold engine's switch policy: which model is active, and which of its queued calls join its shell.

Design NOTE. ``ColdEngine.step`` is one loop (intake -> the policy's turn -> one shell step -> bookkeeping ->
staging) and the policy is a part it is composed with, not a subclass: a :class:`SwitchPolicy` is bound to its
engine once (``bind``) and then, at every step, returns a typed :class:`Turn` -- run no shell step, or admit
every queued call of the active model, or admit exactly these -- after carrying out any switch it decided
through the engine's ``run_switch``. Two policies:

* :class:`IdleSwitching` (``slot_scheduler: false``): ``substrate.policy.IdleSwitchRule`` -- switch only away
  from a model with no work; every queued call of the active model joins at once.
* ``cold.slotted.SlotSwitching`` (the default): the slot scheduler of ``slots/`` (rounds, SP, holds) or, with
  ``token_deadlines``, ``slots/deadlines.py``, through the one slot driver (``cold/driver.py``).

The other hooks let a policy measure and account: ``admitted`` (a queued call joins the shell),
``step_shell`` (how the shell steps: the slot policy times it into its cost model), ``finished`` (a call's
final output), ``refresh`` (step-boundary gauges for ``stats()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from services.engine.api import SlotStats
from services.engine.substrate.policy import IdleSwitchRule
from services.engine.types import EngineRequest, RequestOutput

if TYPE_CHECKING:
    from services.engine.cold.engine import ColdEngine
    from services.engine.executor import Engine


class Admit(Enum):
    NONE = "none"  # no shell step this turn
    ALL = "all"  # every queued call of the active model joins, then one shell step
    LISTED = "listed"  # the calls in ``Turn.ids`` join, then one shell step


@dataclass(frozen=True, slots=True)
class Turn:
    """What a switch policy's turn lets the active shell do this step (any switch is already carried out)."""

    admit: Admit
    ids: frozenset[str] = frozenset()

    @property
    def runs(self) -> bool:
        """Whether the active shell runs one step this turn."""
        return self.admit is not Admit.NONE

    def selection(self) -> frozenset[str] | None:
        """The queued calls to admit: None for all of them (``ModelQueues.take``'s convention)."""
        return None if self.admit is Admit.ALL else self.ids


NO_STEP = Turn(Admit.NONE)
ADMIT_ALL = Turn(Admit.ALL)


def admit_only(ids) -> Turn:
    """Admit exactly ``ids`` (possibly none: the shell still steps its running calls)."""
    return Turn(Admit.LISTED, frozenset(ids))


class SwitchPolicy(Protocol):
    """A cold engine's switch policy (``IdleSwitching``, ``cold.slotted.SlotSwitching``)."""

    staging: bool  # the engine's D2D staging default under this policy (a config value overrides it)

    def bind(self, engine: ColdEngine) -> None:
        """Attach to the engine it drives (once, before the engine's first switch)."""
        ...

    def turn(self) -> Turn:
        """Decide (and carry out any switch through ``engine.run_switch``); what the active shell does now."""
        ...

    def admitted(self, req: EngineRequest) -> None: ...

    def step_shell(self, eng: Engine) -> list[RequestOutput]: ...

    def finished(self, out: RequestOutput) -> None: ...

    def refresh(self) -> None:
        """Executor thread, at step boundaries: the gauges ``slot_stats`` reports."""
        ...

    def slot_stats(self) -> SlotStats | None: ...

    def idle_wait_s(self) -> float:
        """How long the step loop may sleep with nothing to run (a slot held for expected returns)."""
        ...

    def take_round_summaries(self) -> list: ...

    def first_prefill_tokens(self, model: str) -> int:
        """Tokens the first forward after a switch to ``model`` computes (the streaming hot-swap's k*)."""
        ...


class IdleSwitching:
    """The idle switch rule (``substrate.policy.IdleSwitchRule``): switch when the active model has no work and
    another has queued calls (or was requested); every queued call of the active model joins its shell."""

    staging = True

    def __init__(self, rule: IdleSwitchRule | None = None) -> None:
        self.rule = rule or IdleSwitchRule()
        self.ce: ColdEngine | None = None

    def bind(self, engine: ColdEngine) -> None:
        self.ce = engine

    def turn(self) -> Turn:
        """Switch when the rule says so, then hand every queued call of the active model to its shell.
        Mutates: the active model (via ``run_switch``)."""
        ce = self.ce
        assert ce is not None
        target = self.rule.decide(ce.engine_view(), ce.clock())
        if target is not None and target != ce.active:
            ce.run_switch(target, "requested" if target == ce.requested else "queued")
        return ADMIT_ALL

    def admitted(self, req: EngineRequest) -> None:
        """Nothing to account."""

    def step_shell(self, eng: Engine) -> list[RequestOutput]:
        return eng.step() if eng.has_unfinished() else []

    def finished(self, out: RequestOutput) -> None:
        """Nothing to account."""

    def refresh(self) -> None:
        """No gauges of its own."""

    def slot_stats(self) -> SlotStats | None:
        return None  # no rounds

    def idle_wait_s(self) -> float:
        return 0.0  # never holds a slot

    def take_round_summaries(self) -> list:
        return []  # no rounds

    def first_prefill_tokens(self, model: str) -> int:
        """Every waiting call's prompt, at most one step's token budget. Pure read."""
        ce = self.ce
        assert ce is not None
        return ce.one_step_tokens(model, sum(len(r.prompt_token_ids) for r in ce.queues.waiting(model)))
