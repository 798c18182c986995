"""Placement policies: Talaria's session-aware residency routing (§3.3, §4.1, Algorithm 1, Eq. 1-2) and the
comparison baselines of §5.3 (least-pressure, session-sticky) plus round-robin.

Pure: ``decide(state, now) -> Decision``. ``state`` is a frozen description of one arriving call and what
the router knows (instance views with the in-flight overlay already applied, the session's last placement,
its lease, the predicted per-model demand, the knobs); ``now`` is the wall time leases are compared with.
Nothing here reads a clock, talks to NATS or mutates anything, so the same code runs in the router, in
unit tests under a manual clock, and in the simulator under a virtual one.

Cost of a call r on instance i (Eq. 1), in seconds, each term charged exactly once::

    Cost(r, i) = dR_req + C_KV + C_act
    dR_req = queue_s + suffix_tokens * prefill_per_token + expected_decode * decode_step
             (only the work r adds: its uncached suffix and its decode, behind the queue ahead of it)
    C_KV   = 0                                   prefix device-resident on i
           = committed_tokens * restore_per_token  prefix host-restorable on i
           = committed_tokens * prefill_per_token  otherwise (recompute); 0 for a new session
    C_act  = 0 model active | switch cost (resident or staged, not active) | full open cost (not resident)

    queue_s = mean_call_s(i) * (waiting + overlay_calls + admission_unit * overlay_leases
                                + running_weight * running)

A fresh replica (the model is not resident on i) is admitted only when Eq. 2 holds::

    gain(m, i) > T_swap(m, i) + mu_i * dW_m + nu_m
    gain(m, i) = demand_m * max(0, W_existing - W_i)   (inf when no existing replica can admit r)
    mu_i       = hbm_price / max(0.05, 1 - kv_usage_i)  (price per GiB rises with memory pressure)

where W is the predicted latency of r without activation (dR_req + C_KV), W_existing the best over
instances where m is resident and admissible, and demand_m the calls of m predicted over the control
window (observed arrival rate * window + live leases of m).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

# KV states (values of talaria.v1.KvState; repeated here so the policy does not import protobuf).
KV_DEVICE = 1
KV_HOST = 2

POLICIES = ("full", "least-pressure", "session-sticky", "round-robin")


@dataclass(frozen=True, slots=True)
class PolicyParams:
    policy: str = "full"
    admission_unit: float = 1.0
    admission_budget_s: float = 60.0
    hbm_reserve_fraction: float = 0.0
    running_weight: float = 0.5
    control_window_s: float = 10.0
    hbm_price_s_per_gib: float = 0.05
    replica_penalty_s: float = 1.0
    model_weights_gib: Mapping[str, float] = field(default_factory=dict)
    default_weights_gib: float = 1.0
    retry_after_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Profile:
    """Measured (EWMA) costs of one instance, seconds."""

    prefill_per_token: float
    decode_step: float
    restore_per_token: float
    switch_s: float  # resident but inactive model -> active
    staged_switch_s: float  # staged (partly pre-loaded) model -> active
    open_s: float  # model not resident -> active


@dataclass(frozen=True, slots=True)
class ModelRes:
    loaded: bool = False  # weights resident (a replica exists here)
    active: bool = False  # currently serving (hot: always)
    staged: bool = False  # weights (partly) pre-staged for a switch


@dataclass(frozen=True, slots=True)
class InstanceState:
    instance_id: str
    healthy: bool  # health check: heartbeats on time, not suspect, not draining
    fresh: bool  # snapshot fresh enough for new non-reserved calls
    models: Mapping[str, ModelRes]  # every model it can serve (hot: its one pinned model)
    profile: Profile
    pool: str = "hot"
    kv: Mapping[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (session, model) -> (state, tokens)
    running: int = 0
    waiting: int = 0
    overlay_calls: int = 0  # calls forwarded since the snapshot
    overlay_leases: int = 0  # live leases on this instance
    kv_pages_total: int = 0  # 0 = unknown (memory check skipped)
    page_size: int = 16
    kv_usage: float = 0.0
    snapshot_unix: float = 0.0  # when the snapshot was taken (engine wall clock)
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class CallShape:
    """Typical call of a model (EWMA over completion hooks): what a queued call costs."""

    suffix_tokens: float = 256.0
    prompt_tokens: float = 512.0
    decode_tokens: float = 64.0


@dataclass(frozen=True, slots=True)
class CallRequest:
    session_id: str
    model: str
    prompt_tokens: int  # estimate of the full prompt
    max_tokens: int
    expected_decode: float  # predicted completion tokens (<= max_tokens)


@dataclass(frozen=True, slots=True)
class SessionView:
    model: str
    last_instance: str
    first_instance: str
    committed_tokens: int
    done_unix: float  # when the last call finished (0 if only forwarded, not completed)


@dataclass(frozen=True, slots=True)
class LeaseView:
    lease_id: str
    instance_id: str
    model: str
    committed_tokens: int
    t_done_unix: float
    t_exp_unix: float
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class PlacementState:
    request: CallRequest
    instances: Sequence[InstanceState]
    params: PolicyParams = PolicyParams()
    session: SessionView | None = None
    lease: LeaseView | None = None
    shape: CallShape = CallShape()
    demand: Mapping[str, float] = field(default_factory=dict)  # model -> calls predicted in the window
    seq: int = 0  # decision number (round-robin)


@dataclass(frozen=True, slots=True)
class CostBreakdown:
    instance_id: str
    delta_r: float  # dR_req: queue + suffix prefill + decode
    c_kv: float
    c_act: float
    total: float
    queue_s: float
    kv_source: str  # "device" | "host" | "recompute" | "none"
    act: str  # "active" | "switch" | "open"
    fresh_replica: bool
    predicted_ttft_s: float
    pages_needed: int
    eq2_gain: float | None = None  # set for fresh replicas
    eq2_threshold: float | None = None
    reject: str = ""  # "" admitted | "unhealthy" | "stale" | "round-admission" | "memory" | "eq2"


@dataclass(frozen=True, slots=True)
class Decision:
    instance_id: str | None
    policy: str
    reason: str  # "lease" | "cost" | "least-pressure" | "sticky" | "round-robin" | "overload" | "no-instance"
    lease: str = "none"  # "none" | "hit" | "expired" | "unhealthy" | "prefix-invalid"
    costs: tuple[CostBreakdown, ...] = ()
    opens_model: bool = False  # the chosen instance must open the model (not resident there)
    switches_model: bool = False  # ... must switch to a resident/staged model
    avoidable_open: bool = False  # ... opens it although another healthy instance has it resident
    retry_after_s: float = 0.0  # overload: when trying again makes sense

    def chosen(self) -> CostBreakdown | None:
        return next((c for c in self.costs if c.instance_id == self.instance_id), None)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["costs"] = [asdict(c) for c in self.costs]
        return d


# ----------------------------------------------------------------------------------------- cost model


def kv_state_on(inst: InstanceState, req: CallRequest, session: SessionView | None, lease: LeaseView | None) -> tuple[str, int]:
    """Where ``req``'s session prefix is on ``inst`` ("device" | "host" | "recompute" | "none") and its length.

    The snapshot is the source; a completion newer than the snapshot (hook or lease) is trusted for the
    instance that served it, since the snapshot cannot know it yet.
    """
    committed = 0
    if session is not None and session.model == req.model:
        committed = session.committed_tokens
    entry = inst.kv.get((req.session_id, req.model)) if req.session_id else None
    if entry is not None:
        state, tokens = entry
        if tokens > 0 and state in (KV_DEVICE, KV_HOST):
            return ("device" if state == KV_DEVICE else "host"), tokens
    for src in (lease, session):
        if src is None or src.model != req.model:
            continue
        where = src.instance_id if isinstance(src, LeaseView) else src.last_instance
        done = src.t_done_unix if isinstance(src, LeaseView) else src.done_unix
        if where == inst.instance_id and done >= inst.snapshot_unix and src.committed_tokens > 0:
            return "device", src.committed_tokens
    if committed > 0:
        return "recompute", committed
    return "none", 0


def activation(inst: InstanceState, model: str) -> tuple[str, float]:
    res = inst.models[model]
    if res.active:
        return "active", 0.0
    if res.loaded:
        return "switch", inst.profile.switch_s
    if res.staged:
        return "switch", inst.profile.staged_switch_s
    return "open", inst.profile.open_s


def _terms(inst: InstanceState, state: PlacementState) -> list:
    """Eq. 1 for one instance plus the round-admission and memory checks, as a list in the field order of
    ``CostBreakdown`` (built once, after Eq. 2, so a decision over many instances stays cheap)."""
    req, p, prof, shape = state.request, state.params, inst.profile, state.shape
    kv_source, prefix = kv_state_on(inst, req, state.session, state.lease)
    suffix = max(1, req.prompt_tokens - prefix)
    leases = inst.overlay_leases
    if state.lease is not None and state.lease.instance_id == inst.instance_id and leases > 0:
        leases -= 1  # the lease reserved for this very call is not queue ahead of it
    mean_call_s = shape.suffix_tokens * prof.prefill_per_token + shape.decode_tokens * prof.decode_step
    pressure = inst.waiting + inst.overlay_calls + p.admission_unit * leases + p.running_weight * inst.running
    queue_s = mean_call_s * pressure
    delta_r = queue_s + suffix * prof.prefill_per_token + req.expected_decode * prof.decode_step
    if kv_source == "device" or kv_source == "none":
        c_kv = 0.0
    elif kv_source == "host":
        c_kv = prefix * prof.restore_per_token
    else:
        c_kv = prefix * prof.prefill_per_token
    act, c_act = activation(inst, req.model)
    ttft = queue_s + c_kv + c_act + suffix * prof.prefill_per_token
    page = max(1, inst.page_size)
    resident_pages = prefix // page if kv_source == "device" else 0
    pages_needed = max(0, -(-(req.prompt_tokens + req.max_tokens) // page) - resident_pages)
    reject = ""
    if not inst.healthy:
        reject = "unhealthy"
    elif not inst.fresh:
        reject = "stale"
    elif ttft > p.admission_budget_s:
        reject = "round-admission"
    elif inst.kv_pages_total > 0:
        per_call = -(-int(shape.prompt_tokens + shape.decode_tokens) // page)
        in_use = (inst.running + inst.waiting + inst.overlay_calls) * per_call
        if pages_needed > inst.kv_pages_total * (1.0 - p.hbm_reserve_fraction) - in_use:
            reject = "memory"
    total = delta_r + c_kv + c_act
    return [inst.instance_id, delta_r, c_kv, c_act, total, queue_s, kv_source, act, act == "open", ttft, pages_needed, None, None, reject]


_DR, _CKV, _CACT, _FRESH, _GAIN, _THR, _REJECT = 1, 2, 3, 8, 11, 12, 13


def breakdown(inst: InstanceState, state: PlacementState) -> CostBreakdown:
    """Eq. 1 for one instance plus the round-admission and memory checks (no Eq. 2)."""
    return CostBreakdown(*_terms(inst, state))


def apply_eq2(terms: list[list], by_id: Mapping[str, InstanceState], state: PlacementState) -> None:
    """Gate fresh replicas by Eq. 2: fills the gain/threshold of each fresh replica, rejects it ("eq2")
    unless the gain exceeds T_swap + mu * dW + nu. Mutates ``terms`` (lists from ``_terms``)."""
    p, m = state.params, state.request.model
    existing = [t[_DR] + t[_CKV] for t in terms if not t[_FRESH] and not t[_REJECT]]
    w_existing = min(existing) if existing else math.inf
    demand = max(1.0, state.demand.get(m, 0.0))
    d_w = p.model_weights_gib.get(m, p.default_weights_gib)
    for t in terms:
        if not t[_FRESH] or t[_REJECT]:
            continue
        w_new = t[_DR] + t[_CKV]
        gain = math.inf if math.isinf(w_existing) else demand * max(0.0, w_existing - w_new)
        mu = p.hbm_price_s_per_gib / max(0.05, 1.0 - by_id[t[0]].kv_usage)
        threshold = t[_CACT] + mu * d_w + p.replica_penalty_s
        t[_GAIN], t[_THR] = gain, threshold
        if not gain > threshold:
            t[_REJECT] = "eq2"


# ------------------------------------------------------------------------------------------ decisions


def _serving(state: PlacementState) -> list[InstanceState]:
    return [i for i in state.instances if state.request.model in i.models]


def _finish(state: PlacementState, reason: str, chosen: str | None, costs: Sequence[CostBreakdown], lease: str) -> Decision:
    m = state.request.model
    opens = switches = avoidable = False
    c = next((x for x in costs if x.instance_id == chosen), None)
    if c is not None:
        opens, switches = c.act == "open", c.act == "switch"
        if opens:
            avoidable = any(
                i.instance_id != chosen and i.healthy and i.models[m].loaded for i in _serving(state)
            )
    retry = 0.0
    if chosen is None and costs:
        retry = max(state.params.retry_after_s, min(x.predicted_ttft_s for x in costs) - state.params.admission_budget_s)
    elif chosen is None:
        retry = state.params.retry_after_s
    return Decision(chosen, state.params.policy, reason, lease, tuple(costs), opens, switches, avoidable, retry)


def lease_check(state: PlacementState, now: float) -> str:
    """Algorithm 1 lines 2-9: "hit", or why the lease cannot be honoured ("none" if there is none)."""
    lease, req = state.lease, state.request
    if lease is None or lease.model != req.model:
        return "none"
    if now >= lease.t_exp_unix:
        return "expired"
    inst = next((i for i in state.instances if i.instance_id == lease.instance_id), None)
    if inst is None or not inst.healthy or req.model not in inst.models:
        return "unhealthy"  # a lease is honoured only if the instance passes the health check (§4.1)
    if lease.epoch and inst.epoch and inst.epoch != lease.epoch:
        return "prefix-invalid"  # the engine restarted: the KV is gone
    source, _ = kv_state_on(inst, req, state.session, lease)
    if source not in ("device", "host"):
        return "prefix-invalid"
    return "hit"


def decide_full(state: PlacementState, now: float) -> Decision:
    """Algorithm 1: consume a valid lease, else rank admissible instances by Eq. 1 with the Eq. 2 gate."""
    serving = _serving(state)
    lease = lease_check(state, now)
    if lease == "hit":
        assert state.lease is not None
        inst = next(i for i in serving if i.instance_id == state.lease.instance_id)
        return _finish(state, "lease", inst.instance_id, [breakdown(inst, state)], "hit")
    # A lease that failed its check is discarded; placement continues as if there were none.
    if lease != "none":
        state = replace(state, lease=None)
    terms = [_terms(i, state) for i in serving]
    apply_eq2(terms, {i.instance_id: i for i in serving}, state)
    costs = [CostBreakdown(*t) for t in terms]
    admissible = [c for c in costs if not c.reject]
    if not admissible:
        live = any(c.reject not in ("unhealthy", "stale") for c in costs)
        return _finish(state, "overload" if live else "no-instance", None, costs, lease)
    best = min(admissible, key=lambda c: (c.total, c.instance_id))
    return _finish(state, "cost", best.instance_id, costs, lease)


def _pressure(i: InstanceState) -> int:
    return i.running + i.waiting + i.overlay_calls


def decide_least_pressure(state: PlacementState, now: float) -> Decision:
    """Baseline (§5.3): the least-loaded healthy instance that serves the model, residency ignored."""
    costs = [breakdown(i, state) for i in _serving(state)]
    ok = [i for i in _serving(state) if i.healthy and i.fresh]
    if not ok:
        return _finish(state, "no-instance", None, costs, "none")
    best = min(ok, key=lambda i: (_pressure(i), i.instance_id))
    return _finish(state, "least-pressure", best.instance_id, costs, "none")


def decide_sticky(state: PlacementState, now: float) -> Decision:
    """Baseline (§5.3): a session stays on its first instance while it is healthy; else least-pressure."""
    s = state.session
    if s is not None and s.model == state.request.model:
        for i in _serving(state):
            if i.instance_id == s.first_instance and i.healthy and i.fresh:
                costs = [breakdown(x, state) for x in _serving(state)]
                return _finish(state, "sticky", i.instance_id, costs, "none")
    return decide_least_pressure(state, now)


def decide_round_robin(state: PlacementState, now: float) -> Decision:
    costs = [breakdown(i, state) for i in _serving(state)]
    ok = sorted((i for i in _serving(state) if i.healthy and i.fresh), key=lambda i: i.instance_id)
    if not ok:
        return _finish(state, "no-instance", None, costs, "none")
    return _finish(state, "round-robin", ok[state.seq % len(ok)].instance_id, costs, "none")


_DECIDE = {
    "full": decide_full,
    "least-pressure": decide_least_pressure,
    "session-sticky": decide_sticky,
    "round-robin": decide_round_robin,
}


def decide(state: PlacementState, now: float) -> Decision:
    """Place one call with the policy named in ``state.params.policy``. Pure; mutates nothing."""
    try:
        fn = _DECIDE[state.params.policy]
    except KeyError:
        raise ValueError(f"unknown placement policy {state.params.policy!r}; choose one of {POLICIES}") from None
    return fn(state, now)
