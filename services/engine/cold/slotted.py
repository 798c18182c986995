"""The slot scheduler driving the real cold engine (``services/engine/cold.py``).

:class:`SlottedColdEngine` is a :class:`~services.engine.cold.ColdEngine` whose ``step()`` asks
:class:`~services.engine.slots.scheduler.SlotScheduler` what to do instead of the idle-switch rule: it
builds an :class:`InstanceView` from the per-model queues and the active shell (running / prefilling
calls, device-resident session prefixes, host-restorable ones when a host KV tier is attached, free KV),
then carries out the decision — switch at a slot boundary (the five-phase switch of the substrate), hand
exactly the admitted calls to the active shell, run one shell step — and reports measured step and switch
times back into the scheduler's EWMA profile.

``slots/`` is the pure policy; this module (outside it) is the only one that touches the executor for it.
The cold engine cannot park in-flight calls across a switch, so ``can_park`` is False (Dfin drains).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from services.engine.api import SlotStats
from services.engine.cold import ColdEngine
from services.engine.types import EngineRequest, RequestOutput

from services.engine.slots import CallView, CostModel, CostProfile, Decision, InstanceView, ModelView, Phase, SlotPolicy
from services.engine.slots.types import ReturnView
from services.engine.slots.deadlines import DeadlineTargets, DeadlineTracker, make_scheduler


class SlottedColdEngine(ColdEngine):
    def __init__(self, catalog, *, policy: SlotPolicy | None = None, costs: CostModel | None = None, **kw: Any) -> None:
        pol = policy or SlotPolicy()
        kw.setdefault("staging", pol.d2d_staging)
        # per-token deadlines are tracked in both modes (attainment and gap distribution in every round
        # summary); with ``token_deadlines`` they also drive the schedule (Aegaeon, slots/deadlines.py)
        self.deadlines = DeadlineTracker(DeadlineTargets(pol.ttft_s, pol.tpot_s))
        self.slots = make_scheduler(pol, costs or CostModel(CostProfile()), self.deadlines)
        self.last_decision: Decision | None = None
        self._return_hold = pol.return_hold and pol.sp and not pol.token_deadlines
        self._served_sessions: set[tuple[str, str]] = set()  # (model, session) with a finished call here
        self._req_session: dict[str, tuple[str, str]] = {}
        # (model, session) -> (completion tokens, uncached prompt tokens, context, wall time it was admitted) of
        # its last call here: what a return is predicted to cost when the slot is held for it (slots/hold.py),
        # and which retention hint is about that call (one whose call ended after it was admitted); bounded
        self._last_call: dict[tuple[str, str], tuple[int, int, int, float]] = {}
        self._admit_wall: dict[str, float] = {}  # request -> wall time (the hints' clock) it joined the batch
        self._slots_now: SlotStats | None = None
        super().__init__(catalog, **kw)

    # ------------------------------------------------------------------ the view
    def _call_view(self, req: EngineRequest, active_engine) -> CallView:
        m, sid = req.model, req.session_id
        prefix, state = 0, "missing"
        sh = (active_engine if m == self.active else None) or self.shell(m)
        if sid and sh is not None:  # the KV manager answers where the prefix is (device, host via its index)
            hk = sh.host_kv
            state, prefix = sh.kv.session_prefix(sid, req.prompt_token_ids, hk.host_index() if hk is not None else None, device=m == self.active)
        return CallView(
            req.request_id, m, req.arrival_time, len(req.prompt_token_ids), req.sampling.max_tokens, sid, prefix, state,
            (m, sid) in self._served_sessions,
        )

    def first_prefill_tokens(self, model: str) -> int:
        """Tokens the first forward after a switch to ``model`` computes, at least: the slot's P admission may
        take a single waiting call (its prefill share of the round), so the smallest of their prompts minus the
        prefix the KV manager will restore (a return's first forward is its new suffix, not its whole context),
        at most one step's token budget. A lower bound on purpose: a stream sized for more compute than the
        forward has stalls it (the simulator measured that: k* sized for every waiting call's whole prompt
        left ~1.3 s stalls on most streamed switches of the paper replay). Pure read."""
        views = [self._call_view(r, None) for r in self._queues.get(model, ())]
        return self._one_step(model, min((max(1, v.prompt_tokens - v.prefix_tokens) for v in views), default=0))

    def slot_view(self) -> InstanceView:
        eng = self.shell(self.active) if self.active is not None else None
        models = []
        free_tokens = None
        now = self.clock()
        for m in self.loaded:
            for r in self._queues.get(m, ()):
                self.deadlines.arrive(r.request_id, m, r.arrival_time or now, self._targets(r))
            queued = tuple(self._call_view(r, eng) for r in self._queues.get(m, ()))
            if m == self.active and eng is not None:
                sch = eng.scheduler
                seqs = list(sch.running) + list(sch.waiting) + eng.restoring_sequences()
                pending = eng.pending_requests()
                prefilling = sum(1 for s in seqs if s.num_completion_tokens == 0) + len(pending)
                remaining = [s.sampling.max_tokens - s.num_completion_tokens for s in seqs] + [r.sampling.max_tokens for r in pending]
                models.append(ModelView(m, len(seqs) + len(pending), prefilling, max(remaining, default=0), queued))
                held = sum(len(s.pages) for s in sch.running)
                free_tokens = max(0, eng.kv.num_pages - held) * self.page_size
            else:
                models.append(ModelView(m, 0, 0, 0, queued))
        # the scheduler reads returns only to decide a hold: when the active model has nothing in flight and
        # another has work (a step's view skips the hint scan otherwise)
        if self._return_hold and any(mv.model == self.active and mv.running == 0 for mv in models) and any(mv.has_work for mv in models):
            returns = self._returns()
            models = [replace(mv, returns=returns[mv.model]) if returns.get(mv.model) else mv for mv in models]
        frac = {m: self.substrate.staged_fraction(m) for m in self.loaded if m != self.active}
        return InstanceView(self.active, tuple(models), free_tokens, frac, can_park=False)

    def _returns(self) -> dict[str, tuple[ReturnView, ...]]:
        """Per model, the sessions whose last call ended here and whose return the router's lease expects (its
        retention hint, window still open), none of them queued or running now. Pure read."""
        book = self._retention
        if book is None:
            return {}
        busy = {r.session_id for m in self.loaded for r in self._queues.get(m, ())} | {sid for _, sid in self._req_session.values()}
        out: dict[str, list[ReturnView]] = {}
        for sid, h, elapsed in book.leased():
            last = self._last_call.get((h.model, sid))
            if last is None or sid in busy or h.model not in self.loaded or h.t_done_unix <= last[3]:
                continue  # not served here, back already, or a hint about an earlier call (its return has come)
            out.setdefault(h.model, []).append(ReturnView(sid, elapsed, h.gap_mu, h.gap_sigma, h.window_s, *last[:3]))
        return {m: tuple(v) for m, v in out.items()}

    def idle_wait_s(self) -> float:
        """The slot is held for expected returns (``slots/hold.py``): the step loop sleeps up to this long."""
        d = self.last_decision
        return d.hold_s if d is not None and d.phase is Phase.HOLD else 0.0

    # ------------------------------------------------------------------ the policy's hooks (ColdEngine.step)
    def _schedule(self) -> Collection[str] | object | None:
        """The slot scheduler's decision: switch at a slot boundary (then the new slot opens), or honour a
        control-plane OPEN_MODEL on an idle instance; returns the queued calls to admit, or None for no step.
        Mutates: the active model, the scheduler's state and cost model, ``last_decision``."""
        d = self.slots.decide(self.slot_view(), self.clock())
        if d.switch_to is not None:
            t0 = self.clock()
            rec = self._switch(d.switch_to, "slot")
            self.slots.observe_switch(rec.path, self.clock() - t0)
            d = self.slots.decide(self.slot_view(), self.clock())  # the new slot opens (P)
        elif d.phase == Phase.IDLE and self.requested is not None and self.requested != self.active:
            # A control-plane OPEN_MODEL on an idle instance: no round is open, so switching now
            # costs no slot anything; the next call of the requested model starts its slot.
            t0 = self.clock()
            rec = self._switch(self.requested, "requested")
            self.slots.observe_switch(rec.path, self.clock() - t0)
        elif d.phase is Phase.DFIN and self.active is not None:
            self._write_back_early(self.active)
        self.last_decision = d
        return frozenset(d.admit or ()) if d.run_step else None

    def _write_back_early(self, model: str) -> None:
        """The slot ends (its final drain, Dfin): start writing back the model's dirty sessions now, so the
        switch barrier (``HostKV.drain``) waits only for what the last calls leave (``kv/write_back.py``).
        Mutates: the tier's dirty set and job queue."""
        sh = self._shells.get(model)
        hk = sh.engine.host_kv if sh is not None else None
        if hk is not None and len(hk.dirty):
            hk.write_back(None, "slot_end")

    def _admitted(self, req: EngineRequest) -> None:
        if req.session_id:
            self._req_session[req.request_id] = (req.model, req.session_id)
            if self._retention is not None:
                self._admit_wall[req.request_id] = self._retention.wall()

    def _step_shell(self, eng) -> list[RequestOutput]:
        return self._timed_step(eng)

    def _targets(self, req: EngineRequest) -> DeadlineTargets | None:
        """The call's token deadlines: its per-call hints (validated at intake) over the configured targets."""
        if not (req.ttft_target_s or req.tpot_target_s):
            return None
        d = self.deadlines.default
        return DeadlineTargets(req.ttft_target_s or d.ttft_s, req.tpot_target_s or d.tpot_s)

    def _finished(self, out: RequestOutput) -> None:
        super()._finished(out)
        self.deadlines.finish(out.request_id)
        ms = self._req_session.pop(out.request_id, None)
        admitted = self._admit_wall.pop(out.request_id, None)
        if ms is not None:
            self._served_sessions.add(ms)
            u = out.usage
            if u is not None and admitted is not None:
                self._last_call.pop(ms, None)
                self._last_call[ms] = (u.completion_tokens, max(0, u.prompt_tokens - u.cached_tokens), u.prompt_tokens + u.completion_tokens, admitted)
                while len(self._last_call) > 4096:
                    del self._last_call[next(iter(self._last_call))]

    def _refresh_gauges(self) -> None:
        super()._refresh_gauges()
        # the pure policy is not thread-safe: read at step boundaries; idle (nothing queued or running): the
        # slot the last step left open closes at the next decision, so no model waits for it
        with self._intake_lock:
            idle = not self._live
        st = self.slots.status(self.clock(), idle=idle)
        dl = self.deadlines.totals()  # per-token deadlines, scored in both modes
        self._slots_now = SlotStats(bool(st["deadline_risk"]), float(st["shortfall_s"]), float(st["round_remaining_s"]), tuple(st["infeasible"]),
                                    int(st["rounds"]), str(st.get("mode", "rounds")), dl.attainment, dl.ttft_attainment, dl.gap_p99_s,
                                    tuple((st.get("slot_wait_s") or {}).items()))

    def _slot_stats(self) -> SlotStats | None:
        return self._slots_now

    def _timed_step(self, eng) -> list[RequestOutput]:
        """One shell step, measured into the slot cost model (decode steps, prefill tokens), and the real
        host KV restores that ended meanwhile (they run off the executor thread, so their cost is their
        own measured transfer time, not a share of a step): the restore cost per token is learned from
        real restores. Mutates: the shell and the cost model."""
        before = {s.request_id: s.num_computed_tokens for s in eng.scheduler.running}
        t0 = self.clock()  # durations on the policy's time base (the injected clock)
        outs = eng.step()
        t1 = self.clock()
        dt = t1 - t0
        for o in outs:
            if o.new_token_ids:
                self.deadlines.emit(o.request_id, len(o.new_token_ids), t1)
        prefill, decodes = 0, 0
        for s in eng.scheduler.running:
            delta = s.num_computed_tokens - before.get(s.request_id, 0)
            if s.request_id in before and delta == 1:
                decodes += 1
            elif s.request_id not in before:
                prefill += max(s.num_computed_tokens - s.num_cached_tokens, 0)  # admitted this step
            else:
                prefill += max(delta, 0)
        decodes += sum(1 for o in outs if o.finished and o.request_id in before)
        self.slots.observe_step(self.active, prefill, 0, decodes, dt)  # restores are not inside the step
        if eng.host_kv is not None:
            for tokens, seconds in eng.host_kv.take_restore_samples():
                self.slots.observe_restore(self.active, tokens, seconds)
        tokens, position = _prefill_shape(eng, before)
        self.slots.observe_shape(self.active, tokens, position, 0, decodes, dt)
        return outs

    def take_round_summaries(self):
        """Round summaries not yet handed out (the service publishes them on ``.round``)."""
        with self._step_lock:
            return self.slots.take_summaries()


