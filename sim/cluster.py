"""The discrete-event loop: the router's real ``Gateway`` + policy, N ``SimInstance``s with their real slot
schedulers, one virtual clock.

Design NOTE (Talaria §3.3, §4.1, §5.1). Events are (time, seq, kind, payload) on one heap; the clock jumps
to the next event. The router side is the service's own placement mechanism, ``services.router.gateway.
Gateway`` (registry with the health rule and in-flight overlay, session table, lease table, EWMA books),
fed exactly what the router service feeds it: heartbeat snapshots (``pb.InstanceSnapshot``) every period,
completion hooks (``pb.CompletionHook``) that install leases with TTL tau in ``MemoryLeases``, and one
``decide``/``commit`` per arriving call with the lease consumed or discarded as ``services/router/app.py``
does. Overload (no candidate) retries after ``retry_s`` like the gateway queue. Calls reach an instance
with no network delay; a finished call's hook reaches the router at once, the session's next call is
issued one (capped) tool gap later (closed loop, §5.1).

Recording (``record=True``) keeps every gateway input and every scheduler input with the decision taken,
so ``tests/unit/test_sim_equivalence.py`` can replay them into fresh policy objects.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from services.engine.slots import SlotPolicy
from services.kvstore.registry import HostKVRegistry
from services.router.gateway import Gateway, PoolSpec
from services.router.lease_service import LeaseService
from services.router.leases import LeaseTable, MemoryLeases
from services.router.policy import PolicyParams
from services.router.profiles import Defaults, DemandMeter, ProfileBook, ShapeBook
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from talaria.switch_path import SwitchPath, costs_to_proto

from .instance import SimCall, SimInstance
from .profile import GIB, Profile

GAP_CAP_S = 10.0  # §5.1: recorded tool gaps are capped at 10 s


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    iid: str
    pool: str  # "hot" | "cold"
    catalog: tuple[str, ...]
    loaded: tuple[str, ...] | None = None  # None: the whole catalog
    max_loaded: int = 0
    max_num_seqs: int = 32  # decode slots the router is told (talaria.config.EngineConfig's default; the service passes it too)


@dataclass(frozen=True, slots=True)
class SimConfig:
    name: str
    profile: Profile
    instances: tuple[InstanceSpec, ...]
    slot: SlotPolicy = SlotPolicy()
    params: PolicyParams = PolicyParams()
    tau_s: float = 1.0
    heartbeat_s: float = 0.5
    retry_s: float = 0.1
    decode_quantum: int = 1
    pool_sizer: Any = None  # sim.scale.PoolLoop: moves instances between hot and cold pools from telemetry
    can_park: bool = False  # True: the paper's engine (in-flight calls parked at a switch, §5.5); False: this codebase's (Dfin drains)
    partial_layers: bool = False  # cold engines' streaming hot-swap (issue 16, JointServe §4.4; engine config partial_layers)
    unified_residency: bool = False  # cold engines' one budget for staged weights and session KV (issue 16, JointServe §3)
    # Residency as the router sees it (ModelState.loaded, Eq. 1's C_act, §5.3's avoidable opens). False: a model
    # in the instance's rotation / weight bank is resident (as the cold engine reports). True (the §5.3 router
    # testbed): only weights on the device are -- the active model and the one being staged (Eq. 1: "the
    # advertised switch cost when its state is resident or staged, and the measured full-open cost otherwise");
    # every other catalog model is an open (sim/README.md, "Router testbed").
    device_residency: bool = False
    record: bool = False
    max_sim_s: float = 1e7
    stall_s: float = 3600.0  # no call finished for this long (simulated): raise instead of idling forever


@dataclass(slots=True)
class SimSession:
    session_id: str
    start_s: float
    calls: list[SimCall]


@dataclass(slots=True)
class RunResult:
    name: str
    calls: list[SimCall]
    sct: dict[str, float]
    router: dict[str, Any]
    rounds: list[Any]
    switches: list[dict]
    end_s: float
    wall_s: float
    decide_us: list[float]
    policy_us: list[float]
    snapshot_us: list[float]
    instances: dict[str, dict[str, Any]]
    trace: dict[str, Any] = field(default_factory=dict)


class Simulation:
    """One run. ``run()`` mutates everything here and returns a ``RunResult``."""

    def __init__(self, cfg: SimConfig, sessions: list[SimSession]) -> None:
        self.cfg = cfg
        self.sessions = sessions
        self.clock = ManualClock()
        prof = cfg.profile
        self.instances: dict[str, SimInstance] = {}
        for spec in cfg.instances:
            host = HostKVRegistry(int(prof.host_kv_gib * GIB), self._slab(prof), clock=self.clock.now) if cfg.slot.host_kv else None
            self.instances[spec.iid] = SimInstance(
                spec.iid, spec.pool, list(spec.catalog), prof, cfg.slot if spec.pool == "cold" else _hot(cfg.slot), host=host,
                loaded=list(spec.loaded) if spec.loaded is not None else None, max_loaded=spec.max_loaded, decode_quantum=cfg.decode_quantum,
                can_park=cfg.can_park, partial_layers=cfg.partial_layers and spec.pool == "cold",
                unified_residency=cfg.unified_residency and spec.pool == "cold",
            )
        self.registry = Registry(self.clock, miss_limit=3.0, stale_after=2.0, wall=self.clock.now)
        table = LeaseTable()
        self.leases = MemoryLeases(table)
        c0 = prof.default
        defaults = Defaults(c0.prefill_per_token_at(8192), c0.decode_s(1, 0), c0.restore_per_token_s, prof.switch.total(1.0), prof.switch.total(0.0))
        self.gateway = Gateway(
            cfg.params, self.registry, SessionTable(self.clock), table, self.clock.now, profiles=ProfileBook(defaults), shapes=ShapeBook(),
            demand=DemandMeter(), tau_s=cfg.tau_s, pools={s.iid: PoolSpec(s.pool, s.catalog, prof.page_tokens, s.max_num_seqs) for s in cfg.instances},
        )
        self.lease_service = LeaseService(self.gateway, self.leases)  # settlement, sizing, hooks' leases: as the router's
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._busy: dict[str, bool] = {i: False for i in self.instances}
        self._rounds: list[Any] = []
        self._decide_us: list[float] = []  # gateway decide: state refresh + policy (+ a raced retry); thread CPU time
        self._snapshot_us: list[float] = []  # gateway on_snapshot (the heartbeat path, where states are rebuilt); thread CPU time
        self._policy_us: list[float] = []  # policy.decide alone (Gateway._decide_ns delta)
        self._trace: dict[str, Any] = {"router": [], "slots": {i: [] for i in self.instances}} if cfg.record else {}
        self._left = sum(len(s.calls) for s in sessions)
        self.worker_opens = {"opens": 0, "avoidable_opens": 0}  # ``_count_open``

    @staticmethod
    def _slab(prof: Profile) -> int:
        return max(c.kv_bytes_per_token for c in [prof.default, *prof.models.values()]) * prof.page_tokens

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self) -> RunResult:
        t0 = time.perf_counter()
        n = len(self.instances)
        for j, iid in enumerate(self.instances):  # every instance reports at t=0, then on its own phase
            self._publish(iid)
            self._push((j + 1) * self.cfg.heartbeat_s / n, "heartbeat", iid)
        for s in self.sessions:
            if s.calls:
                s.calls[0].intended = s.start_s
                self._push(s.start_s, "arrive", (s, 0))
        handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self._arrive, "retry": self._place, "done": self._done, "heartbeat": self._heartbeat,
            "pools": self._pools, "moved": self._moved, "wake": self._kick,
        }
        if self.cfg.pool_sizer is not None:
            self._push(self.cfg.pool_sizer.period_s, "pools", None)
        self._progress = 0.0
        while self._heap and self._left > 0:
            t, _, kind, payload = heapq.heappop(self._heap)
            if t > self.cfg.max_sim_s:
                raise RuntimeError(f"simulation passed {self.cfg.max_sim_s} s with {self._left} calls unfinished")
            if t - self._progress > self.cfg.stall_s:
                raise RuntimeError(f"no call finished for {self.cfg.stall_s} simulated s ({self._left} unfinished): a stalled instance")
            self.clock.advance(max(0.0, t - self.clock.now()))
            handlers[kind](payload)
        if self._left:
            raise RuntimeError(f"simulation stalled with {self._left} calls unfinished")
        for iid, inst in self.instances.items():  # close the open rounds / epochs
            inst.scheduler.finish(self.clock.now())
            self._take_rounds(iid, inst)
        return self._result(time.perf_counter() - t0)

    # ------------------------------------------------------------------ router side
    def _arrive(self, payload: tuple[SimSession, int]) -> None:
        s, k = payload
        c = s.calls[k]
        c.request_id = c.request_id or f"{s.session_id}#{k}"
        req = self.gateway.request(c.session_id, c.model, c.prompt_tokens, c.output_tokens)
        self.lease_service.arrival(req)
        if self.cfg.record:
            self._trace["router"].append({"t": self.clock.now(), "arrival": req})
        self._place((s, k, req))

    def _place(self, payload) -> None:
        """Algorithm 1 through the gateway, the judged lease settled by the router's ``LeaseService`` (a
        honoured one consumed atomically; lost to a race, the call is decided again without it). Mutates the
        gateway (commit), the lease store and the chosen instance's queue."""
        s, k, req = payload
        gw, ls = self.gateway, self.lease_service
        t0, p0 = time.thread_time_ns(), gw._decide_ns  # CPU time: other processes' slices on a shared machine excluded
        d, rev = gw.decide(req)
        self._policy_us.append((gw._decide_ns - p0) / 1e3)
        if not ls.settle_now(d, rev, req.session_id, req.model).stands:
            d, _ = gw.decide(req, use_lease=False)
            ls.settle_now(d, None, req.session_id, req.model)
        self._decide_us.append((time.thread_time_ns() - t0) / 1e3)
        if self.cfg.record:
            self._trace["router"].append({"t": self.clock.now(), "place": req, "decision": d, "call_id": s.calls[k].request_id})
        if d.instance_id is None:
            gw.stats["overload_queued" if d.reason == "overload" else "no_instance_retries"] += 1
            self._push(self.clock.now() + self.cfg.retry_s, "retry", payload)
            return
        inst = self.instances[d.instance_id]
        if self._busy.get(d.instance_id) != "moving" and req.model in inst.catalog:
            self._count_open(d.instance_id, req.model)
        if self._busy.get(d.instance_id) == "moving" or not inst.submit(s.calls[k], self.clock.now()):
            if not self.cfg.pool_sizer:
                raise RuntimeError(f"router placed {req.model} on {d.instance_id}, which cannot serve it")
            gw.stats["placed_on_moved_instance"] = gw.stats.get("placed_on_moved_instance", 0) + 1  # stale view of a move
            self._push(self.clock.now() + self.cfg.retry_s, "retry", payload)
            return
        ls.commit(req, d, s.calls[k].request_id)
        self._kick(d.instance_id)

    def _heartbeat(self, iid: str) -> None:
        self._publish(iid)
        self._push(self.clock.now() + self.cfg.heartbeat_s, "heartbeat", iid)

    def _publish(self, iid: str) -> None:
        snap = self.snapshot(iid)
        t0 = time.thread_time_ns()
        self.gateway.on_snapshot(snap)
        self._snapshot_us.append((time.thread_time_ns() - t0) / 1e3)
        if self.cfg.record:
            self._trace["router"].append({"t": self.clock.now(), "snapshot": snap.SerializeToString()})

    def snapshot(self, iid: str) -> pb.InstanceSnapshot:
        """The heartbeat the engine service would publish for this instance (engine/service.py layout)."""
        inst = self.instances[iid]
        inst.seq += 1
        now = self.clock.now()
        cost = inst.scheduler.costs.snapshot(inst.active)
        by_path = dict(cost["switch_by_path"])  # SwitchPath values -> seconds, as the engine's wire.instance_snapshot
        # the simulated weight bank holds every catalog model: opening one is a host-only switch
        by_path.setdefault(SwitchPath.OPEN, by_path.get(SwitchPath.HOST_ONLY, 0.0))
        snap = pb.InstanceSnapshot(
            schema_version=1, instance_id=iid, pool=pb.POOL_COLD if inst.pool == "cold" else pb.POOL_HOT, epoch=inst.epoch,
            seq=inst.seq, sent_unix=now, heartbeat_period_s=self.cfg.heartbeat_s, num_running=inst.running, num_waiting=inst.waiting,
            kv_usage=inst.kv_usage(), kv_pages_total=inst.kv_pages_total(),
            profile=pb.CostProfile(prefill_per_token=cost["prefill_per_token"], decode_step=cost["decode_step"],
                                   restore_per_token=cost["restore_per_token"], switch_costs=costs_to_proto(by_path)),
        )
        # host_kv stays False: each simulated instance's host tier is its own (a per-node CPU store, as in the
        # paper), so no other instance can restore from it (the real stack's kvstore is shared: wire.py sets it)
        staged = inst.staging[0] if inst.staging else None
        idle = not inst.running and not inst.waiting  # as the engine's SlotStats (slotted._refresh_gauges)
        waits = inst.scheduler.slot_waits(now, idle) if inst.pool == "cold" else {}
        costs = inst.scheduler.costs
        for m in inst.loaded:
            snap.models.append(pb.ModelState(model=m, loaded=self.resident(inst, m), active=m == inst.active, staged=m == staged,
                                             num_waiting=len(inst.queues[m]), slot_wait_s=waits.get(m, waits.get("", 0.0))))
        if inst.pool == "cold":  # catalog models it would have to open: they join the rotation after its open slots
            for m in inst.catalog:  # (the "" wait; without it an open was priced as if it could start at once)
                if m not in inst.loaded:
                    snap.models.append(pb.ModelState(model=m, loaded=False, slot_wait_s=waits.get("", 0.0)))
            if inst.pool == "cold" and costs.measured(m):  # each model's own costs, as the cold engine's ModelState.cost
                mc = costs.snapshot(m)
                snap.models[-1].cost.CopyFrom(pb.CostProfile(prefill_per_token=mc["prefill_per_token"], decode_step=mc["decode_step"],
                                                             restore_per_token=mc["restore_per_token"]))
        for sid, m, tokens, where in inst.sessions():
            snap.sessions.append(pb.SessionState(session_id=sid, model=m, committed_tokens=tokens,
                                                 state=pb.KV_DEVICE if where == "device" else pb.KV_HOST))
        return snap

    def resident(self, inst: SimInstance, model: str) -> bool:
        """Whether ``model`` is resident on ``inst`` in the sense of ``SimConfig.device_residency``. Pure read."""
        if inst.pool == "hot" or not self.cfg.device_residency:
            return model in inst.loaded
        return model == inst.active or (inst.staging is not None and inst.staging[0] == model)

    def _count_open(self, iid: str, model: str) -> None:
        """§5.3's count on the workers' own state when the call reaches the chosen one: an open when the model is
        not resident there, avoidable when another healthy instance has it resident (the router counts the same
        on its view, which may be a heartbeat old). Mutates ``worker_opens``."""
        if self.resident(self.instances[iid], model):
            return
        self.worker_opens["opens"] += 1
        if any(j != iid and self.resident(i, model) and self._busy.get(j) != "moving" for j, i in self.instances.items()):
            self.worker_opens["avoidable_opens"] += 1

    def _hook(self, c: SimCall) -> None:
        hook = pb.CompletionHook(
            schema_version=1, request_id=c.request_id, session_id=c.session_id, model=c.model, instance_id=c.instance,
            prefix=cpb.PrefixHandle(model=c.model, committed_tokens=c.prompt_tokens + c.decoded, page_size=self.cfg.profile.page_tokens),
            usage=cpb.Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.decoded, cached_tokens=c.cached, restored_tokens=c.restored),
            finish_reason="length", arrival_unix=c.intended, finish_unix=self.clock.now(),
            ttft_seconds=(c.first_token_at or 0.0) - c.intended,
        )
        if c.tool:
            hook.tool_names.append(c.tool)
        lease = self.lease_service.on_hook(hook)
        if lease is not None:
            self.leases.install_now(lease)
            # the router's retention hint to the instance holding the session's KV (services/router/service.py)
            self.instances[c.instance].expect(c, self.clock.now(), *self.lease_service.retention_gap(lease), lease.t_exp_unix - lease.t_done_unix)
        if self.cfg.record:
            self._trace["router"].append({"t": self.clock.now(), "hook": hook.SerializeToString(), "lease": lease is not None})

    # ------------------------------------------------------------------ pool sizing
    def _pools(self, _: Any) -> None:
        """A pool-sizing period: the sizer decides from the gateway's telemetry; idle instances move."""
        loop = self.cfg.pool_sizer
        for iid, pool, model in loop.step(self, self.clock.now()):
            inst = self.instances[iid]
            if not inst.idle() or self._busy[iid]:
                continue
            spec = loop.catalog if pool == "cold" else (model,)
            secs = inst.reconfigure(pool, list(spec), model, self.cfg.slot if pool == "cold" else _hot(self.cfg.slot))
            self.gateway.pools[iid] = PoolSpec(pool, tuple(spec), self.cfg.profile.page_tokens, self.gateway.pools[iid].max_num_seqs)
            self._publish(iid)  # the new epoch and pool reach the router at once
            self._busy[iid] = "moving"
            self._push(self.clock.now() + secs, "moved", iid)
        if self._left > 0:
            self._push(self.clock.now() + loop.period_s, "pools", None)

    def _moved(self, iid: str) -> None:
        self._busy[iid] = False
        self._publish(iid)
        self._kick(iid)

    # ------------------------------------------------------------------ instance side
    def _kick(self, iid: str) -> None:
        """Run the instance's scheduler until it starts a timed action or idles. Mutates the instance."""
        if self._busy[iid]:
            return
        inst = self.instances[iid]
        now = self.clock.now()
        view = inst.view(now)
        d = inst.scheduler.decide(view, now)
        if self.cfg.record:
            self._trace["slots"][iid].append(("decide", now, view, d))
        self._take_rounds(iid, inst)
        if d.switch_to is not None:
            path, secs, _ = inst.switch(d.switch_to, now)
            self._busy[iid] = True
            self._push(now + secs, "done", (iid, "switch", (path, secs)))
        elif d.run_step:
            inst.admit(d.admit, now)
            out = inst.step(now)
            self._busy[iid] = True
            self._push(now + out.seconds, "done", (iid, "step", out))
        elif d.hold_s > 0:  # the slot is held for expected returns (slots/hold.py): ask again then, or on an arrival
            self._push(now + d.hold_s, "wake", iid)
        inst.restage(now)

    def _take_rounds(self, iid: str, inst: SimInstance) -> None:
        """Collect the rounds (or, under token deadlines, the epochs) the instance's scheduler closed, as the
        engine does (``take_summaries``). Mutates ``_rounds``."""
        self._rounds.extend((iid, rs) for rs in inst.scheduler.take_summaries())

    def _done(self, payload) -> None:
        iid, kind, what = payload
        inst = self.instances[iid]
        self._busy[iid] = False
        now = self.clock.now()
        if kind == "switch":
            path, secs = what
            inst.scheduler.observe_switch(path, secs)
            if self.cfg.record:
                self._trace["slots"][iid].append(("switch", path, secs))
        else:
            obs = inst.observed()
            inst.scheduler.observe_step(inst.active or "", *obs)
            if self.cfg.record:
                self._trace["slots"][iid].append(("step", inst.active or "", *obs))
            for c in what.finished:
                self._progress = now
                inst.keep(c, now)
                self._hook(c)
                self._left -= 1
                s, k = self._owner(c)
                if k + 1 < len(s.calls):
                    nxt = s.calls[k + 1]
                    nxt.intended = now + min(GAP_CAP_S, nxt.gap_s)
                    self._push(nxt.intended, "arrive", (s, k + 1))
        self._kick(iid)

    def _owner(self, c: SimCall) -> tuple[SimSession, int]:
        return self._by_sid[c.session_id], c.index

    @property
    def _by_sid(self) -> dict[str, SimSession]:
        m = getattr(self, "_sid_map", None)
        if m is None:
            m = self._sid_map = {s.session_id: s for s in self.sessions}
        return m

    # ------------------------------------------------------------------ results
    def _result(self, wall: float) -> RunResult:
        calls = [c for s in self.sessions for c in s.calls]
        sct = {s.session_id: s.calls[-1].finished_at - s.calls[0].intended for s in self.sessions if s.calls}
        inst = {
            iid: {"pool": i.pool, "parked": i.parked, "steps": i.steps, "step_s": i.step_s, "switch_s": i.switch_s, "switches": len(i.switches),
                  "host_kv": asdict(i.host.counters) if i.host else None, "deadlines": i.tracker.totals().to_dict(),
                  "streams": i.streams, "stream_stall_s": i.stream_stall_s, "startup_k": list(i.startup_k), "layer_groups": i.groups,
                  "residency": i.residency.snapshot() if i.residency is not None else None}
            for iid, i in self.instances.items()
        }
        switches = [dict(sw, instance=iid) for iid, i in self.instances.items() for sw in i.switches]
        router = {**self.lease_service.metrics(), "worker_opens": dict(self.worker_opens)}
        return RunResult(self.cfg.name, calls, sct, router, self._rounds, switches, self.clock.now(), wall,
                         self._decide_us, self._policy_us, self._snapshot_us, inst, self._trace)


def _hot(slot: SlotPolicy) -> SlotPolicy:
    from dataclasses import replace

    return replace(slot, endless=True)
