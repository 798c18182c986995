"""Plain data at the boundary of the slot scheduler (no torch, no I/O, no clocks).

The executor describes the instance in an :class:`InstanceView`; the scheduler answers with a
:class:`Decision` whose reasons, SP verdicts and closed round summary are data (logged, published,
asserted in tests). Times are seconds on whatever clock the caller injects (virtual in tests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from services.engine.kv.session_residency import KvLocation


class Phase(str, Enum):
    """Phases of a slot, ``P → D1 → (SP → D)* → Dfin`` (Talaria §3.4, Fig. 4), plus the switch and idle."""

    P = "P"
    D1 = "D1"
    SP = "SP"
    D = "D"
    DFIN = "Dfin"
    HOLD = "hold"  # the slot held open, idle, for returns expected soon (hold.py)
    SWITCH = "switch"
    IDLE = "idle"


SLOT_PHASES = (Phase.P, Phase.D1, Phase.SP, Phase.D, Phase.DFIN, Phase.HOLD)


@dataclass(frozen=True, slots=True)
class CallView:
    """A queued call (not yet handed to the model's batch)."""

    request_id: str
    model: str
    arrival: float
    prompt_tokens: int
    max_tokens: int = 16
    session_id: str = ""
    prefix_tokens: int = 0  # tokens of the prompt this instance can reuse (device or host copy)
    prefix_state: KvLocation = KvLocation.MISSING
    continuation: bool = False  # the session had an earlier call on this instance


@dataclass(frozen=True, slots=True)
class ReturnView:
    """A session of this model whose call ended here and whose return the router expects (its lease's retention
    hint, ``kv/retention.py``): not queued, not running. Used to hold the slot open for it (``hold.py``)."""

    session_id: str
    elapsed_s: float  # since its last call here ended
    gap_mu: float  # log-normal return gap (services/router/return_gap.py)
    gap_sigma: float  # 0: a fixed-tau lease (nothing known but the window)
    window_s: float  # the lease window, from the call's end (> 0)
    tokens: int = 0  # completion tokens of its last call: the return's predicted decode
    new_tokens: int = 0  # its last call's uncached prompt tokens: the return's predicted prefill
    context: int = 0  # its context after the last call (where the return's prefill lands)


@dataclass(frozen=True, slots=True)
class ModelView:
    model: str
    running: int = 0  # calls handed to the model's batch and not finished (prefilling or decoding)
    prefilling: int = 0  # of those, calls whose prefill has not completed yet
    max_remaining_decode: int = 0  # most decode iterations any running call may still need
    queued: tuple[CallView, ...] = ()  # FCFS
    returns: tuple[ReturnView, ...] = ()  # sessions expected back soon (hold.py); empty without leases

    @property
    def has_work(self) -> bool:
        return self.running > 0 or bool(self.queued)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """Snapshot of one instance, taken at a decode boundary."""

    active: str | None
    models: tuple[ModelView, ...]  # loaded models, in rotation order
    free_kv_tokens: int | None = None  # device KV tokens free for admissions (None: not bounded)
    staged_fraction: dict[str, float] = field(default_factory=dict)  # model -> fraction of its weights staged
    can_park: bool = False  # the executor can move in-flight calls out at a switch (else Dfin drains them)

    def model(self, name: str) -> ModelView:
        for m in self.models:
            if m.model == name:
                return m
        return ModelView(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.model for m in self.models)


@dataclass(frozen=True, slots=True)
class SpVerdict:
    """What the scheduler decided about one call at an SP opportunity, and why."""

    request_id: str
    admitted: bool
    reason: str  # admitted | sp_off | wrong_model | new_session | arrived_before_p | prefix_missing |
    #              host_kv_off | budget | batch_limit | memory | no_gain
    cost_s: float = 0.0
    benefit_s: float = 0.0  # predicted round wait the call saves by SP now (admission.SpGain)
    harm_s: float = 0.0  # predicted delay SP now imposes on other models' waiting calls


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """Budgets of one round (Talaria §3.4, Eq. 3-5), computed when the round opens."""

    bound_s: float  # γ·T_TTFT (Eq. 5)
    models: tuple[str, ...]
    decode_step_s: dict[str, float]  # profiled t_D,m
    reserved_iters: dict[str, int]  # d_m (Eq. 4)
    decode_reserved_s: float  # Σ d_m·t_D,m
    switch_s: float  # Σ predicted S_{m→m'}
    prefill_pool_s: float  # what prefill and SP share: bound − decode − switch (may be < 0)
    queued_prefill_s: float  # predicted cost of the prefill waiting when the round opened
    predicted_s: float  # Eq. 3 with the queued prefill: decode + switch + prefill
    shortfall_s: float  # max(0, predicted − bound)
    infeasible: tuple[str, ...]  # models with t_D,m ≥ T_TPOT: Eq. 4 has no solution

    @property
    def deadline_risk(self) -> bool:
        return self.shortfall_s > 0 or bool(self.infeasible)


@dataclass(frozen=True, slots=True)
class SlotSummary:
    model: str
    wall_s: float
    switch_in_s: float  # the switch that opened this slot (0 without one)
    switch_path: str  # "" without a switch
    budget_s: float  # d_m·t_D,m + prefill share
    reserved_iters: int
    decode_iters: int
    phase_s: dict[str, float]
    phase_count: dict[str, int]
    p_admitted: int
    p_deferred: int
    sp_admitted: int
    sp_deferred: int
    overrun_s: float  # time spent past the slot budget (Dfin draining calls it could not park)


@dataclass(frozen=True, slots=True)
class RoundSummary:
    """Published on ``<ns>.engine.<id>.round``: ``wall = active + switch`` (Talaria §5.6, Fig. 13)."""

    index: int
    started: float
    wall_s: float
    active_s: float
    switch_s: float
    bound_s: float
    predicted_s: float
    shortfall_s: float  # planned shortfall + prefill deferred by P for lack of budget + slot overruns
    deadline_risk: bool
    infeasible: tuple[str, ...]
    phase_s: dict[str, float]
    phase_count: dict[str, int]
    sp_admitted: int
    sp_deferred: int
    sp_ineligible: dict[str, int]
    p_admitted: int
    p_deferred: int
    switch_paths: tuple[str, ...]
    slots: tuple[SlotSummary, ...]
    flags: dict[str, bool]  # sp / host_kv / d2d_staging in force
    # SP that cannot lose: why eligible continuations were deferred (budget | batch_limit | memory |
    # no_gain; one count per call per slot, like sp_deferred) and the predicted round wait the admitted SP
    # calls saved vs the delay they imposed on other models' waiting calls (admission.SpGain)
    sp_deferred_reasons: dict[str, int] = field(default_factory=dict)
    sp_benefit_s: float = 0.0
    sp_harm_s: float = 0.0
    # slots held open for expected returns (hold.py): holds decided, and their predicted gain / harm (the hold
    # time itself is ``phase_s["hold"]``)
    holds: int = 0
    hold_gain_s: float = 0.0
    hold_harm_s: float = 0.0
    # per-token deadlines (Aegaeon): attainment and inter-token gap distribution over the round
    # (a ``deadlines.DeadlineStats``; None when no tracker is attached)
    deadlines: Any = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Decision:
    """One scheduling decision. The executor carries out, in order: ``switch_to`` (and then asks again),
    or hand ``admit`` to the active model's batch and run one step when ``run_step``; ``idle``: nothing
    to do until new work arrives."""

    phase: Phase
    reason: str
    model: str | None = None
    switch_to: str | None = None
    switch_path: str = ""  # expected path of the switch (full_staged | partial | host_only)
    admit: tuple[str, ...] = ()
    run_step: bool = False
    verdicts: tuple[SpVerdict, ...] = ()
    closed_round: RoundSummary | None = None
    hold_s: float = 0.0  # Phase.HOLD: nothing to run; ask again after at most this long, or when a call arrives

    @property
    def idle(self) -> bool:
        return self.phase is Phase.IDLE