def _prefill_shape(eng, before: dict[str, int]) -> tuple[int, float]:
    """Prefill tokens the shell's last step computed for its running sequences and their token-weighted mean
    position (the prefill cost is learned by context). ``before``: computed tokens per request id
    before the step. A one-token advance of a known sequence is its decode, as in ``_timed_step``."""
    tokens, weighted = 0, 0.0
    for s in eng.scheduler.running:
        if s.request_id in before:
            start, n = before[s.request_id], s.num_computed_tokens - before[s.request_id]
            if n <= 1:
                continue
        else:
            start, n = s.num_cached_tokens, s.num_computed_tokens - s.num_cached_tokens
        if n > 0:
            tokens += n
            weighted += n * (start + n / 2)
    return tokens, (weighted / tokens if tokens else 0.0)


def policy_from_config(cfg) -> SlotPolicy:
    """The slot policy of a cold ``EngineConfig`` (talaria/config.py): targets, margin and ablation switches.
    (A hot engine is an ``executor.Engine`` and has no slot policy; ``SlotPolicy.endless`` is the
    simulator's model of one, ``sim/cluster.py``.)"""
    return SlotPolicy(
        ttft_s=cfg.slot_ttft_s, tpot_s=cfg.slot_tpot_s, gamma=cfg.slot_gamma, sp=cfg.sp, host_kv=cfg.host_kv,
        d2d_staging=cfg.d2d_staging, sp_gain_check=cfg.sp_gain_check, sp_new_sessions=cfg.sp_new_sessions, token_deadlines=cfg.token_deadlines,
        return_hold=cfg.return_hold,
    )
