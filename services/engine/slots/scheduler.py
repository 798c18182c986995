"""The round/slot scheduler of a cold-pool instance with session-prefill (SP) admission (Talaria §3.4).

Design NOTE. ``decide(view, now)`` is called at every decode boundary (between two executor steps, and
right after a switch) with a snapshot of the instance and the injected clock's time; it returns one
:class:`Decision` and keeps only policy state (the open round and slot, time accounting, the cost model).
The executor carries the decision out and reports what it measured (``observe_step``/``observe_switch``),
which refreshes the EWMA cost profile. Nothing here touches torch, memory, threads or I/O, so the same code
runs in the cold engine, in unit tests and in the simulator (the test fake ``tests/fakes/slot_executor.py``).

Rounds and slots. Each model with work gets one slot per round, in rotation order; the instance switches
only at slot boundaries. A slot is ``P → D1 → (SP → D)* → Dfin``:

* **P** at slot open admits the calls waiting then, FCFS within the slot's prefill share (at least one;
  the rest is deferred and reported as shortfall);
* **D1 / D**: decode iterations; every decode boundary with SP budget left is an SP opportunity;
* **SP** admits the bounded subset of eligible continuations that fits the budget left after protected
  decode and whose predicted round wait saved exceeds the delay it imposes on other models' waiting calls
  (admission.py, "SP that cannot lose"; ``_sp_gain``); a call that does not fit or does not pay waits for a
  later opportunity or the next slot;
* **Dfin**: no more prefill; in-flight calls drain; then the slot closes and the next model's slot opens.

A slot closes early when its model has nothing in flight and another model has work. When the slot's
budget runs out and no other model has work, the round rolls over without a switch (a new P admits what
waits). A hot instance is the same scheduler with one model and no end of slot (``endless``): rounds roll
over, decode never stops, P reopens every round for new sessions.

Budgets (budget.py): d_m protected decode iterations per model (Eq. 4), the round bounded by γ·T_TTFT
(Eq. 5); prefill and SP share only the remainder (the slot's share is what is left of the round's pool
divided among the slots still to run). Shortfall and infeasible targets are reported in the round summary
and in ``status()`` (heartbeat), never hidden (§3.4 "Best-effort prefill does not mean silently deferring").

Limitation (stated, not hidden): the executor cannot park an in-flight sequence across a switch, so Dfin
drains every in-flight call; time past the slot budget is reported as the slot's ``overrun_s``. An executor
that can park says so with ``InstanceView.can_park`` (the simulator's model of the paper's engine, §5.5): then
the slot closes when its budget is spent and the calls still decoding resume in the model's next slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from talaria.switch_path import SwitchPath

from .admission import SpGain, SpLimits, select_p, select_sp, sp_ineligible_reason
from .budget import plan_round, reserved_iterations
from .hold import p_within, plan_hold
from .costs import CostModel, MeasuredCosts, expected_path
from .types import SLOT_PHASES, CallView, Decision, InstanceView, ModelView, Phase, RoundPlan, RoundSummary, SlotSummary, SpVerdict


@dataclass(frozen=True, slots=True)
class SlotPolicy:
    """Knobs (Talaria Appendix E) and the ablation switches; all three switches off = Round-only."""

    ttft_s: float = 2.0  # T_TTFT
    tpot_s: float = 0.1  # T_TPOT
    gamma: float = 0.8  # admission margin γ < 1 (Eq. 5)
    sp: bool = True
    host_kv: bool = True
    d2d_staging: bool = True
    sp_max_batch: int = 8
    sp_max_tokens: int = 4096
    endless: bool = False  # one model, no end of slot: the simulator's hot instances (sim/); the engine's hot pool runs executor.Engine
    sp_gain_check: bool = True  # SP admits a call only when its round wait saved exceeds the delay to others
    sp_new_sessions: bool = False  # SP also admits calls without a usable prefix (new sessions), by the same checks (admission.py; off: see there)
    return_hold: bool = True  # hold an idle slot open for returns expected soon when that pays (hold.py; needs sp)
    token_deadlines: bool = False  # the executor uses deadlines.DeadlineScheduler (Aegaeon) instead of rounds

    def __post_init__(self) -> None:
        if not 0 < self.gamma < 1:
            raise ValueError("gamma must be in (0, 1)")
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("T_TTFT and T_TPOT must be positive")
        if self.sp_max_batch < 1 or self.sp_max_tokens < 1:
            raise ValueError("SP batch bounds must be positive")

    @classmethod
    def round_only(cls, **kw) -> "SlotPolicy":
        return cls(sp=False, host_kv=False, d2d_staging=False, return_hold=False, **kw)

    @property
    def flags(self) -> dict[str, bool]:
        return {"sp": self.sp, "host_kv": self.host_kv, "d2d_staging": self.d2d_staging, "return_hold": self.sp and self.return_hold}


@dataclass(slots=True)
class _Slot:
    model: str
    opened: float
    budget_s: float
    share_s: float
    reserved_iters: int
    t_decode: float
    switch_in_s: float = 0.0
    switch_path: str = ""
    phase: Phase = Phase.P
    dfin: bool = False
    decode_iters: int = 0
    overrun_s: float = 0.0
    p_admitted: int = 0
    p_deferred: int = 0
    sp_admitted: int = 0
    sp_deferred: int = 0
    phase_s: dict[str, float] = field(default_factory=lambda: {p.value: 0.0 for p in SLOT_PHASES})
    phase_count: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in SLOT_PHASES})
    deferred_seen: set[str] = field(default_factory=set)
    ineligible_seen: set[str] = field(default_factory=set)

    def enter(self, phase: Phase) -> None:
        if phase is not self.phase or phase is Phase.SP or self.phase_count[phase.value] == 0:
            self.phase_count[phase.value] += 1
        self.phase = phase

    def summary(self, now: float) -> SlotSummary:
        return SlotSummary(
            model=self.model, wall_s=now - self.opened, switch_in_s=self.switch_in_s, switch_path=self.switch_path,
            budget_s=self.budget_s, reserved_iters=self.reserved_iters, decode_iters=self.decode_iters,
            phase_s=dict(self.phase_s), phase_count=dict(self.phase_count), p_admitted=self.p_admitted,
            p_deferred=self.p_deferred, sp_admitted=self.sp_admitted, sp_deferred=self.sp_deferred, overrun_s=self.overrun_s,
        )


@dataclass(slots=True)
class _Round:
    index: int
    started: float
    plan: RoundPlan
    order: list[str]
    served: list[str] = field(default_factory=list)
    slots: list[SlotSummary] = field(default_factory=list)
    active_s: float = 0.0
    switch_s: float = 0.0
    prefill_used_s: float = 0.0
    p_deferred_s: float = 0.0
    switch_paths: list[str] = field(default_factory=list)
    sp_ineligible: dict[str, int] = field(default_factory=dict)
    sp_deferred_reasons: dict[str, int] = field(default_factory=dict)
    sp_benefit_s: float = 0.0
    sp_harm_s: float = 0.0
    holds: int = 0
    hold_gain_s: float = 0.0
    hold_harm_s: float = 0.0


class SlotScheduler(MeasuredCosts):
    def __init__(self, policy: SlotPolicy | None = None, costs: CostModel | None = None, max_summaries: int = 64) -> None:
        self.policy = policy or SlotPolicy()
        self.costs = costs or CostModel()
        self.limits = SpLimits(self.policy.sp_max_batch, self.policy.sp_max_tokens)
        self._round: _Round | None = None
        self._slot: _Slot | None = None
        self._switching: tuple[str, str] | None = None  # (target, expected path) of the decided switch
        self._switch_dt = 0.0
        self._observed_path = ""
        self._last_t: float | None = None
        self._last_kind: Phase = Phase.IDLE
        self._last_served: str | None = None
        self._seen: tuple[InstanceView, float] | None = None  # the last decision's view and time (slot_waits)
        self._rounds = 0
        self.summaries: deque[RoundSummary] = deque(maxlen=max_summaries)
        self._unpublished: list[RoundSummary] = []
        self.tracker = None  # a deadlines.DeadlineTracker the executor attaches: per-round token deadline stats
        self.totals = {"rounds": 0, "deadline_risk_rounds": 0, "sp_admitted": 0, "sp_deferred": 0, "sp_no_gain": 0, "p_deferred": 0, "switches": 0, "holds": 0}

    # ================================================================== public API
    def decide(self, view: InstanceView, now: float) -> Decision:
        self._account(now)
        self._seen = (view, now)
        d = self._decide(view, now)
        self._last_kind = d.phase
        if d.run_step and self._slot is not None:
            mv = view.model(self._slot.model)
            if mv.running - mv.prefilling > 0:
                self._slot.decode_iters += 1
        return d

    def observe_switch(self, path: str, seconds: float) -> None:
        self.costs.observe_switch(path, seconds)
        self._observed_path = path

    def take_summaries(self) -> list[RoundSummary]:
        out, self._unpublished = self._unpublished, []
        return out

    def finish(self, now: float) -> RoundSummary | None:
        """The end of a run (the simulator's, a test's): close the open round now, so its summary becomes
        takeable. Mutates: the round, summaries, counters."""
        self._account(now)
        return self._close_round(now)

    def status(self, now: float, idle: bool = False) -> dict:
        """Heartbeat fields: the open round's remaining time, deadline risk and shortfall (Talaria §3.4), and
        the models' slot waits (``idle``: the executor has no call queued or running)."""
        r = self._round
        last = self.summaries[-1] if self.summaries else None
        out = dict(self.totals)
        out.update({
            "round_index": r.index if r else (last.index if last else -1),
            "round_remaining_s": max(0.0, r.plan.bound_s - (r.active_s + r.switch_s)) if r else 0.0,
            "deadline_risk": bool((r and r.plan.deadline_risk) or (last and last.deadline_risk and r is None)),
            "shortfall_s": (r.plan.shortfall_s + r.p_deferred_s) if r else (last.shortfall_s if last else 0.0),
            "infeasible": list(r.plan.infeasible if r else (last.infeasible if last else ())),
            "active_model": self._slot.model if self._slot else None,
            "phase": self._last_kind.value,
            "slot_wait_s": self.slot_waits(now, idle),
        })
        return out

    def slot_waits(self, now: float, idle: bool = False) -> dict[str, float]:
        """Predicted seconds until the switch to each model of the open round can start (Eq. 1's
        wait term for a cold instance; the router adds the switch itself, priced by its path): 0 for the
        model holding the slot while the slot still admits calls mid-way (SP on, not draining, budget left),
        else the wait for its next slot (the rest of the round and the switch back: a call arriving then
        waits for it, measured ~1 s a call on the Mooncake replay, where 0 was quoted); for a model still to
        be served this round, what is left of the current slot plus, per slot before it, one switch
        (measured, host-only) and that slot's length. A slot ends at its budget or when its model runs out of
        work (``_decide`` closes it then, unless it holds for returns), so each slot's length is the smaller of its budget (protected decode plus its share of the prefill
        pool) and the work the last decision's view showed for its model, less the time since that view. A
        model outside the round waits for the whole rest of the round. Empty when no slot is open, or when the
        executor says it is ``idle`` (no call queued or running: the open slot is a leftover the next decision
        closes, so the instance switches at once). Pure read."""
        s, r = self._slot, self._round
        if s is None or r is None or idle:
            return {}
        switch = self.costs.switch(SwitchPath.HOST_ONLY)
        view, seen_at = self._seen if self._seen is not None else (None, now)
        since = max(0.0, now - seen_at)
        left = max(0.0, s.budget_s - (now - s.opened))
        admits = self.policy.sp and not s.dfin and left > 0
        if view is not None and s.phase is not Phase.HOLD:  # a hold keeps the slot open past its work (hold.py)
            left = min(left, max(0.0, self._work_s(view.model(s.model)) - since))
        todo = [m for m in r.order if m not in r.served and m != s.model]
        share = max(0.0, r.plan.prefill_pool_s - r.prefill_used_s) / max(1, len(todo) + 1)
        out = {s.model: 0.0}
        for m in todo:
            out[m] = left
            slot = r.plan.reserved_iters.get(m, 0) * r.plan.decode_step_s.get(m, 0.0) + share
            if view is not None:
                slot = min(slot, self._work_s(view.model(m)))
            left += switch + slot
        out[""] = left  # any other model: after the round's remaining slots
        if not admits:  # the holding model's next slot: after the others', and the switch back
            out[s.model] = left + switch if todo else left
        return out

    def _work_s(self, mv: ModelView, max_iters: int | None = None) -> float:
        """Predicted seconds of the work a view shows for one model: its queued calls' prefill (and restore)
        and the longest decode among its running and queued calls (``max_tokens``: an upper bound; at most
        ``max_iters`` iterations when given), at the batch those calls make. Pure read of the cost model."""
        if not mv.has_work:
            return 0.0
        host_kv = self.policy.host_kv
        prefill = sum(self.costs.call(c, host_kv).seconds for c in mv.queued)
        iters = max([mv.max_remaining_decode, *(c.max_tokens for c in mv.queued)])
        if max_iters is not None:
            iters = min(iters, max_iters)
        return prefill + iters * self.costs.decode_step_at(mv.model, mv.running + len(mv.queued))

    # ================================================================== time accounting
    def _account(self, now: float) -> None:
        if self._last_t is None:
            self._last_t = now
            return
        dt = max(0.0, now - self._last_t)
        self._last_t = now
        kind, r, s = self._last_kind, self._round, self._slot
        if r is None or dt == 0.0:
            return
        if kind is Phase.SWITCH:
            r.switch_s += dt
            self._switch_dt = dt
        elif kind in SLOT_PHASES and s is not None:
            s.phase_s[kind.value] += dt
            r.active_s += dt
            if kind in (Phase.P, Phase.SP):
                r.prefill_used_s += dt
            past = (now - s.opened) - s.budget_s
            if past > 0:
                s.overrun_s += min(dt, past)

    # ================================================================== the decision
    def _decide(self, view: InstanceView, now: float) -> Decision:
        pol = self.policy
        if not any(m.has_work for m in view.models):
            closed = self._close_round(now)
            return Decision(Phase.IDLE, "no_work", closed_round=closed)
        if self._switching is not None:
            target, path = self._switching
            self._switching = None
            if view.active == target and self._round is not None:
                return self._start_slot(view, target, now, self._switch_dt, self._observed_path or path, None)
        if self._round is None:
            self._open_round(view, now)
        s = self._slot
        if s is None:
            return self._next_slot(view, now, None)
        if s.model != view.active:  # switched behind our back: close and re-plan
            self._close_slot(now)
            return self._next_slot(view, now, None)
        mv = view.model(s.model)
        if mv.prefilling > 0:
            return Decision(s.phase, "prefill_in_progress", s.model, run_step=True)
        # ---- a decode boundary
        if s.phase is Phase.P:
            s.enter(Phase.D1)
        elif s.phase is Phase.SP or (s.phase is Phase.HOLD and mv.running > 0):
            s.enter(Phase.D)
        others = [] if pol.endless else [m for m in view.models if m.model != s.model and m.has_work]
        left = s.budget_s - (now - s.opened)
        verdicts: tuple[SpVerdict, ...] = ()
        if not s.dfin:
            if left <= 0:
                if not others:
                    return self._roll(view, now, "slot_budget_exhausted")
                s.dfin = True
                s.enter(Phase.DFIN)
            else:
                protected_iters = max(0, min(s.reserved_iters - s.decode_iters, mv.max_remaining_decode))
                sp_budget = left - protected_iters * s.t_decode
                if pol.sp:
                    drain = None if view.can_park else max(protected_iters, mv.max_remaining_decode)
                    verdicts = self._sp_opportunity(view, mv, s, sp_budget, drain)
                    admit = tuple(v.request_id for v in verdicts if v.admitted)
                    if admit:
                        s.enter(Phase.SP)
                        return Decision(Phase.SP, "sp_admit", s.model, admit=admit, run_step=True, verdicts=verdicts)
                if sp_budget <= 0 and others:
                    s.dfin = True
                    s.enter(Phase.DFIN)
        if mv.running > 0:
            if view.can_park and s.dfin and left <= 0 and others:
                # an executor that can park (the paper's, §5.5): the slot closes at its budget and the calls
                # still decoding are parked at the switch, resuming in this model's next slot (its P phase)
                self._close_slot(now)
                return self._next_slot(view, now, None, verdicts)
            return Decision(s.phase, "dfin_drain" if s.dfin else "decode", s.model, run_step=True, verdicts=verdicts)
        if others:
            hold = self._hold(view, mv, s, left) if pol.sp and pol.return_hold and not s.dfin else None
            if hold is not None:
                return hold
            self._close_slot(now)
            return self._next_slot(view, now, None, verdicts)
        return self._roll(view, now, "only_model_with_work", verdicts)

    def _hold(self, view: InstanceView, mv: ModelView, s: _Slot, left_s: float) -> Decision | None:
        """Hold the idle slot for its model's expected returns when that pays (hold.py), else None. Mutates
        the slot's phase and the round's hold accounting."""
        r = self._round
        if not mv.returns or r is None:
            return None
        if r.plan.shortfall_s > 0 or r.p_deferred_s > 0:  # no slack in this round: an idle second delays all its work
            return None
        g = self._sp_gain(view, mv, s, left_s)
        step, cm = self.costs.decode_step_at(s.model, 1), self.costs
        service = tuple(cm.prefill_seconds(s.model, x.new_tokens, x.context + x.new_tokens) + max(1, x.tokens) * step for x in mv.returns)
        # the hold delays more than the calls waiting for other models: other models' sessions expected back
        # while those slots would run, and this model's own queued calls SP could not take (they wait for its
        # next slot, which the hold pushes back)
        coming = sum(p_within(x, g.wait_saved_s) for m in view.models if m.model != s.model for x in m.returns) + len(mv.queued)
        plan = plan_hold(mv.returns, wait_saved_s=g.wait_saved_s, waiting_others=g.waiting_others, left_s=left_s, service_s=service,
                         arriving_others=coming)
        if plan is None:
            return None
        if s.phase is not Phase.HOLD:
            r.holds += 1
            self.totals["holds"] += 1
            r.hold_gain_s += plan.gain_s
            r.hold_harm_s += plan.harm_s
        s.enter(Phase.HOLD)
        return Decision(Phase.HOLD, "hold_for_returns", s.model, hold_s=plan.hold_s)

    # ================================================================== rounds
    def _rotation(self, view: InstanceView) -> list[str]:
        names = list(view.names)
        if not names:
            return []
        if self.policy.endless and view.active in names:
            return [view.active]
        if self._last_served in names:
            i = names.index(self._last_served) + 1
        elif view.active in names:
            i = names.index(view.active)
        else:
            i = 0
        return names[i:] + names[:i]

    def _open_round(self, view: InstanceView, now: float) -> None:
        order = [m for m in self._rotation(view) if view.model(m).has_work]
        paths, prev = [], view.active
        for m in order:
            if m != prev:
                paths.append(expected_path(view.staged_fraction.get(m), self.policy.d2d_staging))
            prev = m
        queued_s = sum(self.costs.call(c, self.policy.host_kv).seconds for m in order for c in view.model(m).queued)
        pol = self.policy
        plan = plan_round(order, costs=self.costs, ttft_s=pol.ttft_s, tpot_s=pol.tpot_s, gamma=pol.gamma, switch_paths=paths, queued_prefill_s=queued_s)
        self._round = _Round(self._rounds, now, plan, order)
        self._rounds += 1

    def _close_round(self, now: float) -> RoundSummary | None:
        r = self._round
        if r is None:
            return None
        if self._slot is not None:
            self._close_slot(now)
        self._round = None
        phase_s = {p.value: sum(sl.phase_s[p.value] for sl in r.slots) for p in SLOT_PHASES}
        phase_count = {p.value: sum(sl.phase_count[p.value] for sl in r.slots) for p in SLOT_PHASES}
        wall = r.active_s + r.switch_s
        p_def = sum(sl.p_deferred for sl in r.slots)
        shortfall = max(r.plan.shortfall_s, wall - r.plan.bound_s, r.p_deferred_s, 0.0)
        summ = RoundSummary(
            index=r.index, started=r.started, wall_s=wall, active_s=r.active_s, switch_s=r.switch_s,
            bound_s=r.plan.bound_s, predicted_s=r.plan.predicted_s, shortfall_s=shortfall,
            deadline_risk=shortfall > 0 or bool(r.plan.infeasible) or p_def > 0, infeasible=r.plan.infeasible,
            phase_s=phase_s, phase_count=phase_count,
            sp_admitted=sum(sl.sp_admitted for sl in r.slots), sp_deferred=sum(sl.sp_deferred for sl in r.slots),
            sp_ineligible=dict(r.sp_ineligible), p_admitted=sum(sl.p_admitted for sl in r.slots), p_deferred=p_def,
            switch_paths=tuple(r.switch_paths), slots=tuple(r.slots), flags=self.policy.flags,
            sp_deferred_reasons=dict(r.sp_deferred_reasons), sp_benefit_s=r.sp_benefit_s, sp_harm_s=r.sp_harm_s,
            holds=r.holds, hold_gain_s=r.hold_gain_s, hold_harm_s=r.hold_harm_s,
            deadlines=self.tracker.take_window() if self.tracker is not None else None,
        )
        t = self.totals
        t["rounds"] += 1
        t["deadline_risk_rounds"] += int(summ.deadline_risk)
        t["sp_admitted"] += summ.sp_admitted
        t["sp_deferred"] += summ.sp_deferred
        t["p_deferred"] += p_def
        t["sp_no_gain"] += r.sp_deferred_reasons.get("no_gain", 0)
        t["switches"] += len(r.switch_paths)
        self.summaries.append(summ)
        self._unpublished.append(summ)
        return summ

    def _roll(self, view: InstanceView, now: float, reason: str, verdicts: tuple[SpVerdict, ...] = ()) -> Decision:
        """Close the round and open the next one with the same model, without a switch."""
        m = self._slot.model if self._slot is not None else view.active
        closed = self._close_round(now)
        self._open_round(view, now)
        d = self._start_slot(view, m, now, 0.0, "", closed) if m is not None else self._next_slot(view, now, closed)
        return Decision(d.phase, f"{reason}:{d.reason}", d.model, d.switch_to, d.switch_path, d.admit, d.run_step, verdicts + d.verdicts, d.closed_round)

    # ================================================================== slots
    def _next_slot(self, view: InstanceView, now: float, closed: RoundSummary | None, verdicts: tuple[SpVerdict, ...] = ()) -> Decision:
        r = self._round
        assert r is not None
        for m in self._rotation(view):  # a model that got work mid-round and has not been served joins it
            if view.model(m).has_work and m not in r.order and m not in r.served:
                r.order.append(m)
        nxt = next((m for m in r.order if m not in r.served and view.model(m).has_work), None)
        if nxt is None:
            closed = self._close_round(now) or closed
            self._open_round(view, now)
            r = self._round
            assert r is not None and r.order
            nxt = r.order[0]
        if nxt != view.active:
            path = expected_path(view.staged_fraction.get(nxt), self.policy.d2d_staging)
            self._switching = (nxt, path)
            self._observed_path = ""
            self._switch_dt = 0.0
            return Decision(Phase.SWITCH, "slot_boundary", nxt, switch_to=nxt, switch_path=path, verdicts=verdicts, closed_round=closed)
        return self._start_slot(view, nxt, now, 0.0, "", closed, verdicts)

    def _start_slot(self, view: InstanceView, m: str, now: float, switch_in: float, path: str, closed: RoundSummary | None, verdicts: tuple[SpVerdict, ...] = ()) -> Decision:
        r = self._round
        assert r is not None
        if m not in r.order:
            r.order.append(m)
        if path:
            r.switch_paths.append(path)
        left_slots = max(1, len([x for x in r.order if x not in r.served]))
        share = max(0.0, r.plan.prefill_pool_s - r.prefill_used_s) / left_slots
        mv0 = view.model(m)
        t_d = self.costs.decode_step_at(m, mv0.running + len(mv0.queued))  # at the slot's batch
        d_m = r.plan.reserved_iters.get(m) or reserved_iterations(r.plan.bound_s, self.policy.tpot_s)
        s = _Slot(m, now, d_m * t_d + share, share, d_m, t_d, switch_in_s=switch_in, switch_path=path)
        self._slot = s
        mv = view.model(m)
        admitted, deferred, _, over = select_p(mv.queued, budget_s=share, costs=self.costs, host_kv=self.policy.host_kv)
        s.p_admitted, s.p_deferred = len(admitted), len(deferred)
        r.p_deferred_s += over
        if admitted:
            s.phase_count[Phase.P.value] += 1
            return Decision(Phase.P, "slot_open", m, admit=tuple(c.request_id for c in admitted), run_step=True, verdicts=verdicts, closed_round=closed)
        s.enter(Phase.D1)
        if mv.running > 0:
            return Decision(Phase.D1, "slot_open_decode", m, run_step=True, verdicts=verdicts, closed_round=closed)
        # nothing for this model after all: give the slot up
        self._close_slot(now)
        others = [x for x in view.models if x.model != m and x.has_work]
        if not others:
            return Decision(Phase.IDLE, "no_admissible_work", closed_round=closed)
        return self._next_slot(view, now, closed, verdicts)

    def _close_slot(self, now: float) -> None:
        s, r = self._slot, self._round
        if s is None or r is None:
            self._slot = None
            return
        r.slots.append(s.summary(now))
        r.served.append(s.model)
        self._last_served = s.model
        self._slot = None

    # ================================================================== SP
    def _sp_opportunity(self, view: InstanceView, mv: ModelView, s: _Slot, budget_s: float, drain_iters: int | None) -> tuple[SpVerdict, ...]:
        pol, r = self.policy, self._round
        assert r is not None
        p_opened = s.opened
        candidates: list[CallView] = list(mv.queued)
        candidates += [c for m in view.models if m.model != s.model for c in m.queued if c.arrival > p_opened and c.continuation]
        eligible: list[CallView] = []
        verdicts: list[SpVerdict] = []
        for c in candidates:
            why = sp_ineligible_reason(c, active=s.model, p_opened=p_opened, sp=pol.sp, host_kv=pol.host_kv, new_sessions=pol.sp_new_sessions)
            if why is None:
                eligible.append(c)
                continue
            verdicts.append(SpVerdict(c.request_id, False, why))
            if c.request_id not in s.ineligible_seen:
                s.ineligible_seen.add(c.request_id)
                r.sp_ineligible[why] = r.sp_ineligible.get(why, 0) + 1
        if eligible:
            gain = self._sp_gain(view, mv, s, budget_s) if pol.sp_gain_check else None
            chosen = select_sp(
                eligible, budget_s=budget_s, free_kv_tokens=view.free_kv_tokens, costs=self.costs, host_kv=pol.host_kv,
                limits=self.limits, drain_iters=drain_iters, t_decode=s.t_decode, gain=gain,
            )
            for v in chosen:
                if v.admitted:
                    s.sp_admitted += 1
                    r.sp_benefit_s += v.benefit_s
                    r.sp_harm_s += v.harm_s
                elif v.request_id not in s.deferred_seen:  # one deferral event per call per slot
                    s.deferred_seen.add(v.request_id)
                    s.sp_deferred += 1
                    r.sp_deferred_reasons[v.reason] = r.sp_deferred_reasons.get(v.reason, 0) + 1
            verdicts += chosen
        return tuple(verdicts)

    def _sp_gain(self, view: InstanceView, mv: ModelView, s: _Slot, left_s: float) -> SpGain:
        """What SP is worth now (admission.py, "SP that cannot lose"), from the cost model's measured
        costs. Without SP a returning call waits for: the rest of this slot (its in-flight decode; bounded by
        the budget left when calls can be parked), then every other model with work in rotation order (the
        switch in by its expected path, its queued prefill, its protected decode iterations), then the
        switch back to this model. Every call of another model that waits (queued or running) is delayed by
        whatever SP adds to this slot, and every call of this model still decoding by the SP call's prefill
        (its chunks share their steps). Pure: reads the view and the cost model, mutates nothing."""
        pol, r = self.policy, self._round
        assert r is not None
        rotation = self._rotation(view)
        others = [view.model(m) for m in rotation if m != s.model and view.model(m).has_work]
        decoding = max(0, mv.running - mv.prefilling)
        rest = mv.max_remaining_decode * s.t_decode
        if not others:  # admitted by the next round's P once this slot drains or its budget runs out
            return SpGain(min(max(0.0, left_s), rest) if mv.running > 0 else 0.0, 0, decoding)
        wait = min(rest, max(0.0, left_s)) if view.can_park else rest
        for m in others:
            d_m = r.plan.reserved_iters.get(m.model) or reserved_iterations(r.plan.bound_s, pol.tpot_s)
            wait += self.costs.switch(expected_path(view.staged_fraction.get(m.model), pol.d2d_staging))
            wait += self._work_s(m, max_iters=d_m)  # its queued prefill and its protected decode
        wait += self.costs.switch(expected_path(view.staged_fraction.get(s.model), pol.d2d_staging))
        return SpGain(wait, sum(len(m.queued) + m.running for m in others), decoding)
