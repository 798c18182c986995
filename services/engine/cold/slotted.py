"""The slot scheduler as the cold engine's switch policy (``cold/policy.py``).

:class:`SlotSwitching` is the ``SwitchPolicy`` a cold engine is composed with by default: at every step it
asks :class:`~services.engine.slots.scheduler.SlotScheduler` (or, with ``token_deadlines``, the
``DeadlineScheduler``) what to do through the one slot driver (``cold/driver.py``), for which it is the
engine's port: it builds an :class:`InstanceView` from the engine's per-model queues and the active shell
(running / prefilling calls, device-resident session prefixes, host-restorable ones when a host KV tier is
attached, free KV), carries out the decision -- a switch at a slot boundary (the engine's five-phase switch),
exactly the admitted calls for the active shell's next step -- and reports measured step and switch times back
into the scheduler's EWMA profile.

``slots/`` is the pure policy; this module (outside it) is the only one that reads the engine for it.
The cold engine cannot park in-flight calls across a switch, so ``can_park`` is False (Dfin drains).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from services.engine.api import KvLocation, SlotStats
from services.engine.cold.driver import SlotDriver
from services.engine.cold.policy import NO_STEP, Turn, admit_only
from services.engine.types import EngineRequest, RequestOutput

from services.engine.slots import CallView, CostModel, CostProfile, Decision, InstanceView, ModelView, Phase, SlotPolicy
from services.engine.slots.types import ReturnView
from services.engine.slots.deadlines import DeadlineTargets, DeadlineTracker, make_scheduler

if TYPE_CHECKING:
    from services.engine.cold.engine import ColdEngine
    from services.engine.executor import Engine


class SlotSwitching:
    """The slot scheduler's switch policy, and the engine's ``SlotPort`` for the slot driver."""

    def __init__(self, policy: SlotPolicy | None = None, costs: CostModel | None = None) -> None:
        pol = policy or SlotPolicy()
        self.staging = pol.d2d_staging
        # per-token deadlines are tracked in both modes (attainment and gap distribution in every round
        # summary); with ``token_deadlines`` they also drive the schedule (Aegaeon, slots/deadlines.py)
        self.deadlines = DeadlineTracker(DeadlineTargets(pol.ttft_s, pol.tpot_s))
        self.slots = make_scheduler(pol, costs or CostModel(CostProfile()), self.deadlines)
        self.driver = SlotDriver(self.slots, self)
        self._return_hold = pol.return_hold and pol.sp and not pol.token_deadlines
        self._served_sessions: set[tuple[str, str]] = set()  # (model, session) with a finished call here
        self._req_session: dict[str, tuple[str, str]] = {}
        # (model, session) -> (completion tokens, uncached prompt tokens, context, wall time it was admitted) of
        # its last call here: what a return is predicted to cost when the slot is held for it (slots/hold.py),
        # and which retention hint is about that call (one whose call ended after it was admitted); bounded
        self._last_call: dict[tuple[str, str], tuple[int, int, int, float]] = {}
        self._admit_wall: dict[str, float] = {}  # request -> wall time (the hints' clock) it joined the batch
        self._slots_now: SlotStats | None = None
        self._turn: Turn = NO_STEP
        self.ce: ColdEngine | None = None

    def bind(self, engine: ColdEngine) -> None:
        self.ce = engine

    @property
    def last_decision(self) -> Decision | None:
        """The decision of the latest step (after a switch, the new slot's)."""
        return self.driver.last

    # ------------------------------------------------------------------ the view (SlotPort)
    def _call_view(self, req: EngineRequest, active_engine) -> CallView:
        ce = self.ce
        m, sid = req.model, req.session_id
        prefix, state = 0, KvLocation.MISSING
        sh = (active_engine if m == ce.active else None) or ce.shell(m)
        if sid and sh is not None:  # the KV manager answers where the prefix is (device, host via its index)
            hk = sh.host_kv
            state, prefix = sh.kv.session_prefix(sid, req.prompt_token_ids, hk.host_index() if hk is not None else None, device=m == ce.active)
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
        views = [self._call_view(r, None) for r in self.ce.queues.waiting(model)]
        return self.ce.one_step_tokens(model, min((max(1, v.prompt_tokens - v.prefix_tokens) for v in views), default=0))

    def slot_view(self, now: float) -> InstanceView:
        ce = self.ce
        eng = ce.shell(ce.active) if ce.active is not None else None
        models = []
        free_tokens = None
        for m in ce.loaded:
            waiting = ce.queues.waiting(m)
            for r in waiting:
                self.deadlines.arrive(r.request_id, m, r.arrival_time or now, self._targets(r))
            queued = tuple(self._call_view(r, eng) for r in waiting)
            if m == ce.active and eng is not None:
                sch = eng.scheduler
                seqs = list(sch.running) + list(sch.waiting) + eng.restoring_sequences()
                pending = eng.pending_requests()
                prefilling = sum(1 for s in seqs if s.num_completion_tokens == 0) + len(pending)
                remaining = [s.sampling.max_tokens - s.num_completion_tokens for s in seqs] + [r.sampling.max_tokens for r in pending]
                models.append(ModelView(m, len(seqs) + len(pending), prefilling, max(remaining, default=0), queued))
                held = sum(len(s.pages) for s in sch.running)
                free_tokens = max(0, eng.kv.num_pages - held) * ce.page_size
            else:
                models.append(ModelView(m, 0, 0, 0, queued))
        # the scheduler reads returns only to decide a hold: when the active model has nothing in flight and
        # another has work (a step's view skips the hint scan otherwise)
        if self._return_hold and any(mv.model == ce.active and mv.running == 0 for mv in models) and any(mv.has_work for mv in models):
            returns = self._returns()
            models = [replace(mv, returns=returns[mv.model]) if returns.get(mv.model) else mv for mv in models]
        frac = {m: ce.substrate.staged_fraction(m) for m in ce.loaded if m != ce.active}
        return InstanceView(ce.active, tuple(models), free_tokens, frac, can_park=False)

    def _returns(self) -> dict[str, tuple[ReturnView, ...]]:
        """Per model, the sessions whose last call ended here and whose return the router's lease expects (its
        retention hint, window still open), none of them queued or running now. Pure read."""
        ce = self.ce
        book = ce.retention
        if book is None:
            return {}
        busy = {r.session_id for r in ce.queues.all_waiting()} | {sid for _, sid in self._req_session.values()}
        out: dict[str, list[ReturnView]] = {}
        for sid, h, elapsed in book.leased():
            last = self._last_call.get((h.model, sid))
            if last is None or sid in busy or h.model not in ce.loaded or h.t_done_unix <= last[3]:
                continue  # not served here, back already, or a hint about an earlier call (its return has come)
            out.setdefault(h.model, []).append(ReturnView(sid, elapsed, h.gap_mu, h.gap_sigma, h.window_s, *last[:3]))
        return {m: tuple(v) for m, v in out.items()}

    def idle_wait_s(self) -> float:
        """The slot is held for expected returns (``slots/hold.py``): the step loop sleeps up to this long."""
        d = self.driver.last
        return d.hold_s if d is not None and d.phase is Phase.HOLD else 0.0

    # ------------------------------------------------------------------ the turn (SwitchPolicy, via the driver)
    def turn(self) -> Turn:
        """The slot scheduler's turn: switch at a slot boundary (then the new slot opens), or honour a
        control-plane OPEN_MODEL on an idle instance; the queued calls to admit, or no step.
        Mutates: the active model, the scheduler's state and cost model, the driver's last decision."""
        self._turn = NO_STEP
        self.driver.turn(self.ce.clock())
        return self._turn

    def on_decision(self, view: InstanceView, d: Decision, now: float) -> None:
        ce = self.ce
        if d.switch_to is None and d.phase is Phase.DFIN and ce.active is not None:
            self._write_back_early(ce.active)

    def switch_slot(self, target: str, now: float) -> float | None:
        """A switch at a slot boundary, measured into the cost model; it completes here (the slot opens now)."""
        ce = self.ce
        t0 = ce.clock()
        rec = ce.run_switch(target, "slot")
        t1 = ce.clock()
        self.slots.observe_switch(rec.path, t1 - t0)
        return t1

    def run_step(self, admit: tuple[str, ...], now: float) -> None:
        """The engine's step carries the admission and the shell step out (``ColdEngine.step``)."""
        self._turn = admit_only(admit)

    def wait(self, d: Decision, now: float) -> None:
        ce = self.ce
        if d.phase == Phase.IDLE and ce.requested is not None and ce.requested != ce.active:
            # A control-plane OPEN_MODEL on an idle instance: no round is open, so switching now
            # costs no slot anything; the next call of the requested model starts its slot.
            t0 = ce.clock()
            rec = ce.run_switch(ce.requested, "requested")
            self.slots.observe_switch(rec.path, ce.clock() - t0)

    def _write_back_early(self, model: str) -> None:
        """The slot ends (its final drain, Dfin): start writing back the model's dirty sessions now, so the
        switch barrier (``HostKV.drain``) waits only for what the last calls leave (``kv/write_back.py``).
        Mutates: the tier's dirty set and job queue."""
        eng = self.ce.shell(model)
        hk = eng.host_kv if eng is not None else None
        if hk is not None and len(hk.dirty):
            hk.write_back(None, "slot_end")

    # ------------------------------------------------------------------ accounting hooks (SwitchPolicy)
    def admitted(self, req: EngineRequest) -> None:
        if req.session_id:
            self._req_session[req.request_id] = (req.model, req.session_id)
            book = self.ce.retention
            if book is not None:
                self._admit_wall[req.request_id] = book.wall()

    def step_shell(self, eng: Engine) -> list[RequestOutput]:
        return self._timed_step(eng)

    def _targets(self, req: EngineRequest) -> DeadlineTargets | None:
        """The call's token deadlines: its per-call hints (validated at intake) over the configured targets."""
        if not (req.ttft_target_s or req.tpot_target_s):
            return None
        d = self.deadlines.default
        return DeadlineTargets(req.ttft_target_s or d.ttft_s, req.tpot_target_s or d.tpot_s)

    def finished(self, out: RequestOutput) -> None:
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

    def refresh(self) -> None:
        # the pure policy is not thread-safe: read at step boundaries; idle (nothing queued or running): the
        # slot the last step left open closes at the next decision, so no model waits for it
        idle = not self.ce.queues.has_live()
        st = self.slots.status(self.ce.clock(), idle=idle)
        dl = self.deadlines.totals()  # per-token deadlines, scored in both modes
        self._slots_now = SlotStats(bool(st["deadline_risk"]), float(st["shortfall_s"]), float(st["round_remaining_s"]), tuple(st["infeasible"]),
                                    int(st["rounds"]), str(st.get("mode", "rounds")), dl.attainment, dl.ttft_attainment, dl.gap_p99_s,
                                    tuple((st.get("slot_wait_s") or {}).items()))

    def slot_stats(self) -> SlotStats | None:
        return self._slots_now

    def _timed_step(self, eng) -> list[RequestOutput]:
        """One shell step, measured into the slot cost model (decode steps, prefill tokens), and the real
        host KV restores that ended meanwhile (they run off the executor thread, so their cost is their
        own measured transfer time, not a share of a step): the restore cost per token is learned from
        real restores. Mutates: the shell and the cost model."""
        active = self.ce.active
        before = {s.request_id: s.num_computed_tokens for s in eng.scheduler.running}
        t0 = self.ce.clock()  # durations on the policy's time base (the injected clock)
        outs = eng.step()
        t1 = self.ce.clock()
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
        self.slots.observe_step(active, prefill, 0, decodes, dt)  # restores are not inside the step
        if eng.host_kv is not None:
            for tokens, seconds in eng.host_kv.take_restore_samples():
                self.slots.observe_restore(active, tokens, seconds)
        tokens, position = _prefill_shape(eng, before)
        self.slots.observe_shape(active, tokens, position, 0, decodes, dt)
        return outs

    def take_round_summaries(self):
        """Round summaries not yet handed out (the service publishes them on ``.round``); the engine calls this
        under its step lock."""
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
