"""Per-token deadlines for the cold pool (Aegaeon, SOSP 2025: "Why request-granularity
scaling stalls at three", "Token deadlines turn pooling into admission control") — pure policy, no torch, no I/O, injected clock.

Design NOTE.
* Service quality is per token. Each sequence's first token is due ``arrival + T_TTFT``; token ``i > 1`` is
  due ``t_first + (i - 1)·T_TPOT`` where ``t_first`` is when its first token was actually emitted. Output is
  buffered client-side, so a sequence that decodes faster than T_TPOT earns *slack* (tokens generated ahead of
  their deadlines) that the scheduler may spend on another model's switch and prefill.
* :class:`DeadlineTracker` keeps that per-sequence clock (arrival, first token, tokens emitted), measures
  attainment (first tokens and later tokens on time) and the distribution of inter-token gaps (fixed-bucket
  histogram + quantiles, not only averages: the summary's "distribution of inter-token gaps").
* :class:`DeadlineScheduler.decide(view, now)` is called at every decode boundary, i.e. at token
  granularity, with the same :class:`InstanceView` the round scheduler gets, and answers a
  :class:`Decision` (so the cold engine's slot driver, ``cold/driver.py``, carries it out unchanged):

  1. *Which model next*: earliest deadline first over the queued calls of every model (TTFT deadlines)
     that can still be on time; calls already lost do not preempt those (EDF's overload cascade) and are
     served when nothing on time waits.
  2. *Admitting a new model into the instance* (a switch) is accepted only when every admitted sequence
     still meets its deadlines on the measured switch path: with parking (``view.can_park``) the running
     sequences' slack must cover ``switch(A→X) + X's prefill + one X step + switch(X→A) + one A step``;
     without parking the active model drains first, so the check is on the admitted-but-queued calls of the
     other models (their TTFT deadlines after X's work). A denied switch is counted (``denied_switches``).
  3. *Closing admission to the active model*: a queued call of the active model is admitted only when its
     prefill fits in the smallest slack of the running sequences (a prefill step stalls them all) and,
     when another model's call waits, when the drain of the active model after admitting it still lets that
     call start before its latest start ``deadline − (switch + prefill + step)``. Otherwise the active model
     stops admitting and drains, and the switch happens at the first token boundary with nothing running.
* Costs (prefill per token, decode step per model, switch per path) are the measured EWMA profile of
  :class:`~services.engine.slots.costs.CostModel`, refreshed by the executor after every step and switch.

Limitation (stated, not hidden): the real cold engine cannot park an in-flight sequence across a switch
(``can_park`` False), so on it a switch waits for the active model to drain; the parking branch is exercised
by the virtual-clock tests only.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .costs import CostModel, MeasuredCosts, expected_path
from .scheduler import SlotPolicy, SlotScheduler
from .types import CallView, Decision, InstanceView, Phase, RoundSummary

# Inter-token gap histogram bucket upper bounds (seconds); the last bucket is +inf.
GAP_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, math.inf)


@dataclass(frozen=True, slots=True)
class DeadlineTargets:
    """A call's token deadlines: T_TTFT for the first token, T_TPOT between later tokens (seconds, > 0)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive finite number of seconds, got {v!r}")


@dataclass(slots=True)
class _SeqClock:
    model: str
    arrival: float
    targets: DeadlineTargets
    first_t: float | None = None
    emitted: int = 0
    last_t: float | None = None

    def due(self, i: int) -> float:
        """Deadline of token ``i`` (1-based)."""
        if i <= 1 or self.first_t is None:
            return self.arrival + self.targets.ttft_s
        return self.first_t + (i - 1) * self.targets.tpot_s

    @property
    def next_due(self) -> float:
        return self.due(self.emitted + 1)


@dataclass(frozen=True, slots=True)
class DeadlineStats:
    """Attainment and inter-token gap distribution over a window (a round, or since start)."""

    tokens: int = 0  # tokens after the first
    tokens_on_time: int = 0
    first_tokens: int = 0
    first_on_time: int = 0
    gap_p50_s: float = 0.0
    gap_p90_s: float = 0.0
    gap_p99_s: float = 0.0
    gap_max_s: float = 0.0
    gap_buckets_s: tuple[float, ...] = GAP_BUCKETS_S
    gap_counts: tuple[int, ...] = (0,) * len(GAP_BUCKETS_S)

    @property
    def attainment(self) -> float:
        """Fraction of all tokens (first and later) emitted by their deadline (1.0 when none)."""
        n = self.tokens + self.first_tokens
        return (self.tokens_on_time + self.first_on_time) / n if n else 1.0

    @property
    def ttft_attainment(self) -> float:
        return self.first_on_time / self.first_tokens if self.first_tokens else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gap_buckets_s"] = [b if math.isfinite(b) else "inf" for b in self.gap_buckets_s]
        d["attainment"], d["ttft_attainment"] = self.attainment, self.ttft_attainment
        return d


