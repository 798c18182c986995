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

    + imposed  (``charge_imposed``, default on; only where r's model is active on i, i.e. r joins its batch)
    imposed = expected_decode * (step(n + 1) - step(1))   [+ n * (suffix prefill [+ C_KV when recomputed])]
             n = running + overlay_calls: each of r's decode steps is slower by the learned decode-by-batch
             slope for all n together; with ``imposed_prefill`` also r's prefill stalling each of them once
             (off by default: charged only where r joins an active batch, never for the calls a switch on a
             cold instance displaces, it tilted the simulator's cold instances toward switching -- bench/README.md)

§3.3 says dR_req charges "the incremental queue, prefill, and decode work introduced by r"; the terms above
it are r's own latency, and ``imposed`` is the rest of the work r introduces: the latency it adds to the
calls already running there. Without it, a return follows its device-resident prefix onto a busy instance
whenever that is cheapest *for itself*, and the decode batches pile up on the instances holding KV (the
two-model workload of 90 ms of decode per call against 69 for a least-pressure router that only
balances). Charging the externality is the classic marginal-cost rule of load balancing: the sum of all
calls' latencies, not r's alone, is what a placement changes.

A fresh replica (the model is not resident on i) is admitted only when Eq. 2 holds::

    gain(m, i) > T_swap(m, i) + mu_i * dW_m + nu_m
    gain(m, i) = demand_m * max(0, W_existing - W_i)   (inf when no existing replica can admit r)
    mu_i       = hbm_price / max(0.05, 1 - kv_usage_i)  (price per GiB rises with memory pressure)

where W is the predicted latency of r without activation (dR_req + C_KV; the candidate's activation is the
threshold's T_swap), W_existing the best over instances where m is resident and admissible, and demand_m the
calls of m predicted over the control window (observed arrival rate * window + live leases of m).

A cold instance time-shares the models of its weight bank in rounds, so every catalog model is "loaded" there
and a call of any of them is a switch, never an open. What such a call can still do is add its model to the
instance's *rotation* (``ModelRes.in_rotation``: the models with a call there or a session's KV on its
device): a "join". A join costs more than its own switch: every later round on that instance carries the
switch into the model and back out, paid by the calls of the other models waiting there, and once the
rotation outgrows what the device can keep staged those switches come from host memory. Eq. 1 prices only
this call's switch (cheap when the model happens to be staged), so a new session was placed where its model
was merely staged, spreading every model over every instance (the residency regime, ``bench/matrix.py``). A
join is therefore a replica opening in §3.3's sense and gated by Eq. 2, with the instance's measured switch
pair from host (``rotation_cost``) in place of mu dW + nu (it adds no weights to the device: the model takes
the device only in its own slot). For a join, W_existing is the existing replicas' Eq. 1 *total*, their
switch and slot wait included: a model that time-shares an instance with another waits for its switch at
nearly every call when its calls come one at a time between tool gaps, and that is queueing a join removes
(without it, two models switching from host at 1.4 s on one instance showed 0.3 s of queue, no join passed,
and one repetition of the residency regime ran 39.9 s SCT p50 against 5.1-5.4 s). For an open it stays
without activation, as above: counting it there raised the simulator's §5.3 testbed's avoidable opens at a
session every 4 s from 3 to 8 (median of seeds 0-4), where the calls of a busy model share one slot and its
switch. Where switches cost milliseconds the gate costs nothing; where they cost
seconds it keeps a model on the instances already serving it until their queues make a join pay
(``rotation_eq2``, default on; the ``no-rotation-eq2`` matrix row turns it off).

Eq. 2 gates every open, a lease's included: a lease whose instance no longer has the model resident (it
switched away or closed it during the tool gap) is honoured only if Eq. 2 admits the open there (lease
``eq2`` otherwise, and the call is placed by cost), since §3.3 opens a replica "only when the predicted demand
benefit exceeds the opening cost" and Algorithm 1's lease check (live, healthy, prefix valid) does not look
at model residency.

Scaling (``InstanceIndex``): a decision ranks only instances that serve or could open the model, read from
an index by served model that holds each instance's per-snapshot terms (queue pressure, memory capacity,
HBM price mu, activation cost per model), so a decision allocates no per-instance state beyond its
breakdown rows. Every instance where the model is resident/staged is ranked (Eq. 1 and W_existing need
all of them). Replica-opening candidates are bounded by ``PolicyParams.replica_shortlist`` (k, default
16; 0 = no bound): when more than k instances would have to open the model, only the k healthy, fresh,
least-pressured ones (key: queue pressure, then kv_usage, then instance id) that have KV-page headroom
for the call are ranked, plus any instance holding the session's prefix, lease or last placement. The
others are left out of ``Decision.costs`` and counted in ``Decision.shortlisted_out``. With
k >= the number of instances, the decision is identical to evaluating ``breakdown`` + ``apply_eq2`` over
every instance (tests/unit/test_router_placement_equivalence.py).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

from talaria.cost_curve import CostCurve, prefill_seconds

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
    replica_shortlist: int = 16  # replica-opening candidates ranked per decision (0 = all; see module doc)
    lease_policy: str = "fixed"  # "adaptive": windows from the predicted return gap (return_gap.py)
    lease_arithmetic: bool = True  # a lease is honoured only when it saves more than it delays (adaptive: also installed)
    lease_decay: bool = False  # adaptive: True = a live lease weighs on its instance by its decaying value; False = in full until it expires
    slot_wait: bool = True  # a cold instance's predicted wait for the model's slot is part of its activation cost
    retention_learned_gap: bool = False  # a fixed-tau lease's retention hint carries the learned gap (engine hold/eviction weigh by it)
    charge_imposed: bool = True  # Eq. 1's dR_req also charges the delay the call imposes on the running batch it joins
    imposed_prefill: bool = False  # ... including its prefill's stall of that batch (default: the decode slowdown only)
    queue_learned: bool = False  # the queue pressure is scaled by the measured/predicted queueing ratio (profiles.QueueBook)
    rotation_eq2: bool = True  # a call that adds its model to a cold instance's rotation is a replica opening, gated by Eq. 2 (module doc)

    @classmethod
    def from_config(cls, placement: object) -> PolicyParams:
        """The knobs of a ``talaria.config.PlacementConfig``, taken by field name (a knob added to both is
        wired with no third list); fields the config does not have keep their defaults."""
        given = {f.name: getattr(placement, f.name) for f in fields(cls) if hasattr(placement, f.name)}
        if "model_weights_gib" in given:
            given["model_weights_gib"] = dict(given["model_weights_gib"])
        return cls(**given)


