"""The router's placement mechanism: owns the state the pure policy reads and the accounting of what it
decided. Builds a ``PlacementState`` per call from the registry (snapshots + in-flight overlay), the
session table, the lease table and the EWMA books; runs ``policy.decide``; commits the outcome (overlay,
session table, counters, the recent-decision log). Synchronous and clock-injected: the service drives it
from NATS callbacks and HTTP handlers, the simulator from its event loop.

Per-decision cost is O(changed instances + candidates), not O(instances): a snapshot's instance is rebuilt
when the snapshot arrives (the heartbeat path); at a decision the registry's change feed (forwards,
completions, suspicion), the lease table's live-count change feed and a heap of health/freshness deadlines
(one armed entry per instance) say which other ``InstanceState`` must be rebuilt; the others are reused, and
``policy.InstanceIndex`` (instances by served model, per-snapshot terms precomputed) is updated for the
rebuilt ones only. See the design note above ``_refresh``.

Accounting (``stats``; §5.3-5.4): ``decisions``, ``placement_<reason>``, ``returns`` (calls of a known
session for the same model), ``same_instance_returns``, ``moved_returns``, ``leases_installed``,
``lease_hits``, ``lease_misses`` (+ ``lease_miss_unhealthy`` / ``lease_miss_prefix_invalid`` /
``lease_miss_raced``), ``lease_expiries``, ``model_opens``, ``model_switches``, ``avoidable_cold_opens``
(the chosen instance had to open the model while another healthy instance had it resident),
``rotation_joins`` / ``avoidable_rotation_joins`` (the call added its model to a cold instance's rotation /
while another healthy instance had it in its rotation; ``policy.activation``). The lease
counters are written by ``LeaseService`` into the same ``stats``.

Leases: the gateway reads the lease table (the lease the policy judges at a return, live leases' charge on
their instance) and forgets a restarted instance's leases; everything else about a lease -- settlement,
sizing, installation from hooks and intents, resume tokens, return learning -- is
``services/router/lease_service.py``, which ``Admission`` calls.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from services.router.leases import LeaseTable
from services.router.policy import (
    CallRequest,
    Decision,
    InstanceIndex,
    InstanceState,
    LeaseView,
    ModelRes,
    PlacementState,
    PolicyParams,
    SessionView,
    calls_on,
    decide,
)
from services.router.profiles import DemandMeter, ProfileBook, QueueBook, ShapeBook, peer_group
from services.router.registry import InstanceView, Registry
from services.router.sessions import SessionTable
from talaria.cost_curve import points_from_proto
from talaria.switch_path import costs_from_proto
from talaria.v1 import engine_pb2 as pb

if TYPE_CHECKING:
    from services.router.lease_service import LeaseService


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """An instance as configured: pool and catalog (a hot instance pins its one model)."""

    pool: str  # "hot" | "cold"
    models: tuple[str, ...]
    page_size: int = 16
    max_num_seqs: int = 1  # decode slots: calls it can run at once (admission's "can start now")


class Gateway:
    def __init__(
        self,
        params: PolicyParams,
        registry: Registry,
        sessions: SessionTable,
        leases: LeaseTable,
        wall: Callable[[], float],
        profiles: ProfileBook | None = None,
        shapes: ShapeBook | None = None,
        demand: DemandMeter | None = None,
        tau_s: float = 1.0,
        pools: Mapping[str, PoolSpec] | None = None,
        router_id: str = "router-0",
        decisions_kept: int = 256,
    ):
        self.params = params
        self.registry = registry
        self.sessions = sessions
        self.leases = leases
        self.wall = wall
        self.profiles = profiles or ProfileBook()
        self.shapes = shapes or ShapeBook()
        self.demand = demand or DemandMeter()
        self.queues = QueueBook()  # measured / predicted queueing per instance (``queue_learned``)
        self._queue_pred: OrderedDict[str, tuple[str, float]] = OrderedDict()  # call -> (instance, Eq. 1 queue predicted, unscaled)
        self.tau_s = tau_s
        self.pools = dict(pools or {})
        self.router_id = router_id
        self.stats: Counter = Counter()
        self.decisions: deque = deque(maxlen=decisions_kept)
        self.queued = 0  # calls waiting in the gateway queue (overload policy "queue")
        self._seq = 0
        self._static: dict[str, tuple[int, int, dict, dict]] = {}  # id -> (epoch, seq, models, kv)
        self._states: dict[str, tuple[tuple, InstanceState]] = {}  # id -> (what it depends on, state)
        self._cur: dict[str, InstanceState] = {}  # current state per instance, in registry order
        self._index = InstanceIndex(params)
        self._lease_counts: dict[str, int] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap: (clock time health/freshness may flip, id)
        self._pushed: dict[str, tuple[float, ...]] = {}  # id -> its current deadlines (older heap entries are void)
        self._recheck: set[tuple[float, str]] = set()  # heap entries re-pushed at a deadline's boundary
        self._armed: dict[str, float] = {}  # id -> its one deadline entry on the heap
        self._priced: dict[str, object] = {}  # id -> the policy.Profile the book gave when the instance last reported
        self._priced_models: dict[str, dict] = {}  # cold id -> model -> its policy.Profile then (None: the instance's prices it)
        self._served: dict[str, dict[str, float]] = {}  # cold id -> model -> when a call of it was last forwarded there or ended there
        self._leases_synced = False  # _lease_counts mirrors the table's live counts (leases charged in full)
        self.work: Counter = Counter()  # states_built, index_puts, deadlines_void: the refresh's work, counted
        self._primed = False
        self._decide_ns = 0

    @property
    def adaptive(self) -> bool:
        return self.params.lease_policy == "adaptive"

    @property
    def leases_enabled(self) -> bool:
        return self.params.policy == "full" and self.tau_s > 0

    # ------------------------------------------------------------------------------ telemetry input
    def on_snapshot(self, snap: pb.InstanceSnapshot) -> bool:
        prev = self.registry.instances.get(snap.instance_id)
        if prev is not None and snap.epoch > prev.snapshot.epoch:
            # The engine restarted: the KV the table and the leases point at is gone.
            self.sessions.forget_instance(snap.instance_id)
            self.leases.drop_instance(snap.instance_id)
            self.profiles.forget(snap.instance_id)
            self.queues.forget(snap.instance_id)
            self._served.pop(snap.instance_id, None)  # a restarted engine's rotation starts empty
        if not self.registry.observe(snap):
            return False
        p, group = snap.profile, peer_group(snap)
        self.profiles.observe(snap.instance_id, p.prefill_per_token, p.decode_step, p.restore_per_token, costs_from_proto(p.switch_costs),
                              points_from_proto(p.prefill_by_context), points_from_proto(p.decode_by_batch), group)
        base = self._priced[snap.instance_id] = self.profiles.profile(snap.instance_id)
        if snap.pool == pb.POOL_COLD:  # a hot instance's profile is its one model's already
            for m in snap.models:
                if m.HasField("cost"):
                    c = m.cost
                    self.profiles.observe_model(snap.instance_id, m.model, c.prefill_per_token, c.decode_step, c.restore_per_token,
                                                points_from_proto(c.prefill_by_context), points_from_proto(c.decode_by_batch), group)
            self._priced_models[snap.instance_id] = {m.model: self.profiles.model_profile(snap.instance_id, m.model, base) for m in snap.models}
        self._absorb()
        return True

    def call_ended(self, request_id: str, instance_id: str, session_id: str = "", model: str = "", tokens: int = 0) -> None:
        """The router saw a call's finished chunk. The engine's completion hook follows it, but a client can
        send its next call first (an agent with a zero tool gap), so what the hook would teach placement is
        recorded now: the call is no longer queue ahead of anyone on ``instance_id`` (else the session's own
        return sees its instance busy with the call that just ended and moves away from its KV), and the
        session's KV (about ``tokens`` tokens) is there. The hook's exact committed count (full pages, at most
        ``tokens``) replaces this estimate when it arrives. Mutates the registry's overlay / done set and the
        session table."""
        self.registry.completed(instance_id, request_id, self.wall())
        if session_id and tokens > 0:
            self.sessions.record(session_id, model, instance_id, tokens, done_unix=self.wall())

    def on_hook(self, hook: pb.CompletionHook) -> float | None:
        """Placement's part of a completion hook: the call leaves the in-flight overlay, its measured engine
        queue teaches ``QueueBook``, its usage the call shape, and a session call that ended well is recorded in
        the session table (its committed KV, done at the returned time). Returns that done time (the lease
        service continues from it: ``LeaseService.on_hook``), or None for a hook of no session, of an ended
        session (forgotten here; the service drops its leases from the store) or of a failed call."""
        self.stats["hooks"] += 1
        # the finished call is no longer queue ahead of anyone (its session's return included)
        self.registry.completed(hook.instance_id, hook.request_id, hook.finish_unix or self.wall())
        pred = self._queue_pred.pop(hook.request_id, None)
        if pred is not None and pred[0] == hook.instance_id and hook.HasField("attribution") and not hook.HasField("error"):
            self.queues.observe(pred[0], pred[1], hook.attribution.engine_queue_s)
        if hook.HasField("usage"):
            u = hook.usage
            self.shapes.observe(hook.model, u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        if not hook.session_id:
            return None
        if hook.session_ended:  # no lease; forget the session (the service drops its leases)
            self.end_session(hook.session_id)
            return None
        if hook.HasField("error"):
            return None
        now = self.wall()
        done = min(hook.finish_unix, now) if hook.finish_unix > 0 else now
        committed = hook.prefix.committed_tokens if hook.HasField("prefix") else 0
        self.sessions.record(hook.session_id, hook.model, hook.instance_id, committed, done_unix=done)
        self._mark_served(hook.instance_id, hook.model, done)
        return done

    def _mark_served(self, instance_id: str, model: str, at: float) -> None:
        """A call of ``model`` was forwarded to or ended on ``instance_id`` at ``at`` (a cold instance's recent
        rotation, ``_static_of``). Mutates ``_served``."""
        spec = self.pools.get(instance_id)
        if spec is not None and spec.pool != "cold":
            return
        served = self._served.setdefault(instance_id, {})
        served[model] = max(at, served.get(model, 0.0))

    def priced_profile(self, instance_id: str, model: str):
        """The ``policy.Profile`` placement prices a call of ``model`` on ``instance_id`` with: a cold
        instance's own price of that model when it reported one, else the instance's. Pure read."""
        return self._priced_models.get(instance_id, {}).get(model) or self.profiles.profile(instance_id)

    # ---------------------------------------------------------------------------------- placement
    def _static_of(self, v: InstanceView) -> tuple[dict, dict]:
        snap = v.snapshot
        cached = self._static.get(v.instance_id)
        if cached is not None and cached[0] == snap.epoch and cached[1] == snap.seq:
            return cached[2], cached[3]
        spec = self.pools.get(v.instance_id)
        cold = snap.pool == pb.POOL_COLD or (spec is not None and spec.pool == "cold")
        priced = self._priced_models.get(v.instance_id, {})
        models: dict[str, ModelRes] = {}
        kv = {(s.session_id, s.model): (int(s.state), s.committed_tokens) for s in snap.sessions}
        # a cold instance's rotation (policy.ModelRes.in_rotation): the models with a call there or a session's KV on
        # its device, and those it served within Eq. 2's control window (a session's KV may have gone to the host
        # store during its tool gap, and its return still belongs there)
        rotation: set[str] = set()
        if cold:
            rotation = {s.model for s in snap.sessions if s.state == pb.KV_DEVICE and s.committed_tokens > 0}
            horizon = snap.sent_unix - self.params.control_window_s
            rotation.update(m for m, t in self._served.get(v.instance_id, {}).items() if t >= horizon)
        for m in snap.models:
            if cold or m.loaded:  # a hot instance serves only what it pinned
                models[m.model] = ModelRes(loaded=m.loaded, active=m.active or (not cold and m.loaded), staged=m.staged,
                                           wait_s=m.slot_wait_s if cold and self.params.slot_wait else 0.0,
                                           profile=priced.get(m.model),
                                           in_rotation=not cold or m.active or m.num_running + m.num_waiting > 0 or m.model in rotation)
        if cold and spec is not None:
            for name in spec.models:
                models.setdefault(name, ModelRes())
        self._static[v.instance_id] = (snap.epoch, snap.seq, models, kv)
        return models, kv

    def _state_of(self, iid: str, v: InstanceView, n_leases: int) -> InstanceState:
        snap = v.snapshot
        healthy, fresh = self.registry.healthy(v), self.registry.fresh(v)
        qs = self.queues.scale(iid) if self.params.queue_learned else 1.0
        key = (snap.epoch, snap.seq, v.inflight, v.running, n_leases, healthy, fresh, qs)
        cached = self._states.get(iid)
        if cached is not None and cached[0] == key:
            return cached[1]  # nothing this instance's view depends on changed
        models, kv = self._static_of(v)
        spec = self.pools.get(iid)
        st = InstanceState(
            instance_id=iid,
            healthy=healthy,
            fresh=fresh,
            models=models,
            profile=self._priced.get(iid) or self.profiles.profile(iid),
            pool="cold" if snap.pool == pb.POOL_COLD else "hot",
            kv=kv,
            running=v.running,
            waiting=snap.num_waiting,
            overlay_calls=v.inflight,
            overlay_leases=n_leases,
            kv_pages_total=snap.kv_pages_total,
            page_size=spec.page_size if spec is not None else 16,
            kv_usage=snap.kv_usage,
            snapshot_unix=snap.sent_unix,
            epoch=snap.epoch,
            host_kv=snap.host_kv,
            queue_scale=qs,
        )
        self._states[iid] = (key, st)
        self.work["states_built"] += 1
        return st

    # Design note ("placement decision < 1 ms p99 at 1,000 instances, state refresh included"). The
    # states a decision reads are kept current by events, not rebuilt per decision: a snapshot's instance (and
    # whatever else the registry's change feed holds) is rebuilt when the snapshot arrives (``_absorb``, on the
    # heartbeat path), so a decision rebuilds only what changed since: forwards and completions, live-lease
    # counts (the lease table's own change feed, ``take_live_changes``) and health/freshness deadlines that
    # passed (deadlines of a superseded snapshot are void and skipped). An instance is priced by the profile the
    # book gave when it last reported (``_priced``), so when its state is rebuilt does not change what it is.
    # A state depends only on its instance's view, live-lease count, health and freshness at the decision's
    # clock, which every path above keeps exact: tests/unit/test_router_placement_equivalence.py compares
    # against a full rebuild at every decision.
    def _refresh(self) -> None:
        """Bring the states (and index entries) up to date for a decision: the registry's change feed, changed
        live-lease counts and passed health/freshness deadlines. Mutates the state caches and the index."""
        self._knobs()
        reg = self.registry
        dirty = reg.take_changed()
        if not self._primed:
            dirty |= set(reg.instances)
            self._primed = True
        self._lease_dirty(dirty)
        self._catch_up(dirty, reg.clock.now())

    def _catch_up(self, dirty: set[str], now: float) -> None:
        """Rebuild ``dirty`` plus the instances whose health/freshness deadline passed by ``now``. Mutates the
        state caches, the index and the deadline heap."""
        again = self._deadlines_due(dirty, now)
        self._rebuild(dirty, now)
        later = math.nextafter(now, math.inf)
        for iid in again:
            heapq.heappush(self._deadlines, (later, iid))
            self._recheck.add((later, iid))

    def _deadlines_due(self, dirty: set[str], now: float) -> list[str]:
        """Pop the deadline heap up to ``now``: an instance whose health/freshness deadline passed joins
        ``dirty``; an entry of a superseded snapshot only re-arms its instance's next deadline. The heap holds
        one armed entry per instance (``_armed``) plus boundary re-checks. Returns the instances to check once
        more just after ``now`` (float rounding at the boundary). Mutates the heap, ``_armed``, ``dirty``."""
        heap, again = self._deadlines, []
        while heap and heap[0][0] <= now:
            t, iid = heapq.heappop(heap)
            if (t, iid) in self._recheck:
                self._recheck.discard((t, iid))
            elif self._armed.get(iid) != t:
                continue  # replaced by an earlier armed entry
            else:
                del self._armed[iid]
                if t not in self._pushed.get(iid, ()):
                    self.work["deadlines_void"] += 1  # a deadline of a snapshot since superseded
                    self._arm(iid, t)  # its current deadlines after this one (any already passed pops below)
                    continue
            dirty.add(iid)
            if t > now - 1e-6:
                again.append(iid)
        return again

    def _arm(self, iid: str, after: float) -> None:
        """Keep the instance's earliest current deadline after ``after`` on the heap (one entry per instance; an
        entry already armed earlier stays and re-arms when it pops). Mutates the heap and ``_armed``."""
        nxt = min((t for t in self._pushed.get(iid, ()) if t > after), default=None)
        if nxt is not None and not (self._armed.get(iid, math.inf) <= nxt):
            self._armed[iid] = nxt
            heapq.heappush(self._deadlines, (nxt, iid))

    def _absorb(self) -> None:
        """Heartbeat path: rebuild what the registry's change feed holds now (the snapshot just observed) and
        what passed a health/freshness deadline, with the live-lease counts last seen, so that the next
        decision finds them built. Mutates the state caches, the index and the deadline heap (nothing before
        the first decision primed them)."""
        if not self._primed or self._index.params is not self.params:
            return
        self._catch_up(self.registry.take_changed(), self.registry.clock.now())

    def _knobs(self) -> None:
        """Knobs replaced: every precomputed term is void. Mutates the caches."""
        if self._index.params is not self.params:
            self._index = InstanceIndex(self.params)
            self._cur.clear()
            self._static.clear()  # its ModelRes depend on the knobs too (slot_wait)
            self._states.clear()
            self._lease_counts = {}
            self._leases_synced = False
            self._primed = False

    def _lease_dirty(self, dirty: set[str]) -> None:
        """Add the instances whose live-lease count (adaptive with ``lease_decay``: decayed weight) changed;
        update the mirror. A lease charged in full until it expires (fixed tau; adaptive by default) is the
        table's live count, kept incrementally."""
        now = self.wall()
        if self.adaptive and self.params.lease_decay:  # decaying weights change with the clock: recomputed from every lease
            self._leases_synced = False
            leases = self.leases.weighted_by_instance(now)
            old = self._lease_counts
            if leases != old:
                dirty.update(k for k in leases.keys() | old.keys() if leases.get(k, 0) != old.get(k, 0))
                self._lease_counts = leases
            return
        counts = self._lease_counts
        if not self._leases_synced:
            self.leases.take_live_changes(now, self)
            fresh = self.leases.live_by_instance(now)
            dirty.update(k for k in fresh.keys() | counts.keys() if fresh.get(k, 0) != counts.get(k, 0))
            self._lease_counts = fresh
            self._leases_synced = True
            return
        for iid in self.leases.take_live_changes(now, self):
            n = self.leases.live_count(iid, now)
            if n != counts.get(iid, 0):
                dirty.add(iid)
                if n:
                    counts[iid] = n
                else:
                    counts.pop(iid, None)

    def _rebuild(self, dirty: set[str], now: float) -> None:
        """Rebuild the states and index entries of ``dirty`` (registry order for new ones) and push their
        health/freshness deadlines. Mutates ``_cur``, the index and the deadline heap."""
        reg, leases = self.registry, self._lease_counts
        if any(iid not in self._cur for iid in dirty):
            order: Iterable[str] = [iid for iid in reg.instances if iid in dirty] + [iid for iid in dirty if iid not in reg.instances]
        else:
            order = dirty
        for iid in order:
            v = reg.instances.get(iid)
            if v is None:
                self._cur.pop(iid, None)
                self._index.remove(iid)
                continue
            st = self._state_of(iid, v, leases.get(iid, 0))
            self._cur[iid] = st
            if self._index.by_id.get(iid) is not st:
                self.work["index_puts"] += 1
                self._index.put(st)
            self._pushed[iid] = reg.deadlines(v)
            self._arm(iid, now)

    def end_session(self, session_id: str) -> list[str]:
        """Forget a session (table entry and local leases). Returns the instances known to hold it
        (last and first instance, lease instances); empty when unknown. Mutates the session and lease tables."""
        holders: list[str] = []
        entry = self.sessions.forget(session_id)
        if entry is not None:
            holders += [entry.instance_id, entry.first_instance]
        for view in self.leases.drop_session(session_id):
            holders.append(view.instance_id)
        self.stats["sessions_ended"] += 1
        return sorted({h for h in holders if h})

    def instance_states(self, exclude: Iterable[str] = ()) -> list[InstanceState]:
        self._refresh()
        if not exclude:
            return list(self._cur.values())
        skip = set(exclude)
        return [st for iid, st in self._cur.items() if iid not in skip]

    def request(self, session_id: str, model: str, prompt_tokens: int, max_tokens: int, expected_output_tokens: int = 0) -> CallRequest:
        """The call as the policy sees it. ``expected_output_tokens`` (a call hint, 0 = none) replaces the
        model's learned decode length in the call's pressure estimate (``expected_decode``, Eq. 1 dR_req)."""
        decode = float(expected_output_tokens) if expected_output_tokens else self.shapes.shape(model).decode_tokens
        return CallRequest(session_id, model, prompt_tokens, max_tokens, min(float(max_tokens), decode))

    def arrival(self, req: CallRequest) -> None:
        """A call arrived: the demand meter counts it (``LeaseService.arrival`` also learns the return gap)."""
        self.demand.arrival(req.model, self.wall())

    def state_for(self, req: CallRequest, exclude: Iterable[str] = (), use_lease: bool = True) -> tuple[PlacementState, int | None]:
        now = self.wall()
        entry = self.sessions.get(req.session_id) if req.session_id else None
        session = (
            SessionView(entry.model, entry.instance_id, entry.first_instance or entry.instance_id, entry.committed_tokens, entry.done_unix)
            if entry is not None
            else None
        )
        lease: LeaseView | None = None
        rev = None
        if use_lease and self.leases_enabled and req.session_id:
            got = self.leases.get(req.session_id, req.model)
            if got is not None:
                lease, rev = got
        window = self.params.control_window_s
        demand = {req.model: self.demand.rate(req.model, now) * window + self.leases.live_of_model(req.model, now)}
        self._seq += 1
        instances = self.instance_states(exclude)
        st = PlacementState(
            request=req,
            instances=instances,
            params=self.params,
            session=session,
            lease=lease,
            shape=self.shapes.shape(req.model),
            demand=demand,
            seq=self._seq,
            index=None if exclude else self._index,  # with exclusions the policy indexes the subset itself
            index_version=self._index.version,
        )
        return st, rev

    def decide(self, req: CallRequest, exclude: Iterable[str] = (), use_lease: bool = True) -> tuple[Decision, int | None]:
        """Run the policy; nothing is committed (see ``commit``). Returns the lease revision it judged."""
        st, rev = self.state_for(req, exclude, use_lease)
        t0 = time.perf_counter_ns()
        d = decide(st, self.wall())
        self._decide_ns += time.perf_counter_ns() - t0
        return d, rev

    def commit(self, req: CallRequest, d: Decision, call_id: str = "") -> bool:
        """Record a forwarded call: overlay (keyed by ``call_id``, which its completion hook removes),
        session table, accounting, decision log, and the queue Eq. 1 predicted for it on its instance (unscaled;
        its hook's measured engine queue teaches ``QueueBook``). Returns whether the call is a return (the
        session's last call was of the same model), which ``LeaseService.commit`` records for the residency book."""
        assert d.instance_id is not None
        inst = d.instance_id
        self.stats["decisions"] += 1
        self.stats[f"placement_{d.reason}"] += 1
        entry = self.sessions.get(req.session_id) if req.session_id else None
        returning = False
        if entry is not None and entry.model == req.model:
            returning = True
            self.stats["returns"] += 1
            self.stats["same_instance_returns" if entry.instance_id == inst else "moved_returns"] += 1
        if d.opens_model:
            self.stats["model_opens"] += 1
        if d.switches_model:
            self.stats["model_switches"] += 1
        if d.avoidable_open:
            self.stats["avoidable_cold_opens"] += 1
        if d.joins_rotation:
            self.stats["rotation_joins"] += 1
        if d.avoidable_join:
            self.stats["avoidable_rotation_joins"] += 1
        self.registry.forwarded(inst, call_id)
        self._mark_served(inst, req.model, self.wall())
        if req.session_id:
            self.sessions.record(req.session_id, req.model, inst)
        chosen = next((c for c in d.costs if c.instance_id == inst), None)
        if call_id and chosen is not None:  # what its hook's measured engine queue is compared with (QueueBook)
            st = self._cur.get(inst)
            scale = st.queue_scale if st is not None and st.queue_scale > 0 else 1.0
            self._queue_pred[call_id] = (inst, chosen.queue_s / scale)
            while len(self._queue_pred) > 65536:
                self._queue_pred.popitem(last=False)
        self.log(req, d)
        return returning

    def log(self, req: CallRequest, d: Decision) -> None:
        if self.decisions.maxlen:
            self.decisions.append({"at_unix": self.wall(), "session_id": req.session_id, "model": req.model, **d.as_dict()})

    # ---------------------------------------------------------------------------------- admission
    def admission(self, req: CallRequest, overload: "OverloadPolicy", prompt_exact: bool = False, prompt_bytes: int = 0,
                  prompt_param: str = "prompt", leases: LeaseService | None = None) -> "Admission":
        """The admission / queue / retry state machine of one call (see ``Admission``); ``leases`` settles the
        leases its decisions judge (``LeaseService.admit`` passes itself)."""
        return Admission(self, req, overload, prompt_exact, prompt_bytes, prompt_param, leases=leases)

    def context_limit(self, model: str, candidates: Iterable[str]) -> int:
        """The largest context any of ``candidates`` reports for ``model`` (0 = unknown)."""
        best = 0
        for iid in candidates:
            v = self.registry.instances.get(iid)
            if v is not None:
                best = max(best, v.max_context(model))
        return best

    def prompt_floor(self, model: str, candidates: Iterable[str], text_bytes: int) -> tuple[int, int]:
        """A lower bound on the tokens of a prompt with ``text_bytes`` bytes of text the engine tokenizes
        verbatim, and the bytes-per-token bound it used: ``text_bytes // b`` with ``b`` the largest
        ``max_token_bytes`` any of ``candidates`` reports for ``model`` ((0, 0): none reports one). Pure."""
        b = 0
        for iid in candidates:
            v = self.registry.instances.get(iid)
            if v is not None:
                b = max(b, v.max_token_bytes(model))
        return (text_bytes // b, b) if b > 0 and text_bytes > 0 else (0, 0)

    def start_now(self, req: CallRequest, d: Decision, over_context: bool) -> Decision | None:
        """Overload fallback: the least loaded live candidate if it can start the call now
        (nothing queued ahead of it, a free decode slot), or (``over_context``) regardless of load, so the
        engine's exact tokenizer answers 413. Returns the rewritten decision (reason ``start-now``) or None.
        Pure: reads the states the last ``decide`` built."""
        best: tuple | None = None
        for c in d.costs:
            st = self._cur.get(c.instance_id)
            if st is None or c.reject in ("unhealthy", "stale") or not st.healthy or not st.fresh:
                continue
            spec = self.pools.get(c.instance_id)
            slots = spec.max_num_seqs if spec is not None else 1
            if not over_context and (st.waiting > 0 or st.running + st.overlay_calls >= slots):
                continue
            key = (st.waiting + st.overlay_calls + st.running, c.total, c.instance_id)
            if best is None or key < best[0]:
                best = (key, c)
        if best is None:
            return None
        c = best[1]
        return replace(d, instance_id=c.instance_id, reason="start-now", opens_model=c.act == "open", switches_model=c.act == "switch",
                       avoidable_open=False, retry_after_s=0.0)

    def silent_candidate(self, d: Decision) -> bool:
        """Whether a candidate of ``d`` is rejected only for silence (suspect by heartbeats, not known dead,
        not refused a call): its heartbeat may be unread. Pure read."""
        reg = self.registry
        for c in d.costs:
            v = reg.instances.get(c.instance_id)
            if v is not None and c.reject == "unhealthy" and reg.is_silent(v) and v.suspect_until <= reg.clock.now() and not v.snapshot.draining:
                return True
        return False

    def late_fallback(self, d: Decision) -> Decision | None:
        """No fresh candidate at all: the least loaded candidate that is merely *late* (its snapshot is past
        the staleness limit, its heartbeats are still within the miss limit, so it is healthy) gets the call,
        placement ``late``, instead of a 503. A slow instance is not a dead one, and a router whose own loop
        was busy sees every snapshot late at once. Pure: reads the states the last ``decide`` built."""
        best: tuple | None = None
        for c in d.costs:
            st = self._cur.get(c.instance_id)
            if st is None or c.reject != "stale" or not st.healthy:
                continue
            key = (calls_on(st), c.instance_id)
            if best is None or key < best[0]:
                best = (key, c)
        if best is None:
            return None
        c = best[1]
        return replace(d, instance_id=c.instance_id, reason="late", opens_model=c.act == "open", switches_model=c.act == "switch",
                       avoidable_open=False, retry_after_s=0.0)

    # ------------------------------------------------------------------------------------- views
    def known_model(self, model: str) -> bool:
        return self.registry.known_model(model) or any(model in s.models for s in self.pools.values())

    def metrics(self) -> dict:
        now = self.wall()
        s = dict(self.stats)
        returns = s.get("returns", 0)
        return {
            "policy": self.params.policy,
            "lease_ttl_s": self.tau_s,
            "lease_policy": self.params.lease_policy,
            "leases_live": sum(self.leases.live_by_instance(now).values()),
            "leases_unused": max(0, s.get("leases_installed", 0) - s.get("lease_hits", 0)),
            "queue_calibration": {"learned": self.params.queue_learned, "instances": self.queues.stats()},
            "gateway_queued": self.queued,
            "same_instance_return_rate": (s.get("same_instance_returns", 0) / returns) if returns else None,
            "mean_decide_us": (self._decide_ns / 1e3 / s["decisions"]) if s.get("decisions") else None,
            **{k: s.get(k, 0) for k in ACCOUNTING},
            "counters": s,
        }


ACCOUNTING = (
    "decisions",
    "returns",
    "same_instance_returns",
    "moved_returns",
    "leases_installed",
    "lease_hits",
    "lease_misses",
    "lease_expiries",
    "leases_declined",
    "lease_outweighed",
    "lease_eq2_denied",
    "model_opens",
    "model_switches",
    "avoidable_cold_opens",
    "rotation_joins",
    "avoidable_rotation_joins",
    "overload_rejected",
    "overload_queued",
    "overload_queue_timeouts",
    "admitted_start_now",
    "admitted_late",
    "silence_waits",
    "deadline_risk",
)


# ------------------------------------------------------------------------------------------ admission
#
# Design note (Talaria §3.3 "predictive overload controls rather than hard TTFT guarantees", Algorithm 1
# lines 20-22 "invoke the configured gateway overload policy"). The policy's
# round-admission and memory checks are *predictions*; a prediction never turns away work that can start
# now. When ``decide`` finds no admissible candidate ("overload"):
#   0. A token-id prompt is counted exactly: over the context (prompt + max_tokens, the engine's rule) it is
#      413 ``context_length_exceeded`` at once, busy or not. A text prompt whose *lower bound* (its text
#      bytes over the tokenizer's most bytes per token, ``prompt_floor``) is already over is the same 413,
#      never forwarded: tokenizing megabytes is itself seconds of an engine's time, and a message over the
#      bus's ``max_payload`` could not be sent anyway.
#   1. A call whose prompt estimate is over the model's context is forwarded to the least loaded live
#      candidate, whatever its load: the engine tokenizes exactly and answers 413 ``context_length_exceeded``
#      (a 429 would make a retrying client loop forever).
#   2. The least loaded live candidate that can start the call now (nothing waiting, a free decode slot,
#      counting the in-flight overlay) gets it: placement ``start-now``; its predicted TTFT above the
#      admission budget is a *deadline risk*, reported with the step (header, log, counter), not overload.
#   2b. When no candidate is fresh at all (``no-instance``) but one is merely late (snapshot past the
#      staleness limit, heartbeats within the miss limit: healthy), the least loaded late one gets the call
#      (placement ``late``) rather than a 503: staleness protects the ranking's inputs, not liveness.
#   3. Otherwise the overload policy: 429 + Retry-After at once ("reject"), or a bounded wait in the
#      gateway queue ("queue": at most ``queue_max`` calls, ``queue_timeout_s`` each), re-deciding every
#      ``poll_s``, then 429.
#   4. No candidate is healthy but one is only *silent* (past the miss limit, not known dead): the call waits
#      ``poll_s`` at a time, ``silence_waits`` times at most (0.5 s by default), re-deciding, before the 503.
#      A router whose loop was busy has heartbeats waiting to be read; they are read while the call waits,
#      and the instance is healthy again. A silent instance still gets no call while it stays silent.
# A forward the engine does not accept (nothing ran) is retried on another instance, ``max_attempts`` in all.


@dataclass(frozen=True, slots=True)
class OverloadPolicy:
    mode: str = "reject"  # "reject" | "queue"
    queue_max: int = 64
    queue_timeout_s: float = 10.0
    poll_s: float = 0.05
    max_attempts: int = 3
    silence_waits: int = 10  # no healthy candidate but a silent, not dead one: polls (poll_s each) before 503


@dataclass(frozen=True, slots=True)
class Step:
    """What the caller does next: ``forward`` the decision, ``wait`` ``wait_s`` then ask again, or ``reject``
    with an HTTP error (status, code, message, param, ``retry_after_s`` > 0 adds Retry-After)."""

    kind: str  # "forward" | "wait" | "reject"
    decision: Decision | None = None
    lease_rev: int | None = None
    wait_s: float = 0.0
    status: int = 0
    code: str = ""
    message: str = ""
    param: str | None = None
    retry_after_s: float = 0.0
    deadline_risk_s: float | None = None  # forward past a failed admission prediction: the predicted TTFT
    lease_id: str = ""  # the lease this forward consumed (settled by ``Admission.step``), "" when none
    lease_epoch: int = 0  # that lease's engine epoch: the engine refuses the call from another epoch (fencing)


@dataclass
class Admission:
    """One call's way to an instance. Clock: the registry's (injected). Mutates the gateway's ``queued``
    count and ``stats`` (and its decision log on a rejection); call ``close()`` when done. ``next`` decides
    (synchronous); ``step`` decides and settles the leases each decision judged through ``leases``
    (``LeaseService.settle``: a honoured lease consumed in the shared store, a judged one discarded; a lease
    another router replica consumed first is placed again without it); ``commit`` records the forward."""

    gw: Gateway
    req: CallRequest
    overload: OverloadPolicy
    prompt_exact: bool = False  # req.prompt_tokens is the exact token count (a token-id prompt)
    prompt_bytes: int = 0  # else: UTF-8 bytes of the prompt text the engine tokenizes verbatim (lower bound, step 0)
    prompt_param: str = "prompt"  # the request field an over-context 413 names
    tried: set[str] = field(default_factory=set)
    attempts: int = 0
    last_error: str = ""
    queue_deadline: float | None = None
    silence_waits: int = 0  # polls spent waiting for a silent (not dead) candidate's heartbeat
    leases: LeaseService | None = None  # settles the leases decisions judge (None: nothing settled, ``next`` only)
    use_lease: bool = True  # False once a lease was lost to another replica: the call is placed without one

    async def step(self) -> Step:
        """The next step with its lease settled: decide (``next``), then consume or discard the lease the
        decision judged (``LeaseService.settle``; every step, wait and reject included, as each judged the
        lease). A lease another replica consumed first spends no attempt: the call is decided again without
        it. The forward step carries the consumed lease's id and epoch. Mutates the lease store and table."""
        while True:
            step = self.next(self.use_lease)
            if self.leases is None:
                return step
            s = await self.leases.settle(step.decision, step.lease_rev, self.req.session_id, self.req.model, step.kind == "forward")
            if s.stands:
                return replace(step, lease_id=s.lease_id, lease_epoch=s.epoch) if s.lease_id else step
            if step.decision is not None and step.decision.instance_id is not None:
                self.raced(step.decision.instance_id)
            self.use_lease = False

    def commit(self, d: Decision, call_id: str = "") -> None:
        """The call is being forwarded on ``d``: record it (``LeaseService.commit``, else ``Gateway.commit``)."""
        if self.leases is not None:
            self.leases.commit(self.req, d, call_id)
        else:
            self.gw.commit(self.req, d, call_id)

    def next(self, use_lease: bool = True) -> Step:
        """Decide again (excluding instances already tried) and say what to do."""
        gw, req = self.gw, self.req
        if self.attempts >= self.overload.max_attempts:
            return self._exhausted()
        d, rev = gw.decide(req, self.tried, use_lease)
        cands = [c.instance_id for c in d.costs]
        limit = gw.context_limit(req.model, cands)
        over = limit > 0 and req.prompt_tokens + req.max_tokens > limit
        if over and self.prompt_exact:  # same rule as the engine's, on an exact count: never forwarded
            self._dequeue()
            return Step("reject", d, rev, status=413, code="context_length_exceeded", param=self.prompt_param,
                        message=f"prompt of {req.prompt_tokens} tokens plus max_tokens {req.max_tokens} exceeds the context limit of {limit} tokens of model '{req.model}'")
        floor, per = gw.prompt_floor(req.model, cands, self.prompt_bytes) if not self.prompt_exact else (0, 0)
        if limit > 0 and floor > 0 and floor + req.max_tokens > limit:  # can never fit, whatever the tokenizer says
            self._dequeue()
            return Step("reject", d, rev, status=413, code="context_length_exceeded", param=self.prompt_param,
                        message=f"prompt of at least {floor} tokens ({self.prompt_bytes} bytes of text, at most {per} bytes per token for this "
                                f"model's tokenizer) plus max_tokens {req.max_tokens} exceeds the context limit of {limit} tokens of model '{req.model}'")
        if d.instance_id is not None:
            return self._forward(d, rev)
        if d.reason == "no-instance":
            late = gw.late_fallback(d)
            if late is not None:
                gw.stats["admitted_late"] += 1
                return self._forward(late, rev)
            if self.silence_waits < self.overload.silence_waits and gw.silent_candidate(d):
                self.silence_waits += 1  # 4. below: a heartbeat may be waiting to be read
                gw.stats["silence_waits"] += 1
                return Step("wait", d, rev, wait_s=self.overload.poll_s)
        if d.reason != "overload":
            return replace(self._exhausted(), decision=d, lease_rev=rev)
        fb = gw.start_now(req, d, over)
        if fb is not None:
            chosen = fb.chosen()
            risk = chosen.predicted_ttft_s if chosen is not None and chosen.predicted_ttft_s > gw.params.admission_budget_s else None
            gw.stats["admitted_start_now"] += 1
            if risk is not None:
                gw.stats["deadline_risk"] += 1
            return replace(self._forward(fb, rev), deadline_risk_s=risk)
        return self._overloaded(d, rev)

    def _forward(self, d: Decision, rev: int | None) -> Step:
        self._dequeue()
        assert d.instance_id is not None
        self.attempts += 1
        self.tried.add(d.instance_id)
        return Step("forward", d, rev)

    def _overloaded(self, d: Decision, rev: int | None) -> Step:
        gw, o, model = self.gw, self.overload, self.req.model
        now = gw.registry.clock.now()

        def reject(message: str) -> Step:
            gw.stats["overload_rejected"] += 1
            gw.log(self.req, d)
            self._dequeue()
            return Step("reject", d, rev, status=429, code="overloaded", message=message, retry_after_s=max(1.0, d.retry_after_s))

        if o.mode != "queue":
            return reject(f"all instances serving '{model}' are over their admission budget{overload_reasons(d, gw.params.admission_budget_s)}")
        if self.queue_deadline is None:
            if gw.queued >= o.queue_max:
                return reject(f"gateway queue for '{model}' is full ({o.queue_max} waiting)")
            gw.queued += 1
            gw.stats["overload_queued"] += 1
            self.queue_deadline = now + o.queue_timeout_s
        if now >= self.queue_deadline:
            gw.stats["overload_queue_timeouts"] += 1
            return reject(f"no instance for '{model}' admitted the call within {o.queue_timeout_s:.0f}s")
        return Step("wait", d, rev, wait_s=min(o.poll_s, self.queue_deadline - now))

    def _exhausted(self) -> Step:
        self._dequeue()
        model = self.req.model
        if self.last_error:
            return Step("reject", status=503, code="engine_unavailable", retry_after_s=1.0, message=f"no engine answered for model '{model}': {self.last_error}")
        if self.gw.known_model(model):
            return Step("reject", status=503, code="no_healthy_instance", retry_after_s=1.0, message=f"no healthy instance serves model '{model}'")
        return Step("reject", status=404, code="model_not_found", param="model", message=f"model '{model}' does not exist")

    def failed(self, instance_id: str, error: str) -> None:
        """The forward to ``instance_id`` was not accepted (nothing ran): the next step tries another."""
        self.tried.add(instance_id)
        self.last_error = error

    def raced(self, instance_id: str) -> None:
        """The forward step's lease was consumed by another router replica (or replaced by a newer one)
        before this one could: nothing was sent, so the instance is not tried and the attempt not spent; the
        next step places the call again without the lease."""
        self.tried.discard(instance_id)
        self.attempts = max(0, self.attempts - 1)

    def fenced(self, instance_id: str) -> None:
        """The instance refused the call's lease as from an older engine epoch (fencing; nothing ran):
        the lease is spent, so the next step places the call again without it, that instance included."""
        self.tried.discard(instance_id)

    def _dequeue(self) -> None:
        if self.queue_deadline is not None:
            self.gw.queued -= 1
            self.queue_deadline = None

    def close(self) -> None:
        """Leave the gateway queue if still in it (idempotent)."""
        self._dequeue()


def overload_reasons(d: Decision, budget_s: float, most: int = 3) -> str:
    """" (engine-1: predicted TTFT 75.2 s over the 60 s budget; engine-2: KV memory, 240 pages needed)": why each
    ranked instance refused the call, for the 429's message (at most ``most`` instances; "" when none was
    ranked). Pure."""
    parts = []
    for c in d.costs:
        if c.reject == "round-admission":
            parts.append(f"{c.instance_id}: predicted TTFT {c.predicted_ttft_s:.1f} s over the {budget_s:g} s budget")
        elif c.reject == "memory":
            parts.append(f"{c.instance_id}: KV memory, {c.pages_needed} pages needed beyond what its running and queued calls hold")
        elif c.reject == "eq2":
            parts.append(f"{c.instance_id}: opening a replica there does not pay (Eq. 2)")
    if not parts:
        return ""
    more = f"; {len(parts) - most} more" if len(parts) > most else ""
    return " (" + "; ".join(parts[:most]) + more + ")"

