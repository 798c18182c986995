"""Carrying out unified residency plans on the cold engine (JointServe §3, §4.2).

``residency.py`` is the pure policy and ``residency_candidates.py`` turns an instance's state into its objects (the
same code the simulator calls); this module (outside them, like ``cold/slotted.py`` for ``slots/``) is the only one
that reads the engine for them (``ResidencyDriver.state``) and executes their plans:

* **objects** — one device budget: the active model's KV region (``num_pages × page bytes``). Protected:
  the pages of running sequences plus the KV the active model's queued calls will need (so a plan never
  takes memory its own next admissions need). Candidates: the session prefixes cached on the device for the
  active model (recovery: restore from the host KV store when its tier holds the session — measured restore
  seconds per token — else recompute, measured prefill seconds per token) and the layer groups of every
  inactive model (``substrate/groups.py``; size = the staging slots their chunks take; recovery = their bytes
  at the measured host→device rate of past switches). With streaming hot-swap (``partial_layers``) only the
  startup prefix k* (measured, ``streaming_swap``) has a recovery cost: later groups stream in behind the
  first prefill, so a cold model keeps only its startup prefix (JointServe §3-4, partial residency).
  Expected reuses come from ``ReuseSignals``.
* **carry out** — weights: ``MemorySubstrate.stage_plan`` keeps staged exactly the planned layer-group
  prefixes of inactive models (releases the rest, stages what is missing, a few chunks per step); KV: session
  prefixes outside the target are dropped from the device session cache (``release``; a prefix the host
  tier holds is restored from there when its session returns, otherwise recomputed — ``offload`` is carried
  out as that release, since every ended call is checkpointed by the host tier already when one is attached).

Replanning happens every ``every_steps`` executor steps (the plan's version moves only when the target
changes). Mutates: the staging area and the active shell's session cache, through the engine's own objects.
"""

from __future__ import annotations

from typing import Any

from services.engine.residency import ResidencyManager, ResidencyObject, ResidencyPlan, ReuseSignals
from services.engine.residency_candidates import CachedPrefix, GroupState, InactiveModel, InstanceState, candidates, startup_groups
from services.engine.substrate.groups import layer_groups
from services.engine.substrate.staging import ChunkState
from services.engine.substrate.switch import kv_page_bytes
from talaria.ewma import Ewma