@dataclass(frozen=True, slots=True)
class Profile:
    """Measured (EWMA) costs of one instance, seconds."""

    prefill_per_token: float
    decode_step: float
    restore_per_token: float
    switch_s: float  # resident but inactive model -> active
    staged_switch_s: float  # staged (partly pre-loaded) model -> active
    open_s: float  # model not resident -> active
    # learned curves (talaria.cost_curve) from the heartbeat; None = the scalars above price it
    prefill_by_context: CostCurve | None = None  # prefill seconds per token by context position
    decode_by_batch: CostCurve | None = None  # decode-step seconds by batch size

    def prefill_s(self, tokens: float, context_end: float) -> float:
        """Seconds to prefill ``tokens`` tokens ending at ``context_end`` (``tokens * prefill_per_token``
        while no curve is learned: the same arithmetic as before the curves)."""
        return prefill_seconds(self.prefill_by_context, self.prefill_per_token, tokens, context_end)

    def decode_step_at(self, batch: int) -> float:
        """Decode-step seconds with ``batch`` sequences (the scalar while no curve is learned)."""
        c = self.decode_by_batch
        return c.value(batch) if c is not None and c.measured else self.decode_step


@dataclass(frozen=True, slots=True)
class ModelRes:
    loaded: bool = False  # weights resident (a replica exists here)
    active: bool = False  # currently serving (hot: always)
    staged: bool = False  # weights (partly) pre-staged for a switch
    wait_s: float = 0.0  # cold instance with rounds: predicted seconds until the switch into this model starts (engine-reported)
    # cold instance: the model is in its rotation (active, calls queued or running, or a session's KV on the
    # device); False: a call of it adds the model to the rotation (a "join", gated by Eq. 2 like an open)
    in_rotation: bool = True
    # this model's own measured costs on the instance (its peers' for the same model where it has
    # measured none); None: the instance's profile prices it. Switch costs are always the instance's.
    profile: Profile | None = None


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
    host_kv: bool = False  # restores any prefix the cluster's shared host KV store holds (``host_prefix``)
    queue_scale: float = 1.0  # measured / predicted queueing here (``profiles.QueueBook``; 1 = the configured weights as they are)


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
    gap_mu: float = 0.0  # predicted return gap (services/router/return_gap.py); sigma 0 = fixed tau
    gap_sigma: float = 0.0


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
    # Prebuilt index of exactly ``instances`` (the gateway keeps one per snapshot set); used only while its
    # version still equals ``index_version``, else the policy builds one from ``instances``.
    index: InstanceIndex | None = None
    index_version: int = -1


class CostBreakdown(NamedTuple):
    """Eq. 1 terms, checks and Eq. 2 gate of one instance (a named tuple: cheap to build per candidate;
    always built by field name, ``_eq1`` and ``_eq2``)."""

    instance_id: str
    delta_r: float  # dR_req: queue + suffix prefill + decode (+ the delay imposed on the batch it joins, `charge_imposed`)
    c_kv: float
    c_act: float
    total: float
    queue_s: float
    kv_source: str  # "device" | "host" | "recompute" | "none"
    act: str  # "active" | "switch" | "join" (a switch that adds the model to a cold instance's rotation) | "open"
    fresh_replica: bool
    predicted_ttft_s: float
    pages_needed: int
    eq2_gain: float | None = None  # set for fresh replicas
    eq2_threshold: float | None = None
    reject: str = ""  # "" admitted | "unhealthy" | "stale" | "round-admission" | "memory" | "eq2"


_tuple_new = tuple.__new__
_REPLICA_ACTS = ("open", "join")  # activations Eq. 2 gates: a new replica, or a model new to a cold instance's rotation


def cost_breakdown(
    *, instance_id: str, delta_r: float, c_kv: float, c_act: float, queue_s: float, kv_source: str, act: str,
    predicted_ttft_s: float, pages_needed: int, eq2_gain: float | None = None, eq2_threshold: float | None = None,
    reject: str = "",
) -> CostBreakdown:
    """Build a ``CostBreakdown`` by field name (keyword-only; ``total`` = Eq. 1's sum and ``fresh_replica`` =
    the model must be opened, derived here). About twice as fast as the named tuple's own keyword
    constructor, which matters once per candidate per decision."""
    return _tuple_new(CostBreakdown, (
        instance_id, delta_r, c_kv, c_act, delta_r + c_kv + c_act, queue_s, kv_source, act, act in _REPLICA_ACTS, predicted_ttft_s,
        pages_needed, eq2_gain, eq2_threshold, reject,
    ))


assert CostBreakdown._fields == (
    "instance_id", "delta_r", "c_kv", "c_act", "total", "queue_s", "kv_source", "act", "fresh_replica", "predicted_ttft_s",
    "pages_needed", "eq2_gain", "eq2_threshold", "reject",
), "cost_breakdown builds the fields in this order"