def _quantile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return 0.0
    k = min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))
    return sorted_xs[k]


class _Window:
    """Counters and the histogram are exact; quantiles come from the latest ``keep`` gaps (bounded work per
    snapshot for the since-start window)."""

    def __init__(self, keep: int | None = None) -> None:
        self.tokens = self.on_time = self.first = self.first_on_time = 0
        self.gaps: deque[float] = deque(maxlen=keep)
        self.counts = [0] * len(GAP_BUCKETS_S)

    def add_gap(self, x: float) -> None:
        self.gaps.append(x)
        self.counts[bisect.bisect_left(GAP_BUCKETS_S, x)] += 1

    def stats(self) -> DeadlineStats:
        g = sorted(self.gaps)
        counts = self.counts
        return DeadlineStats(self.tokens, self.on_time, self.first, self.first_on_time, _quantile(g, 0.5), _quantile(g, 0.9),
                             _quantile(g, 0.99), g[-1] if g else 0.0, GAP_BUCKETS_S, tuple(counts))


class DeadlineTracker:
    """Per-sequence token clocks plus attainment windows. Pure bookkeeping: the caller says when calls
    arrive, when tokens are emitted and when calls end. Mutates only itself."""

    def __init__(self, default: DeadlineTargets | None = None) -> None:
        self.default = default or DeadlineTargets()
        self._seqs: dict[str, _SeqClock] = {}
        self._window = _Window()
        self._total = _Window(keep=2048)

    def arrive(self, request_id: str, model: str, arrival: float, targets: DeadlineTargets | None = None) -> None:
        """Start a call's clock (idempotent: a known id keeps its clock)."""
        if request_id not in self._seqs:
            self._seqs[request_id] = _SeqClock(model, arrival, targets or self.default)

    def known(self, request_id: str) -> bool:
        return request_id in self._seqs

    def emit(self, request_id: str, n: int, now: float) -> None:
        """``n`` tokens of the call were emitted at ``now``: each is scored against its deadline; the gap to
        the previous token goes into the histogram. Unknown ids are ignored (calls admitted before tracking)."""
        s = self._seqs.get(request_id)
        if s is None:
            return
        for _ in range(max(n, 0)):
            i = s.emitted + 1
            due = s.due(i)
            for w in (self._window, self._total):
                if i == 1:
                    w.first += 1
                    w.first_on_time += now <= due
                else:
                    w.tokens += 1
                    w.on_time += now <= due
                    w.add_gap(max(0.0, now - (s.last_t if s.last_t is not None else now)))
            if i == 1:
                s.first_t = now
            s.emitted, s.last_t = i, now

    def finish(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    def next_due(self, request_id: str) -> float | None:
        s = self._seqs.get(request_id)
        return s.next_due if s is not None else None

    def slack(self, request_id: str, now: float) -> float | None:
        """Seconds until the call's next token is due (negative: already late)."""
        d = self.next_due(request_id)
        return None if d is None else d - now

    def buffered_tokens(self, request_id: str, now: float) -> int:
        """Tokens the call generated ahead of their deadlines (what its slack is made of)."""
        s = self._seqs.get(request_id)
        if s is None or s.first_t is None:
            return 0
        due_by_now = 1 + int(max(0.0, now - s.first_t) // s.targets.tpot_s)
        return max(0, s.emitted - due_by_now)

    def running(self, model: str, now: float) -> list[tuple[str, float]]:
        """(request id, slack) of the model's calls that have emitted at least one token."""
        return [(r, s.next_due - now) for r, s in self._seqs.items() if s.model == model and s.emitted > 0]

    def started(self, model: str) -> list[str]:
        return [r for r, s in self._seqs.items() if s.model == model and s.emitted > 0]

    def take_window(self) -> DeadlineStats:
        """The window since the last take (then a new window starts). Mutates: the window."""
        st, self._window = self._window.stats(), _Window()
        return st

    def reset_totals(self) -> None:
        """Start the since-start totals afresh (benchmarks, after warm-up). Mutates: the totals window."""
        self._total = _Window(keep=2048)

    def totals(self) -> DeadlineStats:
        return self._total.stats()


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """Knobs of token-deadline scheduling (config: ``slot_ttft_s``, ``slot_tpot_s``, ``token_deadlines``)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1
    margin: float = 0.9  # plan against margin·deadline (safety for cost-model error), in (0, 1]
    d2d_staging: bool = True
    host_kv: bool = True

    def __post_init__(self) -> None:
        DeadlineTargets(self.ttft_s, self.tpot_s)
        if not 0 < self.margin <= 1:
            raise ValueError("margin must be in (0, 1]")


@dataclass(slots=True)
class _Epoch:
    """The time between two switches: the deadline scheduler's 'round' for summaries."""

    index: int
    started: float
    model: str | None
    active_s: float = 0.0
    switch_s: float = 0.0
    idle_s: float = 0.0
    admitted: int = 0
    deferred: int = 0
    paths: list[str] = field(default_factory=list)


class DeadlineScheduler(MeasuredCosts):
    """Token-granularity cold-pool scheduling against per-token deadlines (see the module note).

    Same surface as :class:`~services.engine.slots.scheduler.SlotScheduler` (``decide``, ``observe_step``,
    ``observe_switch``, ``take_summaries``, ``status``); the tracker is shared with the executor, which
    reports arrivals and emitted tokens into it."""

    def __init__(self, policy: DeadlinePolicy | None = None, costs: CostModel | None = None, tracker: DeadlineTracker | None = None, max_summaries: int = 64) -> None:
        self.policy = policy or DeadlinePolicy()
        self.costs = costs or CostModel()
        self.tracker = tracker or DeadlineTracker(DeadlineTargets(self.policy.ttft_s, self.policy.tpot_s))
        self.summaries: list[RoundSummary] = []
        self._unpublished: list[RoundSummary] = []
        self._max = max_summaries
        self._epoch: _Epoch | None = None
        self._last_t: float | None = None
        self._last_phase = Phase.IDLE
        self.totals = {"rounds": 0, "switches": 0, "denied_switches": 0, "admission_closed": 0, "p_admitted": 0, "p_deferred": 0}
        self.last_reason = ""

    # ---------------------------------------------------------------- public surface
    def decide(self, view: InstanceView, now: float) -> Decision:
        """One decision at a token boundary. Mutates: time accounting, epoch, counters."""
        self._account(now)
        d = self._decide(view, now)
        self._last_phase, self.last_reason = d.phase, d.reason
        return d

    def observe_switch(self, path: str, seconds: float) -> None:
        self.costs.observe_switch(path, seconds)
        if self._epoch is not None:
            self._epoch.paths.append(str(path))

    def take_summaries(self) -> list[RoundSummary]:
        out, self._unpublished = self._unpublished, []
        return out

    def slot_waits(self, now: float, idle: bool = False) -> dict[str, float]:
        """No slots to wait for: a call's model is switched to when its deadline is due (the round
        scheduler's heartbeat field, empty here). Pure."""
        return {}

    def finish(self, now: float) -> RoundSummary | None:
        """The end of a run: end the open epoch now, so its summary becomes takeable; the next switch opens a
        new one. Mutates: the epoch, summaries, counters."""
        self._account(now)
        s = self._close_epoch(now)
        self._epoch = None
        return s

    def status(self, now: float, idle: bool = False) -> dict:
        """Heartbeat fields (no slot waits: token deadlines have no rounds; ``idle`` is accepted for the
        executor's one call shape)."""
        tot = self.tracker.totals()
        out = dict(self.totals)
        out.update({
            "mode": "token_deadlines", "active_model": self._epoch.model if self._epoch else None,
            "phase": self._last_phase.value, "reason": self.last_reason,
            "deadline_risk": tot.attainment < 1.0, "shortfall_s": 0.0, "round_remaining_s": 0.0, "infeasible": [],
            "deadline_attainment": tot.attainment, "ttft_attainment": tot.ttft_attainment, "gap_p99_s": tot.gap_p99_s,
        })
        return out

    # ---------------------------------------------------------------- cost helpers (measured profile)
    def _switch_s(self, view: InstanceView, target: str) -> float:
        return self.costs.switch(expected_path(view.staged_fraction.get(target), self.policy.d2d_staging))

    def _prefill_s(self, calls: list[CallView]) -> float:
        return sum(self.costs.call(c, self.policy.host_kv).seconds for c in calls)

    def _due(self, c: CallView) -> float:
        d = self.tracker.next_due(c.request_id)
        return d if d is not None else c.arrival + self.policy.ttft_s

    def _work_s(self, view: InstanceView, m: str, calls: list[CallView]) -> float:
        """Seconds from the switch into ``m`` until its first tokens: the calls' prefill plus one step."""
        return self._prefill_s(calls) + self.costs.decode_step(m)

    # ---------------------------------------------------------------- the decision
    def _reachable(self, view: InstanceView, m: str, c: CallView, now: float) -> bool:
        """Can ``c``'s first token still be on time if ``m`` got the device now (switch, prefill, one step)?"""
        cost = self.costs.call(c, self.policy.host_kv).seconds + self.costs.decode_step(m)
        if m != view.active:
            cost += self._switch_s(view, m)
        return now + cost <= self._due(c)

    def _decide(self, view: InstanceView, now: float) -> Decision:
        a = view.active
        am = view.model(a) if a is not None else None
        # EDF over calls that can still be on time; calls already lost do not preempt those that can make it
        # (EDF under overload otherwise cascades misses), but are served when nothing on time waits
        feasible, late = [], []
        for mv in view.models:
            if mv.model == a or not mv.queued:
                continue
            ok = [self._due(c) for c in mv.queued if self._reachable(view, mv.model, c, now)]
            if ok:
                feasible.append((min(ok), mv.model))
            else:
                late.append((min(self._due(c) for c in mv.queued), mv.model))
        urgent = min(feasible) if feasible else None
        if am is not None and (am.running or am.queued):
            d = self._serve_active(view, am, urgent, now)
            if d is not None:
                return d
        if urgent is None:
            if am is not None and am.running:
                return Decision(Phase.D, "decode", a, run_step=True)
            if late:
                return self._try_switch(view, min(late)[1], now)
            return Decision(Phase.IDLE, "no_work")
        return self._try_switch(view, urgent[1], now)

    def _serve_active(self, view: InstanceView, am, urgent: tuple[float, str] | None, now: float) -> Decision | None:
        """Admit (EDF) the active model's queued calls that keep every deadline, or just decode; ``None``
        when the active model should give the device up now (nothing running, another model is due
        first, or parking lets the urgent model in)."""
        m = am.model
        slacks = [s for _, s in self.tracker.running(m, now)]
        min_slack = min(slacks, default=math.inf)
        step = self.costs.decode_step(m)
        latest_start = math.inf
        if urgent is not None:
            x = urgent[1]
            latest_start = urgent[0] - (self._switch_s(view, x) + self._work_s(view, x, list(view.model(x).queued[:1]))) / self.policy.margin
        admit: list[str] = []
        spent = 0.0
        drain_iters = am.max_remaining_decode
        deferred = 0
        for c in sorted(am.queued, key=lambda c: (not self._reachable(view, m, c, now), self._due(c))):
            cost = self.costs.call(c, self.policy.host_kv).seconds
            if urgent is not None and self._due(c) > urgent[0]:
                drain = now + spent + cost + max(drain_iters, c.max_tokens) * step
                if drain > latest_start:
                    deferred += 1
                    self.totals["admission_closed"] += 1
                    continue
            if spent + cost + step > min_slack * self.policy.margin and self._due(c) - now > min_slack:
                deferred += 1  # its prefill would stall running calls past their next deadline, due sooner
                continue
            admit.append(c.request_id)
            spent += cost
            drain_iters = max(drain_iters, c.max_tokens)
        self._count_admission(len(admit), deferred)
        if admit:
            return Decision(Phase.P, "admit_edf", m, admit=tuple(admit), run_step=True)
        if am.running:
            if urgent is not None and view.can_park and self._urgent_now(view, m, urgent, now):
                if self._admissible(view, urgent[1], now, parked=m):
                    return None  # park the active model: the switch happens in _try_switch
                self.totals["denied_switches"] += 1
                return Decision(Phase.D, "switch_denied", m, run_step=True)
            return Decision(Phase.D, "decode" if urgent is None else "drain_for_deadline", m, run_step=True)
        if am.queued and (urgent is None or min(self._due(c) for c in am.queued) <= urgent[0]):
            first = min(am.queued, key=self._due)
            return Decision(Phase.P, "admit_forced", m, admit=(first.request_id,), run_step=True)
        return None

    def _urgent_now(self, view: InstanceView, m: str, urgent: tuple[float, str], now: float) -> bool:
        """With parking: the urgent call would miss its latest start if the active model decoded one more token."""
        x = urgent[1]
        trip = self._switch_s(view, x) + self._work_s(view, x, list(view.model(x).queued[:1]))
        return now + self.costs.decode_step(m) + trip / self.policy.margin >= urgent[0]

    def _admissible(self, view: InstanceView, x: str, now: float, parked: str | None) -> bool:
        """Every admitted sequence still meets its deadlines if ``x`` is admitted now (measured switch path)."""
        calls = list(view.model(x).queued)
        occupy = self._switch_s(view, x) + self._work_s(view, x, calls)
        if parked is not None:
            back = occupy + self._switch_s(view, parked) + self.costs.decode_step(parked)
            for _, slack in self.tracker.running(parked, now):
                if slack * self.policy.margin < back:
                    return False
        for mv in view.models:  # other models' waiting calls: their first token after x's work and a switch
            if mv.model in (x, view.active) or not mv.queued:
                continue
            due = self._due(mv.queued[0])
            own_due = min(self._due(c) for c in calls) if calls else math.inf
            if due < own_due and now + occupy + self._switch_s(view, mv.model) + self._work_s(view, mv.model, list(mv.queued[:1])) > due:
                return False  # an earlier-due call elsewhere would be pushed past its deadline
        return True

    def _try_switch(self, view: InstanceView, x: str, now: float) -> Decision:
        a = view.active
        am = view.model(a) if a is not None else None
        if am is not None and am.running and not view.can_park:
            return Decision(Phase.DFIN, "drain_before_switch", a, run_step=True)
        running = am is not None and am.running > 0
        if not self._admissible(view, x, now, parked=a if running else None):
            self.totals["denied_switches"] += 1
            if running:
                return Decision(Phase.D, "switch_denied", a, run_step=True)
            # nothing runs here, so waiting protects nobody: the earliest-due call goes (work conserving)
        path = expected_path(view.staged_fraction.get(x), self.policy.d2d_staging)
        self._open_epoch(x, now)
        self.totals["switches"] += 1
        return Decision(Phase.SWITCH, "edf_switch", x, switch_to=x, switch_path=str(path))

    def _count_admission(self, admitted: int, deferred: int) -> None:
        self.totals["p_admitted"] += admitted
        self.totals["p_deferred"] += deferred
        if self._epoch is not None:
            self._epoch.admitted += admitted
            self._epoch.deferred += deferred

    # ---------------------------------------------------------------- epochs (summaries) and time
    def _account(self, now: float) -> None:
        if self._last_t is None:
            self._last_t = now
            return
        dt, self._last_t = max(0.0, now - self._last_t), now
        e = self._epoch
        if e is None:
            return
        if self._last_phase is Phase.SWITCH:
            e.switch_s += dt
        elif self._last_phase is Phase.IDLE:
            e.idle_s += dt
        else:
            e.active_s += dt

    def _open_epoch(self, model: str, now: float) -> None:
        prev = self._epoch
        self._close_epoch(now)
        idx = prev.index + 1 if prev is not None else 0
        self._epoch = _Epoch(idx, now, model)

    def _close_epoch(self, now: float) -> RoundSummary | None:
        e = self._epoch
        if e is None:
            return None
        st = self.tracker.take_window()
        s = RoundSummary(
            index=e.index, started=e.started, wall_s=e.active_s + e.switch_s, active_s=e.active_s, switch_s=e.switch_s,
            bound_s=0.0, predicted_s=0.0, shortfall_s=0.0, deadline_risk=st.attainment < 1.0, infeasible=(),
            phase_s={"active": e.active_s, "switch": e.switch_s, "idle": e.idle_s}, phase_count={},
            sp_admitted=0, sp_deferred=0, sp_ineligible={}, p_admitted=e.admitted, p_deferred=e.deferred,
            switch_paths=tuple(e.paths), slots=(), flags={"token_deadlines": True, "d2d_staging": self.policy.d2d_staging, "host_kv": self.policy.host_kv},
            deadlines=st,
        )
        self.summaries.append(s)
        self.summaries = self.summaries[-self._max:]
        self._unpublished.append(s)
        self.totals["rounds"] += 1
        return s


def make_scheduler(policy: SlotPolicy, costs: CostModel, tracker: DeadlineTracker) -> SlotScheduler | DeadlineScheduler:
    """A cold instance's policy object, one choice for the engine (``cold/slotted.py``) and the simulator: the
    token-deadline scheduler with ``token_deadlines`` (not for an ``endless`` hot instance), else the round
    scheduler with ``tracker`` attached (per-token deadlines are scored in both modes: its round summaries carry
    the window's deadline stats). Pure."""
    if policy.token_deadlines and not policy.endless:
        dp = DeadlinePolicy(policy.ttft_s, policy.tpot_s, d2d_staging=policy.d2d_staging, host_kv=policy.host_kv)
        return DeadlineScheduler(dp, costs, tracker)
    s = SlotScheduler(policy, costs)
    s.tracker = tracker
    return s