class ResidencyDriver:
    def __init__(self, *, window_s: float = 10.0, layers_per_group: int = 1, every_steps: int = 4, chunks_per_step: int = 8,
                 h2d_bytes_per_s_prior: float = 2e9, prefill_per_token_prior: float = 1e-4, budget_fraction: float = 1.0) -> None:
        if not 0 < budget_fraction <= 1:
            raise ValueError("budget_fraction must be in (0, 1]")
        self.budget_fraction = budget_fraction
        self.manager = ResidencyManager()
        self.signals = ReuseSignals(window_s=window_s)
        self.layers_per_group = layers_per_group
        self.every_steps = max(1, every_steps)
        self.chunks_per_step = chunks_per_step
        self.h2d_bytes_per_s = Ewma(h2d_bytes_per_s_prior)
        self.prefill_prior = prefill_per_token_prior
        self.plan: ResidencyPlan | None = None
        self._steps = 0
        self._last_switch_seq = 0
        self.released_sessions = 0
        self._seen_calls: set[str] = set()
        self.prompt_tokens: dict[str, Ewma] = {}  # per model: prompt length of its calls (the first prefill after a switch)

    # ------------------------------------------------------------------ signals and measurements
    def observe(self, ce, now: float) -> None:
        """New calls and switch records feed the reuse signals and the measured H2D rate."""
        calls = [(r.request_id, r.model, r.session_id, len(r.prompt_token_ids)) for r in ce.queues.all_waiting()]
        eng = ce.shell(ce.active) if ce.active is not None else None
        if eng is not None:  # calls handed to the active shell at once never wait in a queue
            calls += [(s.request_id, ce.active, s.session_id, s.num_prompt_tokens) for s in list(eng.scheduler.running) + list(eng.scheduler.waiting)]
        live = set()
        for rid, model, session, n in calls:
            live.add(rid)
            if rid not in self._seen_calls:
                self.signals.observe_call(model, session, now)
                self.prompt_tokens.setdefault(model, Ewma(float(n))).add(float(n))
        self._seen_calls = live  # a call is counted once, while it waits or runs
        for rec in list(ce.switch_records):
            if rec.seq > self._last_switch_seq:
                self._last_switch_seq = rec.seq
                if rec.host_bytes and rec.h2d_seconds > 0:
                    self.h2d_bytes_per_s.add(rec.host_bytes / rec.h2d_seconds)

    # ------------------------------------------------------------------ objects
    def objects(self, ce, now: float) -> tuple[list[ResidencyObject], int]:
        """The candidates and protected objects of the instance (``residency_candidates.candidates`` on
        :meth:`state`), and the budget in bytes. Mutates only the reuse signals' session clocks."""
        st = self.state(ce)
        if st is None:
            return [], 0
        state, budget = st
        return candidates(state, self.signals, now), budget

    def state(self, ce) -> tuple[InstanceState, int] | None:
        """The engine read as ``residency_candidates.InstanceState`` (the active shell's running and queued
        calls, its idle cached session prefixes, the staging area's layer groups), and the budget in bytes;
        None with no active shell or no staging area. Pure read."""
        a = ce.active
        eng = ce.shell(a) if a is not None else None
        if eng is None or ce.substrate.area is None:
            return None
        pb = kv_page_bytes(ce.bank[a], ce.page_size)
        budget = int(eng.kv.num_pages * pb * self.budget_fraction)
        sch = eng.scheduler
        running_pages = sum(len(s.pages) for s in sch.running)
        queued_tokens = sum(len(r.prompt_token_ids) + r.sampling.max_tokens for r in ce.queues.waiting(a))
        queued_tokens += sum(s.num_tokens + s.sampling.max_tokens for s in sch.waiting)
        need = running_pages + -(-queued_tokens // ce.page_size)
        prof = eng.stats().profile
        state = InstanceState(a, need * pb, prof.prefill_per_token or self.prefill_prior, prof.restore_per_token or None,
                              self._cached(eng, a, pb), self._inactive(ce, a))
        return state, budget

    @staticmethod
    def _cached(eng, model: str, pb: int) -> tuple[CachedPrefix, ...]:
        """The active shell's cached session prefixes that no running or waiting call of it holds."""
        hk = eng.host_kv
        busy = {s.session_id for s in eng.scheduler.running} | {s.session_id for s in eng.scheduler.waiting}
        return tuple(CachedPrefix(e.session_id, model, len(e.token_ids), len(e.pages) * pb, e.last_access,  # engine clock
                                  hk is not None and hk.available() and e.session_id in hk.sessions)
                     for e in eng.kv.session_entries() if e.session_id not in busy)

    def _inactive(self, ce, active: str) -> tuple[InactiveModel, ...]:
        """Every loaded model but the active one: its queued calls, whether a switch to it is requested, its
        startup prefix and its layer groups (staging slots they take, reload seconds at the measured H2D rate,
        staged now)."""
        area = ce.substrate.area
        slot_bytes = area.k * area.geom.seg_bytes
        rate = max(self.h2d_bytes_per_s.value, 1.0)
        queued = ce.queues.counts()
        out = []
        for m in ce.loaded:
            if m == active:
                continue
            clean = area.clean(m)
            gs = layer_groups(ce.bank[m], self.layers_per_group)
            groups = tuple(GroupState(len(g.chunks) * slot_bytes, g.nbytes / rate, all(j in clean for j in g.chunks)) for g in gs)
            out.append(InactiveModel(m, queued.get(m, 0), ce.requested == m, self._startup_prefix(ce, m), groups))
        return tuple(out)

    def _startup_prefix(self, ce, model: str) -> int:
        """Groups whose loss is on the first-token path: all without streaming (or a streamer grouping layers
        otherwise); k* (measured, ``streaming_swap``) with it."""
        st = getattr(ce, "streamer", None)
        n = len(layer_groups(ce.bank[model], self.layers_per_group))
        k_for = None if st is None or st.layers_per_group != self.layers_per_group else (lambda t: st.k_for(model, t))
        usual = self.prompt_tokens[model].value if model in self.prompt_tokens else None
        return startup_groups(n, k_for, lambda: ce.first_prefill_tokens(model), usual)

    # ------------------------------------------------------------------ plan and carry out
    def step(self, ce, now: float) -> bool:
        """Replan every ``every_steps`` calls and carry the current plan out a few chunks at a time. Returns
        whether staging work is pending. Mutates: staging area, active session cache, own plan."""
        self.observe(ce, now)
        self._steps += 1
        if self.plan is None or self._steps % self.every_steps == 0:
            objs, budget = self.objects(ce, now)
            if budget <= 0:
                return False
            self.plan = self.manager.plan(objs, budget)
            self._release_sessions(ce, self.plan)
        return self._stage(ce, self.plan)

    def _release_sessions(self, ce, plan: ResidencyPlan) -> None:
        eng = ce.shell(ce.active) if ce.active is not None else None
        if eng is None:
            return
        for act in plan.actions:
            if act.key[0] == "kv" and act.op in ("release", "offload") and act.key[1] == ce.active:
                if eng.host_kv is not None and act.key[2] in eng.host_kv.dirty:  # write-back: it leaves the device
                    eng.host_kv.write_back([act.key[2]], "residency")
                if eng.kv.drop_session_entry(act.key[2]):
                    self.released_sessions += 1

    def _stage(self, ce, plan: ResidencyPlan) -> bool:
        targets: dict[str, list[int]] = {}
        for m in ce.loaded:
            if m == ce.active:
                continue
            k = plan.weight_prefix(m)
            if k:
                gs = layer_groups(ce.bank[m], self.layers_per_group)[:k]
                targets[m] = [j for g in gs for j in g.chunks]
        targets = dict(sorted(targets.items(), key=lambda kv_: -self._reuse(plan, kv_[0])))
        started = ce.substrate.stage_plan(targets, self.chunks_per_step)
        area = ce.substrate.area
        writing = area is not None and any(c.state is ChunkState.WRITING for c in area.chunks.values())
        return bool(started) or writing

    @staticmethod
    def _reuse(plan: ResidencyPlan, model: str) -> float:
        return max((c.reuse for c in plan.choices if c.key[0] == "weights" and c.key[1] == model), default=0.0)

    def snapshot(self) -> dict[str, Any]:
        p = self.plan
        if p is None:
            return {"version": 0}
        staged = {k[1]: p.weight_prefix(k[1]) for k in p.target if k[0] == "weights"}
        return {"version": p.version, "budget_bytes": p.budget_bytes, "target_bytes": p.target_bytes,
                "protected_bytes": p.protected_bytes, "value_s": p.value_s, "shortfall_bytes": p.shortfall_bytes,
                "weight_prefix": staged, "kv_kept": len(p.kept("kv")), "released_sessions": self.released_sessions}