@dataclass(frozen=True, slots=True)
class Decision:
    instance_id: str | None
    policy: str
    reason: str  # "lease" | "cost" | "least-pressure" | "sticky" | "round-robin" | "overload" | "no-instance"
    #             (the gateway rewrites a decision as "start-now" or "late": services/router/gateway.py)
    lease: str = "none"  # "none" | "hit" | "expired" | "unhealthy" | "prefix-invalid" | "outweighed" (adaptive)
    #                      | "eq2" (honouring it would open a replica Eq. 2 rejects: ``_eq2_denies``)
    costs: tuple[CostBreakdown, ...] = ()
    opens_model: bool = False  # the chosen instance must open the model (not resident there)
    switches_model: bool = False  # ... must switch to a resident/staged model (a join included)
    avoidable_open: bool = False  # ... opens it although another healthy instance has it resident
    retry_after_s: float = 0.0  # overload: when trying again makes sense
    shortlisted_out: int = 0  # replica-opening instances not ranked (over the replica_shortlist bound)
    lease_held_s: float = 0.0  # how long the judged lease had been held (accounting of device KV held by leases)
    lease_tokens: int = 0  # its committed tokens
    joins_rotation: bool = False  # the switch adds the model to the chosen cold instance's rotation (act "join")
    avoidable_join: bool = False  # ... although another healthy instance has the model in its rotation

    def chosen(self) -> CostBreakdown | None:
        return next((c for c in self.costs if c.instance_id == self.instance_id), None)

    def as_dict(self) -> dict[str, Any]:
        """The decision as plain JSON-compliant values (``/router/decisions``): an unbounded Eq. 2 gain (no
        resident replica could admit the call) is the string "inf", as JSON has no infinity. Pure."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["costs"] = [{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in c._asdict().items()} for c in self.costs]
        return d

    def attributes(self) -> dict[str, str | bool | float | int | list[str]]:
        """The decision as trace span attributes (``talaria.placement.*``): reason, chosen instance, policy,
        lease outcome, the open/switch flags, the candidates, every candidate's Eq. 1 row as JSON
        (``talaria.placement.costs``) and the chosen one's terms (``talaria.placement.cost.<term>``). Pure."""
        attrs: dict[str, str | bool | float | int | list[str]] = {"talaria.placement.reason": self.reason}
        if self.instance_id:
            attrs["talaria.placement.instance"] = self.instance_id
        if self.policy:
            attrs["talaria.placement.policy"] = self.policy
        if self.lease:
            attrs["talaria.placement.lease"] = self.lease
        attrs["talaria.placement.opens_model"] = self.opens_model
        attrs["talaria.placement.switches_model"] = self.switches_model
        attrs["talaria.placement.avoidable_open"] = self.avoidable_open
        attrs["talaria.placement.joins_rotation"] = self.joins_rotation
        if self.costs:
            attrs["talaria.placement.candidates"] = [c.instance_id for c in self.costs]
            rows = []
            for c in self.costs:
                row = {k: getattr(c, k) for k in _SPAN_TERMS}
                rows.append(row)
                if c.instance_id == self.instance_id:
                    for k, v in row.items():
                        if k != "instance_id":
                            attrs[f"talaria.placement.cost.{k}"] = v
            attrs["talaria.placement.costs"] = json.dumps(rows, separators=(",", ":"), default=str)
        return attrs


_SPAN_TERMS = ("instance_id", "total", "delta_r", "c_kv", "c_act", "queue_s", "kv_source", "act", "reject")  # a cost row on a span


# ----------------------------------------------------------------------------------------- cost model


def kv_state_on(inst: InstanceState, req: CallRequest, session: SessionView | None, lease: LeaseView | None,
                shared_host: int = 0) -> tuple[str, int]:
    """Where ``req``'s session prefix is on ``inst`` ("device" | "host" | "recompute" | "none") and its length.

    The snapshot is the source; a completion newer than the snapshot (hook or lease) is trusted for the
    instance that served it, since the snapshot cannot know it yet. ``shared_host``: the prefix tokens the
    shared host KV store holds (``host_prefix``), restorable by every instance with a host tier.
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
    if shared_host > 0 and inst.host_kv:
        return "host", shared_host
    if committed > 0:
        return "recompute", committed
    return "none", 0


def host_prefix(state: PlacementState, idx: InstanceIndex | None = None) -> int:
    """The longest prefix of the call's session (for its model) that some instance reports as checkpointed in
    the host KV store and no longer on its device (``KV_HOST``), 0 if none. The store is one registry for
    the cluster (``services/kvstore``): any instance with a host tier on it (``InstanceState.host_kv``, from
    its heartbeat) restores that prefix as the instance that wrote it would, so placement prices it
    as a restore there, not a recompute (the two-model sessions' leases pinned returns to the
    instance that had checkpointed them, which had switched models meanwhile, while the least-pressure
    router restored them on an idle instance). Device-only copies are not counted: a write-back tier or a
    checkpoint still in flight may not have them in the store yet. Pure (reads ``idx`` when given)."""
    req = state.request
    if not req.session_id:
        return 0
    key = (req.session_id, req.model)
    if idx is not None:
        holders = [idx.by_id[i] for i in idx.kv_sessions.get(key, ()) if i in idx.by_id]
    else:
        holders = list(state.instances)
    best = 0
    for inst in holders:
        entry = inst.kv.get(key)
        if entry is not None and entry[0] == KV_HOST and entry[1] > best:
            best = entry[1]
    return best


def queue_pressure(inst: InstanceState, admission_unit: float, running_weight: float, leases: int) -> float:
    """Calls ahead of a new one, in units of a mean call (Eq. 1's dR_req): waiting + forwarded since the
    snapshot + ``admission_unit`` per live lease + ``running_weight`` per running call, times the instance's
    measured ``queue_scale`` (1 unless ``queue_learned``). The one pressure formula."""
    return inst.queue_scale * (inst.waiting + inst.overlay_calls + admission_unit * leases + running_weight * inst.running)


def calls_on(inst: InstanceState) -> int:
    """Calls on an instance (running + waiting + forwarded since its snapshot): the KV-page memory check's
    count, and the least-pressure baseline's key."""
    return inst.running + inst.waiting + inst.overlay_calls


def hbm_price(price_s_per_gib: float, kv_usage: float) -> float:
    """Eq. 2's mu_i: the HBM price per GiB, rising with the instance's memory pressure."""
    return price_s_per_gib / max(0.05, 1.0 - kv_usage)


def activation(inst: InstanceState, model: str, rotation_eq2: bool = True) -> tuple[str, float]:
    """Eq. 1's C_act for ``model`` on ``inst`` and how it activates: "active" | "switch" | "join" | "open".
    A "join" is a switch into a loaded model outside a cold instance's rotation (``ModelRes.in_rotation``):
    priced as the switch, and gated by Eq. 2 (``_eq2``) when ``rotation_eq2``. Pure."""
    res = inst.models[model]
    if res.active:  # 0 while its slot admits calls mid-way; a draining slot quotes its model's next slot
        return "active", res.wait_s
    # a cold instance serving other models first: the call also waits for this model's slot
    if res.loaded or res.staged:
        act = "join" if rotation_eq2 and not res.in_rotation and inst.pool == "cold" else "switch"
        if res.staged:  # loaded and (partly) staged in the device's KV tail: the cheaper path
            return act, inst.profile.staged_switch_s + res.wait_s
        return act, inst.profile.switch_s + res.wait_s
    return "open", inst.profile.open_s + res.wait_s


def rotation_cost(inst: InstanceState) -> float:
    """Eq. 2's penalty for a join: the switch pair (into the model and back out to the others) that a model
    added to a cold instance's rotation puts into its rounds, at the instance's measured cost of a switch
    from host memory (``Profile.switch_s``). Seconds; pure."""
    return 2.0 * inst.profile.switch_s


class _Call(NamedTuple):
    """Per-call constants of Eq. 1 (the same for every instance)."""

    prompt_tokens: int
    need_tokens: int  # prompt + max_tokens: the call's KV pages
    call_tokens: int  # a mean call's prompt + decode: KV pages per call already on the instance
    s_suf: float  # mean call: suffix tokens (queue_s)
    s_dec: float  # mean call: decode tokens
    dec: float  # this call's expected decode tokens
    budget: float  # round-admission budget (seconds to first token)
    s_prompt: float  # mean call: prompt tokens (where its suffix ends: the learned prefill curve's position)


def _call(state: PlacementState) -> _Call:
    req, shape = state.request, state.shape
    return _Call(
        req.prompt_tokens, req.prompt_tokens + req.max_tokens, int(shape.prompt_tokens + shape.decode_tokens),
        shape.suffix_tokens, shape.decode_tokens, req.expected_decode, state.params.admission_budget_s, shape.prompt_tokens,
    )


def _eq1(e: _Entry, pressure: float | None, kv_source: str, prefix: int, c_kv: float | None, c: _Call) -> CostBreakdown:
    """Eq. 1 for one instance plus the round-admission and memory checks (no Eq. 2), from the instance's
    per-snapshot terms ``e`` and where the call's prefix is on it (``pressure`` None: the entry's;
    ``c_kv`` None: the prefix is recomputed there). The one place Eq. 1 is written."""
    _, iid, ppt, ds, e_pressure, calls, cap, pages_total, page, _, act, c_act, reject, curve, joins, slowdown, _ = e  # once (hot path)
    if pressure is None:
        pressure = e_pressure
    prompt_tokens, need_tokens, call_tokens, s_suf, s_dec, dec, budget, s_prompt = c
    if curve is None:  # scalar costs (no learned curve yet)
        if c_kv is None:
            c_kv = prefix * ppt if prefix > 0 else 0.0
        queue_s = (s_suf * ppt + s_dec * ds) * pressure
        suffix_s = max(1, prompt_tokens - prefix) * ppt
    else:  # prefill priced by the learned per-context curve
        if c_kv is None:
            c_kv = curve.prefill_s(prefix, prefix) if prefix > 0 else 0.0
        queue_s = (curve.prefill_s(s_suf, s_prompt) + s_dec * ds) * pressure
        suffix_s = curve.prefill_s(max(1, prompt_tokens - prefix), prompt_tokens)
    delta_r = queue_s + suffix_s + dec * ds
    if joins:  # the delay imposed on the batch it joins: its prefill stalls each of them ...
        delta_r += joins * (suffix_s + (c_kv if kv_source == "recompute" else 0.0))
    if slowdown:  # ... and its decode slows their steps
        delta_r += slowdown * dec
    ttft = queue_s + c_kv + c_act + suffix_s
    resident = prefix // page if kv_source == "device" else 0
    pages_needed = max(0, -(-need_tokens // page) - resident)
    if not reject:
        if ttft > budget:
            reject = "round-admission"
        elif pages_total > 0 and pages_needed > cap - calls * -(-call_tokens // page):
            reject = "memory"
    return cost_breakdown(
        instance_id=iid, delta_r=delta_r, c_kv=c_kv, c_act=c_act, queue_s=queue_s, kv_source=kv_source, act=act,
        predicted_ttft_s=ttft, pages_needed=pages_needed, reject=reject,
    )


def _c_kv(kv_source: str, prefix: int, prof: Profile) -> float:
    if kv_source == "host":
        return prefix * prof.restore_per_token
    return prof.prefill_s(prefix, prefix) if kv_source == "recompute" and prefix > 0 else 0.0


def _eq1_special(e: _Entry, state: PlacementState, c: _Call, shared_host: int = 0) -> CostBreakdown:
    """Eq. 1 on an instance whose KV state for this call may differ from the generic one (session prefix
    listed, the lease's or the session's last instance): its own prefix, and the lease reserved for this
    very call is not queue ahead of it. ``shared_host``: ``host_prefix`` of the state."""
    inst = e.inst
    kv_source, prefix = kv_state_on(inst, state.request, state.session, state.lease, shared_host)
    pressure = e.pressure
    if state.lease is not None and state.lease.instance_id == inst.instance_id and inst.overlay_leases > 0:
        p = state.params  # the lease reserved for this very call is not queue ahead of it (weighted: <= 1)
        pressure = queue_pressure(inst, p.admission_unit, p.running_weight, max(0, inst.overlay_leases - 1))
    return _eq1(e, pressure, kv_source, prefix, _c_kv(kv_source, prefix, e.prof), c)


def breakdown(inst: InstanceState, state: PlacementState, idx: InstanceIndex | None = None) -> CostBreakdown:
    """Eq. 1 for one instance plus the round-admission and memory checks (no Eq. 2). ``idx`` (the state's
    index) finds the session's host prefix among the instances that list it instead of scanning them all."""
    return _eq1_special(_entry(inst, state.request.model, state.params), state, _call(state), host_prefix(state, idx))


def apply_eq2(costs: Sequence[CostBreakdown], by_id: Mapping[str, InstanceState], state: PlacementState) -> list[CostBreakdown]:
    """``_eq2`` with each instance's mu computed from ``by_id`` (the reference path of the tests)."""
    price = state.params.hbm_price_s_per_gib
    return _eq2(costs, [(hbm_price(price, by_id[c.instance_id].kv_usage), rotation_cost(by_id[c.instance_id])) for c in costs], state)


def _eq2(costs: Sequence[CostBreakdown], prices: Sequence[tuple[float, float]], state: PlacementState) -> list[CostBreakdown]:
    """Gate fresh replicas by Eq. 2: each fresh replica gets its gain and threshold, and is rejected
    ("eq2") unless the gain exceeds its threshold: T_swap + mu * dW + nu for an open, T_swap + the
    instance's ``rotation_cost`` for a join (no weights are added to the device: the model is in the
    instance's weight bank and takes the device only in its own slot; what it adds is a switch pair to the
    rounds). ``prices``: per row, (mu, rotation cost) of its instance. Returns the breakdowns with those
    filled in (the others unchanged). The one place Eq. 2 is written."""
    if not any(c.fresh_replica and not c.reject for c in costs):
        return list(costs)
    p, m = state.params, state.request.model
    existing = [c for c in costs if not c.fresh_replica and not c.reject]
    # an open's W_existing without the existing replicas' activation, a join's with it (module doc)
    w_existing = min((c.delta_r + c.c_kv for c in existing), default=math.inf)
    w_existing_join = min((c.total for c in existing), default=math.inf)
    demand = max(1.0, state.demand.get(m, 0.0))
    d_w = p.model_weights_gib.get(m, p.default_weights_gib)
    out = []
    for c, (mu, rotation) in zip(costs, prices):
        if c.fresh_replica and not c.reject:
            w = w_existing_join if c.act == "join" else w_existing
            gain = math.inf if math.isinf(w) else demand * max(0.0, w - (c.delta_r + c.c_kv))
            threshold = c.c_act + (rotation if c.act == "join" else mu * d_w + p.replica_penalty_s)
            c = cost_breakdown(
                instance_id=c.instance_id, delta_r=c.delta_r, c_kv=c.c_kv, c_act=c.c_act, queue_s=c.queue_s,
                kv_source=c.kv_source, act=c.act, predicted_ttft_s=c.predicted_ttft_s, pages_needed=c.pages_needed,
                eq2_gain=gain, eq2_threshold=threshold, reject="" if gain > threshold else "eq2",
            )
        out.append(c)
    return out


# ------------------------------------------------------------------------------------ candidate index


class _Entry(NamedTuple):
    """Per-snapshot terms of one instance for one model it serves (computed once per ``InstanceState``)."""

    inst: InstanceState
    iid: str
    ppt: float  # prefill_per_token
    ds: float  # decode_step
    pressure: float  # waiting + overlay_calls + admission_unit * leases + running_weight * running
    calls: int  # running + waiting + overlay_calls (memory check)
    cap: float  # kv_pages_total * (1 - hbm_reserve_fraction)
    pages_total: int
    page: int
    eq2_prices: tuple[float, float]  # Eq. 2: (HBM price mu, rotation cost) of the instance
    act: str
    c_act: float
    base_reject: str  # "unhealthy" | "stale" | ""
    curve: Profile | None  # the profile when it has learned curves, else None: the scalars price
    joins: int  # calls whose prefill stall is charged (running + forwarded since the snapshot); 0: none or not charged
    slowdown: float  # seconds per decode step imposed on the running + forwarded calls together (their count x the per-sequence slope)
    prof: Profile  # the costs of this model on this instance (``model_profile``)


def _imposed_terms(inst: InstanceState, prof: Profile, act: str, p: PolicyParams) -> tuple[int, float]:
    """(calls whose prefill stall is charged, decode seconds per step imposed on the batch) for ``_eq1``'s
    imposed-delay term: only when the call's model is active there (otherwise it runs in its own slot, beside
    nobody); ``imposed_prefill`` False charges the decode slowdown only."""
    if not p.charge_imposed or act != "active":
        return 0, 0.0
    n = inst.running + inst.overlay_calls
    if n <= 0:
        return 0, 0.0
    # n x the per-sequence slope of the decode step; the learned curve is bucketed by powers of two, so the
    # slope is the secant from batch 1 to n + 1 (linear step model: step(b) = a + s b, n s = step(n+1) - step(1))
    return (n if p.imposed_prefill else 0), max(0.0, prof.decode_step_at(n + 1) - prof.decode_step_at(1))


def model_profile(inst: InstanceState, model: str) -> Profile:
    """The costs a call of ``model`` is priced with on ``inst``: the model's own (``ModelRes.profile``), else
    the instance's. A cold instance time-shares models of different sizes; its instance profile is the
    active model's, so pricing every model with it priced a 7B call on an instance holding a 0.5B one at the
    0.5B's speed. Pure."""
    res = inst.models.get(model)
    return res.profile if res is not None and res.profile is not None else inst.profile


def _entry(inst: InstanceState, model: str, p: PolicyParams) -> _Entry:
    """The per-snapshot terms of ``inst`` for ``model`` (computed once per snapshot by the index)."""
    prof = model_profile(inst, model)
    act, c_act = activation(inst, model, p.rotation_eq2)
    joins, slowdown = _imposed_terms(inst, prof, act, p)
    return _Entry(
        inst, inst.instance_id, prof.prefill_per_token, prof.decode_step_at(inst.running + 1),
        queue_pressure(inst, p.admission_unit, p.running_weight, inst.overlay_leases), calls_on(inst),
        inst.kv_pages_total * (1.0 - p.hbm_reserve_fraction), inst.kv_pages_total, max(1, inst.page_size),
        (hbm_price(p.hbm_price_s_per_gib, inst.kv_usage), rotation_cost(inst)), act, c_act,
        "unhealthy" if not inst.healthy else ("stale" if not inst.fresh else ""),
        prof if prof.prefill_by_context is not None or prof.decode_by_batch is not None else None,
        joins, slowdown, prof,
    )


def _index_params(p: PolicyParams) -> tuple[float, float, float, float, bool, bool, bool]:
    return (p.admission_unit, p.running_weight, p.hbm_reserve_fraction, p.hbm_price_s_per_gib, p.charge_imposed, p.imposed_prefill,
            p.rotation_eq2)


# a replica-opening entry's shortlist key: (rejected by its base checks, queue pressure, KV usage, instance id)
_OpenKey = tuple[bool, float, float, str]


class InstanceIndex:
    """Instances by served model with their per-snapshot terms precomputed; the replica-opening
    candidates of each model kept sorted by (unfit, pressure, kv_usage, id) for the shortlist.

    Mutable: ``put``/``remove`` update it in O(models served + sessions listed) and bump ``version``;
    the gateway keeps one across decisions. ``build`` makes one for a given instance list; with
    ``scope=(session_id, model)`` it indexes only that model and that session's KV (a one-call index,
    what the policy builds when a state carries no valid prebuilt one)."""

    def __init__(self, params: PolicyParams, scope: tuple[str, str] | None = None):
        self.params = params
        self.scope = scope
        self.key = _index_params(params)
        self.version = 0
        self.by_id: dict[str, InstanceState] = {}
        self.serving: dict[str, dict[str, _Entry]] = {}  # model -> id -> entry, in instance order
        self.opening: dict[str, list[_OpenKey]] = {}  # model -> sorted shortlist keys of replica-opening entries
        self.kv_sessions: dict[tuple[str, str], set[str]] = {}  # (session, model) -> ids with device/host KV
        self._pos: dict[str, int] = {}
        self._keys: dict[str, dict[str, _OpenKey]] = {}  # id -> model -> its key in opening[model]

    @classmethod
    def build(cls, instances: Iterable[InstanceState], params: PolicyParams, scope: tuple[str, str] | None = None) -> InstanceIndex:
        idx = cls(params, scope)
        for i in instances:
            idx.put(i)
        return idx

    def __len__(self) -> int:
        return len(self.by_id)

    def put(self, inst: InstanceState) -> None:
        """Add or replace an instance (keeps its position in the instance order)."""
        iid = inst.instance_id
        old = self.by_id.get(iid)
        if old is inst:
            return
        self.version += 1
        if iid not in self._pos:
            self._pos[iid] = len(self._pos)
        if old is not None:
            for m, key in self._keys.pop(iid, {}).items():
                lst = self.opening[m]
                del lst[bisect_left(lst, key)]
            for m in old.models:
                if m not in inst.models and m in self.serving:
                    self.serving[m].pop(iid, None)
            if old.kv is not inst.kv:
                self._unindex_kv(old)
        self.by_id[iid] = inst
        if old is None or old.kv is not inst.kv:
            if self.scope is None:
                kv_items: Iterable[tuple[tuple[str, str], tuple[int, int]]] = inst.kv.items()
            else:
                got = inst.kv.get(self.scope)
                kv_items = () if got is None else ((self.scope, got),)
            for session_model, (state, tokens) in kv_items:
                if tokens > 0 and state in (KV_DEVICE, KV_HOST):
                    self.kv_sessions.setdefault(session_model, set()).add(iid)
        keys = {}
        served: Iterable[str] = inst.models if self.scope is None else ((self.scope[1],) if self.scope[1] in inst.models else ())
        for m in served:
            e = _entry(inst, m, self.params)
            act, base, pressure = e.act, e.base_reject, e.pressure
            d = self.serving.setdefault(m, {})
            if iid not in d and d and self._pos[next(reversed(d))] > self._pos[iid]:
                d[iid] = e  # re-added out of order: restore the instance order
                self.serving[m] = dict(sorted(d.items(), key=lambda kv: self._pos[kv[0]]))
            else:
                d[iid] = e
            if act in _REPLICA_ACTS:
                key = (bool(base), pressure, inst.kv_usage, iid)
                insort(self.opening.setdefault(m, []), key)
                keys[m] = key
        if keys:
            self._keys[iid] = keys

    def remove(self, iid: str) -> None:
        old = self.by_id.pop(iid, None)
        if old is None:
            return
        self.version += 1
        for m, key in self._keys.pop(iid, {}).items():
            lst = self.opening[m]
            del lst[bisect_left(lst, key)]
        for m in old.models:
            if m in self.serving:
                self.serving[m].pop(iid, None)
        self._unindex_kv(old)

    def _unindex_kv(self, old: InstanceState) -> None:
        iid = old.instance_id
        for key in old.kv:
            ids = self.kv_sessions.get(key)
            if ids is not None:
                ids.discard(iid)
                if not ids:
                    del self.kv_sessions[key]


def index_of(state: PlacementState) -> InstanceIndex:
    """The state's prebuilt index if it is still the one describing ``state.instances``, else a new one."""
    idx = state.index
    if (
        idx is not None
        and idx.scope is None
        and idx.version == state.index_version
        and idx.key == _index_params(state.params)
        and len(idx.by_id) == len(state.instances)
    ):
        return idx
    idx = InstanceIndex.build(state.instances, state.params, (state.request.session_id, state.request.model))
    if len(idx.by_id) != len(state.instances):
        raise ValueError("duplicate instance ids in PlacementState.instances")
    return idx


def _rank(state: PlacementState, idx: InstanceIndex, shortlist: bool) -> tuple[list[CostBreakdown], list[tuple[float, float]], int]:
    """Eq. 1 breakdowns of the candidates of ``state.request.model`` in instance order, with their Eq. 2 prices
    (mu, rotation cost); plus
    how many replica-opening instances the shortlist left out.

    Instances whose KV state for this call may differ from the generic one (session prefix listed, the
    lease's or the session's last instance) go through ``_eq1_special``; the rest share the generic
    prefix (the session's committed tokens, recomputed, or none). Both end in ``_eq1``."""
    req, p, session, lease = state.request, state.params, state.session, state.lease
    m = req.model
    serving = idx.serving.get(m)
    if not serving:
        return [], [], 0
    special: set[str] = set(idx.kv_sessions.get((req.session_id, m), ())) if req.session_id else set()
    committed = 0
    if session is not None and session.model == m:
        committed = session.committed_tokens
        special.add(session.last_instance)
    if lease is not None:  # the lease is discounted from its instance's queue whatever its model
        special.add(lease.instance_id)
    src = "recompute" if committed > 0 else "none"
    shared = host_prefix(state, idx)
    c = _call(state)
    selected = _shortlist(idx.opening.get(m, ()), serving, c, p.replica_shortlist) if shortlist else None
    rows: list[CostBreakdown] = []
    mus: list[tuple[float, float]] = []
    left_out = 0
    append, mu_append = rows.append, mus.append
    for iid, e in serving.items():
        if iid in special:
            append(_eq1_special(e, state, c, shared))
        elif selected is not None and iid not in selected and e.act in _REPLICA_ACTS:
            left_out += 1
            continue
        elif shared > 0 and e.inst.host_kv:  # restores the shared host prefix
            append(_eq1(e, None, "host", shared, shared * e.prof.restore_per_token, c))
        else:
            append(_eq1(e, None, src, committed, None, c))
        mu_append(e.eq2_prices)
    return rows, mus, left_out


def _shortlist(opening: Sequence[_OpenKey], serving: Mapping[str, _Entry], c: _Call, k: int) -> set[str] | None:
    """The k healthy, fresh, least-pressured replica-opening instances with KV-page headroom for the call
    (None: no bound, every one is ranked)."""
    if k <= 0 or len(opening) <= k:
        return None
    selected: set[str] = set()
    for key in opening:
        if key[0]:
            break  # unhealthy / stale: never admissible
        e = serving[key[3]]
        if e.pages_total > 0 and -(-c.need_tokens // e.page) > e.cap - e.calls * -(-c.call_tokens // e.page):
            continue  # no KV-page headroom for this call
        selected.add(e.iid)
        if len(selected) >= k:
            break
    return selected


# ------------------------------------------------------------------------------------------ decisions


def _serving(state: PlacementState) -> list[InstanceState]:
    return [i for i in state.instances if state.request.model in i.models]


def _finish(
    state: PlacementState, reason: str, chosen: str | None, costs: Sequence[CostBreakdown], lease: str,
    idx: InstanceIndex | None = None, left_out: int = 0,
) -> Decision:
    m = state.request.model
    opens = switches = avoidable = joins = avoidable_join = False
    c = next((x for x in costs if x.instance_id == chosen), None)
    if c is not None:
        opens, joins = c.act == "open", c.act == "join"
        switches = joins or c.act == "switch"
        if opens or joins:
            pool = [e.inst for e in idx.serving.get(m, {}).values()] if idx is not None else _serving(state)
            # an open is avoidable where another instance has the model resident (§5.3), a join where another
            # has it in its rotation
            elsewhere = any(i.instance_id != chosen and i.healthy and i.models[m].loaded and (opens or i.models[m].in_rotation) for i in pool)
            avoidable, avoidable_join = (elsewhere, False) if opens else (False, elsewhere)
    retry = 0.0
    if chosen is None and costs:
        retry = max(state.params.retry_after_s, min(x.predicted_ttft_s for x in costs) - state.params.admission_budget_s)
    elif chosen is None:
        retry = state.params.retry_after_s
    return Decision(chosen, state.params.policy, reason, lease, tuple(costs), opens, switches, avoidable, retry, left_out,
                    joins_rotation=joins, avoidable_join=avoidable_join)


def lease_check(state: PlacementState, now: float, idx: InstanceIndex | None = None) -> str:
    """Algorithm 1 lines 2-9: "hit", or why the lease cannot be honoured ("none" if there is none)."""
    lease, req = state.lease, state.request
    if lease is None or lease.model != req.model:
        return "none"
    if now >= lease.t_exp_unix:
        return "expired"
    if idx is not None:
        inst = idx.by_id.get(lease.instance_id)
    else:
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
    idx = index_of(state)
    lease = lease_check(state, now, idx)
    if lease == "hit":
        assert state.lease is not None
        inst = idx.by_id[state.lease.instance_id]
        mine = breakdown(inst, state, idx)
        p = state.params
        if mine.fresh_replica and _eq2_denies(state, idx, mine):
            lease = "eq2"
        elif not p.lease_arithmetic or not _outweighed(state, idx, mine):
            return _held(_finish(state, "lease", inst.instance_id, [mine], "hit", idx), state.lease, now)
        else:
            lease = "outweighed"
    # A lease that failed its check is discarded; placement continues as if there were none.
    judged = state.lease
    if lease != "none":
        state = replace(state, lease=None)
    rows, mus, left_out = _rank(state, idx, shortlist=True)
    costs = _eq2(rows, mus, state)
    best = min((c for c in costs if not c.reject), key=_rank_key, default=None)
    if best is None:
        live = any(c.reject not in ("unhealthy", "stale") for c in costs)
        return _held(_finish(state, "overload" if live else "no-instance", None, costs, lease, idx, left_out), judged, now)
    return _held(_finish(state, "cost", best.instance_id, costs, lease, idx, left_out), judged, now)


def _outweighed(state: PlacementState, idx: InstanceIndex, mine: CostBreakdown) -> bool:
    """The lease arithmetic at the return: the lease delays the call more than its resident prefix saves, i.e.
    another admissible instance has a lower Eq. 1 total than the leased one (its own lease not charged there):
    Eq. 1 already prices what the call pays on each instance *now* -- the device prefix against a restore or
    a recompute, the other's wait for its model's slot, both queues. The measured residency saving of a lease
    (``return_gap.ResidencyBook``) is an expectation over returns wherever they went, slot waits included; it
    prices the decision to reserve (``LeaseService.lease_costs``), not this one, where it would count the other
    instance's slot wait twice (until 2026-12-06 it was added here as a margin: returns stayed on a busier
    instance by up to the whole saving, seconds on the saturated testbed, and sessions moved half as often;
    without it mini-swe-agent's SCT p95 with adaptive leases was 0.988x [0.977-0.999] over 36 seeds,
    ``services/router/README.md``). When the leased instance no longer holds the prefix on the device (it
    switched models or evicted it; the prefix is in the host store, which other instances with a host tier
    restore from as well) the lease buys nothing and Eq. 1 decides the same way. Pure."""
    rows, mus, _ = _rank(state, idx, shortlist=True)
    others = _eq2(rows, mus, state)
    best = min((c for c in others if not c.reject and c.instance_id != mine.instance_id), key=_rank_key, default=None)
    return best is not None and best.total < mine.total


def _eq2_denies(state: PlacementState, idx: InstanceIndex, mine: CostBreakdown) -> bool:
    """Eq. 2 at a lease hit whose instance no longer has the model resident (it switched to another model or
    closed it since the lease was installed): honouring the lease opens a new replica there, and §3.3 opens one
    "only when the predicted demand benefit exceeds the opening cost". The lease's prefix is at best
    host-restorable there, which any host-tier instance restores as well (``host_prefix``), so the lease buys
    no KV locality that would exempt the open. True when Eq. 2 rejects the leased instance against the
    admissible resident replicas (none admissible: the gain is unbounded and the lease is honoured). Pure."""
    rows, mus, _ = _rank(state, idx, shortlist=True)
    gated = _eq2(rows, mus, state)
    own = next((c for c in gated if c.instance_id == mine.instance_id), None)
    return own is not None and own.reject == "eq2"


def _held(d: Decision, lease: LeaseView | None, now: float) -> Decision:
    """The decision with how long the lease it judged was held (until now, at most until its expiry)."""
    if lease is None or d.lease == "none":
        return d
    held = max(0.0, min(now, lease.t_exp_unix) - lease.t_done_unix)
    return replace(d, lease_held_s=held, lease_tokens=lease.committed_tokens)


def _rank_key(c: CostBreakdown) -> tuple[float, str]:
    return (c.total, c.instance_id)


def _all_costs(state: PlacementState, idx: InstanceIndex) -> list[CostBreakdown]:
    """Breakdowns (no Eq. 2) of every instance serving the model: the baselines show them all."""
    return _rank(state, idx, shortlist=False)[0]


def _ok(state: PlacementState, idx: InstanceIndex) -> list[InstanceState]:
    return [e.inst for e in idx.serving.get(state.request.model, {}).values() if not e.base_reject]


def decide_least_pressure(state: PlacementState, now: float) -> Decision:
    """Baseline (§5.3): the least-loaded healthy instance that serves the model, residency ignored."""
    idx = index_of(state)
    costs = _all_costs(state, idx)
    ok = _ok(state, idx)
    if not ok:
        return _finish(state, "no-instance", None, costs, "none", idx)
    best = min(ok, key=lambda i: (calls_on(i), i.instance_id))
    return _finish(state, "least-pressure", best.instance_id, costs, "none", idx)


def decide_sticky(state: PlacementState, now: float) -> Decision:
    """Baseline (§5.3): a session stays on its first instance while it is healthy; else least-pressure."""
    s = state.session
    if s is not None and s.model == state.request.model:
        idx = index_of(state)
        e = idx.serving.get(s.model, {}).get(s.first_instance)
        if e is not None and e.inst.healthy and e.inst.fresh:
            return _finish(state, "sticky", e.iid, _all_costs(state, idx), "none", idx)
    return decide_least_pressure(state, now)


def decide_round_robin(state: PlacementState, now: float) -> Decision:
    idx = index_of(state)
    costs = _all_costs(state, idx)
    ok = sorted(_ok(state, idx), key=lambda i: i.instance_id)
    if not ok:
        return _finish(state, "no-instance", None, costs, "none", idx)
    return _finish(state, "round-robin", ok[state.seq % len(ok)].instance_id, costs, "none", idx)


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
