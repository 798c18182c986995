"""The router's lease service: everything that happens to a session between its calls. It owns lease
settlement (a lease the policy honoured is consumed in the shared store -- exactly one router replica wins --
and one it judged is discarded), lease sizing and its measured costs (tool-aware leases), the leases a
completion hook or a tool intent installs, resume tokens (issued for a finished call, installed when a
client presents one), and what the returns teach (return gaps per (model, tool), which model a session
calls next, what a lease saved). ``gateway.Admission`` calls it, so the HTTP layer (``app.py``) never
touches a lease; the simulator and the policy bench call the same methods (``settle_now``, ``on_hook``).

Layering: the pure policy (``policy.py``) judges a lease at a decision and the pure lease arithmetic
(``return_gap.py``) prices one; ``Gateway`` builds the placement state the policy reads (the lease table's
live counts included) and commits decisions. This service reads the gateway (its books, ``decide`` for the
session's next call) and writes the lease table, the lease store, the gateway's accounting (``stats``, one
book for the router) and its own learned books. Synchronous and clock-injected (the gateway's wall clock)
except ``settle``, which awaits the shared store.

Tool-aware leases (``lease_policy: adaptive``; the arithmetic in ``return_gap.py``): a hook's tool (its
first parsed tool call) keys the return-gap predictor; the lease window is the predicted gap's capped
quantile; a lease whose expected saving is below the queueing it imposes is not installed
(``leases_declined``); live leases weigh on their instance by their decaying value; a return whose leased
instance is costlier than the best alternative drops the lease (``lease_outweighed``). Every return is an
observation (``arrival``), and every return's hook teaches ``residency`` (``ResidencyBook``: whether returns
on / off their lease found their prefix on the device, and what losing it cost in TTFT), which prices what a
lease saves. ``lease_token_s``: committed tokens x seconds held by leases (device KV they kept reserved),
judged ones plus those still in the table. ``lease_policy: fixed`` is the paper's tau.

Settlement, per admission step (``settle`` / ``settle_now``):

| the decision's lease | forward step | what happens |
|---|---|---|
| ``hit``, revision > 0 | yes | consumed in the store at the judged revision; lost to another replica: ``lease_raced``, the step does not stand (placed again without the lease) |
| ``hit``, revision 0 (a resume token's lease, local only) | yes | removed from the table; its token is not honoured again here |
| any other judged lease (or a ``hit`` on a step that is not forwarded) | -- | discarded (table at revision 0, else the store) |
| ``none`` / no decision | -- | nothing |

Every judged lease is counted once (``lease_judged``: hits, expiries, misses, outweighed, Eq. 2 denials,
token-seconds held).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.router.leases import LeaseTable, MemoryLeases, lease_key
from services.router.policy import CallRequest, Decision
from services.router.return_gap import GapPredictor, LeaseCosts, LeaseJudgement, NextModelBook, ResidencyBook, ReturnTracker, best_window, judge_lease
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from talaria.v1 import router_pb2 as rpb

if TYPE_CHECKING:
    from services.router.gateway import Admission, Gateway, OverloadPolicy
    from services.router.leases import JetStreamLeases
    from services.router.resume import Resumes

LEASE_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Settled:
    """A settled admission step: the consumed lease's id and engine epoch ("" / 0: none consumed), and whether
    the step's decision stands (False: another router replica consumed the lease first; nothing was sent)."""

    lease_id: str = ""
    epoch: int = 0
    stands: bool = True


NO_LEASE = Settled()
RACED = Settled(stands=False)


class LeaseService:
    """Leases, resume tokens and return learning over one ``Gateway``. ``store``: the lease store the table
    mirrors (``MemoryLeases`` over the gateway's table when not given; the router process swaps in
    ``JetStreamLeases`` at start); ``resumes``: the signed resume tokens (None: no tokens issued or
    honoured); ``gaps``: the return-gap predictor (its priors come from the config). Mutates the lease table
    and store, the gateway's ``stats`` and its own books."""

    def __init__(self, gw: Gateway, store: MemoryLeases | JetStreamLeases | None = None, resumes: Resumes | None = None,
                 gaps: GapPredictor | None = None):
        self.gw = gw
        self.table: LeaseTable = gw.leases
        self.store = store if store is not None else MemoryLeases(gw.leases)
        self.resumes = resumes
        self.stats = gw.stats  # one accounting book for the router (``Gateway.metrics``)
        self.gaps = gaps or GapPredictor()  # return gaps per (model, tool), learned from every return
        self.returns = ReturnTracker()
        self.next_models = NextModelBook()
        self.lease_token_s = 0.0  # judged leases: committed tokens x seconds held
        self.residency = ResidencyBook()  # what a lease saves a return, measured from the returns' hooks
        self._sizing: dict[str, list[float]] = {}  # "model|tool" -> [judged, installed, sum window, sum saved, sum harm/s]
        self._returning: OrderedDict[tuple[str, str], bool] = OrderedDict()  # (session, model) -> placed on its lease
        self._declared: OrderedDict[str, str] = OrderedDict()  # request id -> tool named by the client (X-Talaria-Tool)

    @property
    def adaptive(self) -> bool:
        return self.gw.adaptive

    @property
    def leases_enabled(self) -> bool:
        return self.gw.leases_enabled

    # ------------------------------------------------------------------------------------ a call's way in
    def admit(self, g: pb.GenerateRequest, prompt_tokens: int, overload: OverloadPolicy, resume_token: str | None = None,
              tool: str | None = None, prompt_exact: bool = False, prompt_bytes: int = 0, prompt_param: str = "prompt") -> Admission:
        """A call arrives: a presented resume token's lease goes into the table (``Resumes.apply``), a tool the
        client named (validated by the caller) is remembered for its hook, the arrival is observed, and the
        call's admission state machine is returned, settling its leases here. Mutates the lease table, the
        declared-tool map, the gateway's demand and the return books."""
        if self.resumes is not None:
            self.resumes.apply(resume_token, g, self)
        if tool is not None and g.session_id:
            self.declare_tool(g.request_id, tool)
        req = self.gw.request(g.session_id, g.model, prompt_tokens, g.sampling.max_tokens, g.hints.expected_output_tokens)
        self.arrival(req)
        return self.gw.admission(req, overload, prompt_exact=prompt_exact, prompt_bytes=prompt_bytes, prompt_param=prompt_param, leases=self)

    def arrival(self, req: CallRequest) -> None:
        """A call arrived: the gateway's demand, and (a session's next call) one observed return gap and model
        transition. Mutates the gateway's demand meter and the return books."""
        self.gw.arrival(req)
        got = self.returns.returned(req.session_id, self.gw.wall()) if req.session_id else None
        if got is not None:
            pr, gap = got
            self.gaps.observe(pr.model, pr.tool, gap)
            self.next_models.observe(pr.model, pr.tool, req.model)

    async def settle(self, d: Decision | None, rev: int | None, session_id: str, model: str, forward: bool = True) -> Settled:
        """Settle the lease a decision judged (see the table in the module docstring): consume a honoured one in
        the shared store (``forward``: the step sends the call), discard any other. Mutates the store, the
        table, the resume replay guard and the accounting."""
        op, held = self._settle_local(d, rev, session_id, model, forward)
        consumed = True
        if op == "consume":
            assert rev is not None
            consumed = await self.store.consume(session_id, model, rev)
        elif op == "discard":
            assert rev is not None
            await self.store.discard(session_id, model, rev)
        return self._settle_end(d, op, held, consumed)

    def settle_now(self, d: Decision | None, rev: int | None, session_id: str, model: str, forward: bool = True) -> Settled:
        """``settle`` against a store that answers at once (``MemoryLeases``: the simulator, the policy bench).
        Same outcomes and accounting."""
        store = self.store
        assert isinstance(store, MemoryLeases), "settle_now needs a local store"
        op, held = self._settle_local(d, rev, session_id, model, forward)
        consumed = True
        if op in ("consume", "discard"):
            assert rev is not None
            ok = store.consume_now(session_id, model, rev)  # a local discard is a consume whose answer is unused
            consumed = ok if op == "consume" else True
        return self._settle_end(d, op, held, consumed)

    def _settle_local(self, d: Decision | None, rev: int | None, session_id: str, model: str, forward: bool) -> tuple[str, tuple[str, int]]:
        """The part of settling that needs no store round trip, and what is left for the store: ("consume",
        held) for a honoured lease of a call that goes out, ("discard", -) for any other lease the store holds,
        ("honoured", held) for a honoured lease only the local table held (revision 0: removed here), ("done",
        -) when nothing is left. ``held``: the lease's (id, engine epoch). Mutates the local table and, for
        "done", the accounting."""
        none = ("", 0)
        if d is None or d.lease == "none":
            if d is not None:
                self.lease_judged(d)
            return "done", none
        if d.lease == "hit" and forward:
            assert rev is not None
            held = self._held(session_id, model)
            if rev == 0:
                self.table.remove(lease_key(session_id, model), 0)
                return "honoured", held
            return "consume", held
        if rev == 0:
            self.table.remove(lease_key(session_id, model), 0)
        elif rev is not None:
            return "discard", none
        self.lease_judged(d)
        return "done", none

    def _settle_end(self, d: Decision | None, op: str, held: tuple[str, int], consumed: bool) -> Settled:
        """The outcome once the store answered (``consumed``: the consume won; True for the other ops).
        Mutates the accounting and the resume replay guard."""
        if op == "consume" and not consumed:
            self.lease_raced()
            return RACED
        if op in ("consume", "honoured"):
            assert d is not None
            return self._honoured(d, held)
        if op == "discard":
            assert d is not None
            self.lease_judged(d)
        return NO_LEASE

    def _held(self, session_id: str, model: str) -> tuple[str, int]:
        """(lease id, engine epoch) of the session's lease in the table, ("", 0) when none. Pure read."""
        got = self.table.get(session_id, model)
        return (got[0].lease_id, got[0].epoch) if got is not None else ("", 0)

    def _honoured(self, d: Decision, held: tuple[str, int]) -> Settled:
        """A consumed lease: its resume token is not honoured again here; counted. Mutates both."""
        if self.resumes is not None:
            self.resumes.consumed(held[0])
        self.lease_judged(d)
        return Settled(held[0], held[1], True)

    def commit(self, req: CallRequest, d: Decision, call_id: str = "") -> None:
        """Record a forwarded call (``Gateway.commit``) and, for a session's return, whether it was placed on its
        lease: its hook teaches ``residency`` what a lease saves. Mutates the gateway and ``_returning``."""
        if self.gw.commit(req, d, call_id) and self.leases_enabled:
            self._returning[(req.session_id, req.model)] = d.lease == "hit"
            while len(self._returning) > 65536:
                self._returning.popitem(last=False)

    # ------------------------------------------------------------------------------------ a call's end
    def finished(self, g: pb.GenerateRequest, instance_id: str, usage) -> str | None:
        """The router relayed a call's finished chunk: record where the session's KV now is
        (``Gateway.call_ended``: a return that arrives before the engine's hook must find it), then the signed
        resume token of the lease the hook will install, or None. Mutates the registry overlay and the session
        table."""
        keep = g.session_id and not g.end_session and usage is not None and usage.prompt_tokens > 0
        tokens = usage.prompt_tokens + usage.completion_tokens if keep else 0
        self.gw.call_ended(g.request_id, instance_id, g.session_id if keep else "", g.model, tokens)
        if self.resumes is None:
            return None
        view = self.gw.registry.instances.get(instance_id)
        return self.resumes.issue_for(self, g, instance_id, view.snapshot.epoch if view is not None else 0, usage)

    def on_hook(self, hook: pb.CompletionHook) -> rpb.Lease | None:
        """A completion hook: the gateway learns from it (``Gateway.on_hook``: overlay, queue and shape books,
        session table); a session call that ended well teaches the return books and may install a lease.
        Returns the lease to install (or None)."""
        done = self.gw.on_hook(hook)
        if done is None:
            return None
        committed = hook.prefix.committed_tokens if hook.HasField("prefix") else 0
        self._observe_return(hook)
        declared = self._declared.pop(hook.request_id, "")
        tool = hook.tool_names[0] if hook.tool_names else declared
        self.returns.ended(hook.session_id, hook.model, tool, done)
        if not self.leases_enabled or committed == 0:
            return None
        view = self.gw.registry.instances.get(hook.instance_id)
        tau, judged = self.gw.tau_s, None
        if self.adaptive:
            hint = hook.hints.expected_tool_s if hook.HasField("hints") and hook.hints.expected_tool_s > 0 else None
            judged = self.size_lease(hook.instance_id, hook.model, tool, committed, hint_s=hint, session_id=hook.session_id)
            self._sized(hook.model, tool, judged[1])
            if not judged[1].install and self.gw.params.lease_arithmetic:
                self.stats["leases_declined"] += 1
                return None
            tau = judged[1].window_s
        lease = rpb.Lease(
            schema_version=LEASE_SCHEMA_VERSION,
            lease_id=hook.request_id,
            session_id=hook.session_id,
            model=hook.model,
            instance_id=hook.instance_id,
            prefix=hook.prefix if hook.HasField("prefix") else cpb.PrefixHandle(model=hook.model),
            t_done_unix=done,
            t_exp_unix=done + self.lease_tau(hook, tau),
            router_id=self.gw.router_id,
            instance_epoch=view.snapshot.epoch if view is not None else 0,
            tool=tool,
        )
        if judged is not None:
            est, j = judged
            lease.gap_mu, lease.gap_sigma, lease.p_return = est.mu, est.sigma, j.p_return
        self.stats["leases_installed"] += 1
        return lease

    # ---------------------------------------------------------------- what returns teach, intents, lease sizing
    def _sized(self, model: str, tool: str, j: LeaseJudgement) -> None:
        """Account one lease judgement of a hook per ``model|tool`` (``lease_sizing`` in ``metrics``: what the
        arithmetic saw when it installed or declined). Mutates only that account."""
        row = self._sizing.setdefault(f"{model}|{tool}", [0.0] * 5)
        row[0] += 1
        row[1] += 1 if j.install else 0
        row[2] += j.window_s
        row[3] += j.saved_s
        row[4] += j.harm_per_s

    def retention_gap(self, lease: rpb.Lease) -> tuple[float, float]:
        """``(gap_mu, gap_sigma)`` for the retention hint of ``lease`` to its engine: an adaptive lease's own
        estimate; a fixed-tau lease's ``(mu, 0)`` (the engine then takes the return as certain within tau), or
        with ``retention_learned_gap`` the gap distribution learned for the lease's (model, tool) -- the lease
        itself keeps its cliff in placement. Pure read."""
        if lease.gap_sigma > 0 or not self.gw.params.retention_learned_gap:
            return lease.gap_mu, lease.gap_sigma
        est = self.gaps.predict(lease.model, lease.tool)
        return est.mu, est.sigma

    def _observe_return(self, hook: pb.CompletionHook) -> None:
        """A returning call finished: teach ``residency`` whether it was placed on its lease, whether its prefix
        was still on the device (cached tokens beyond those restored from host) and its TTFT. Mutates both."""
        on_lease = self._returning.pop((hook.session_id, hook.model), None)
        if on_lease is not None and hook.HasField("usage") and hook.ttft_seconds > 0:
            u = hook.usage
            self.residency.observe(on_lease, u.cached_tokens > u.restored_tokens, hook.ttft_seconds)

    def lease_window(self, model: str, tool: str = "") -> float:
        """The lease length after a call of ``(model, tool)``: tau (fixed) or the predicted window (adaptive).
        Resume tokens are issued with it before the hook names the tool (``tool`` ""). Pure read."""
        return self.gaps.window(self.gaps.predict(model, tool)) if self.adaptive else self.gw.tau_s

    def declare_tool(self, request_id: str, tool: str, keep: int = 4096) -> None:
        """The client named the tool this call's output invokes (``X-Talaria-Tool``): used as the hook's tool
        when the engine parsed none (mutates a bounded map; only the replica that took the call knows it)."""
        self._declared[request_id] = tool
        while len(self._declared) > keep:
            self._declared.popitem(last=False)

    def on_intent(self, intent: pb.ToolIntent) -> rpb.Lease | None:
        """A tool-call header streamed: with adaptive leases and no lease yet, install one
        now, sized for the tool, over the KV the call holds so far (``early``; the hook's lease replaces it).
        Returns the lease to install, or None."""
        self.stats["intents"] += 1
        if not (self.adaptive and self.leases_enabled and intent.session_id):
            return None
        got = self.table.get(intent.session_id, intent.model)
        if got is not None and got[0].t_done_unix >= intent.seen_unix:
            return None
        committed = intent.prompt_tokens + intent.generated_tokens
        est, j = self.size_lease(intent.instance_id, intent.model, intent.tool_name, committed, session_id=intent.session_id)
        if not j.install and self.gw.params.lease_arithmetic:
            return None
        view = self.gw.registry.instances.get(intent.instance_id)
        t0 = min(intent.seen_unix, self.gw.wall()) if intent.seen_unix > 0 else self.gw.wall()
        self.stats["leases_early"] += 1
        return rpb.Lease(
            schema_version=LEASE_SCHEMA_VERSION, lease_id=intent.request_id, session_id=intent.session_id, model=intent.model,
            instance_id=intent.instance_id, prefix=cpb.PrefixHandle(model=intent.model, committed_tokens=committed),
            t_done_unix=t0, t_exp_unix=t0 + j.window_s, router_id=self.gw.router_id,
            instance_epoch=view.snapshot.epoch if view is not None else 0, gap_mu=est.mu, gap_sigma=est.sigma,
            p_return=j.p_return, tool=intent.tool_name, early=True,
        )

    def prefetch_target(self, session_id: str, model: str, tool: str, prompt_tokens: int, min_share: float = 0.6,
                        min_seen: int = 3) -> tuple[str, str] | None:
        """Intent prefetch: when the session's next call is predicted (``NextModelBook``,
        share >= ``min_share`` over >= ``min_seen`` returns) to go to *another* model, the (instance, model)
        that placement would choose for it now, if that instance would have to switch to or open the model:
        the caller asks it to open the model ahead (``CONTROL_OPEN_MODEL``). None otherwise. Decides
        without committing anything (reads the policy)."""
        got = self.next_models.predict(model, tool)
        if got is None or got[0] == model or got[1] < min_share or got[2] < min_seen:
            return None
        nxt = got[0]
        d, _ = self.gw.decide(self.gw.request(session_id, nxt, max(1, prompt_tokens), 256), use_lease=False)
        if d.instance_id is None or not (d.opens_model or d.switches_model):
            return None
        spec = self.gw.pools.get(d.instance_id)
        if spec is not None and spec.pool != "cold":
            return None
        self.stats["prefetches"] += 1
        return d.instance_id, nxt

    def lease_costs(self, instance_id: str, model: str, committed: int, session_id: str = "") -> LeaseCosts:
        """Measured inputs of the lease arithmetic (``return_gap.judge_lease``). What a hit saves: the cheaper
        place for a return that lost its residency -- this instance with the prefix off its device (restored
        or recomputed here, the cheaper per the instance's profile) or, with the session known, the best *other*
        admissible instance (Eq. 1's KV + activation terms of the session's next call there minus those on this
        one, queueing left out: the policy's own view of where the prefix is, how much suffix each must prefill
        and what each model switch costs). Until 2026-12-06 only the other instance was priced, with its slot
        wait when the model was not active there; but placement keeps such a return where its model is active
        and restores it there: on the stack leases were priced at 2.6-4.4 s saved in one repetition in three
        while the returns that lost residency paid 0.19 s, and adaptive held 2.0x fixed 0.5 s's KV. Either price
        is of a return that *lost* its residency; once the router has measured returns with and
        without a lease (``ResidencyBook.lift``) it is weighted by how much more often a lease keeps residency
        (the share) and floored by the measured cost of losing it: ``share x max(that price, measured loss)``.
        Until 2026-12-06 it was ``max(Eq. 1 difference, share x measured loss)``, which priced every
        lease as if the return would certainly lose its residency without it: on the stack 89-90 % of returns
        without a lease kept it anyway (a lease bought 0.005-0.018 s measured, Eq. 1 said ~0.3 s) and adaptive
        held 3.0x the KV of a fixed 0.5 s tau for no SCT difference. A live lease puts
        one admission unit of a mean call's queueing on every other call arriving at its instance (the
        router's arrival rate over all models, spread over the instances). With another healthy instance to
        go to, that holds whatever the leased instance's free slots: placement charges the lease that unit
        on its instance (``policy.queue_pressure``) at any load, so it steers other calls away at any load.
        Until 2026-12-06 the harm was always scaled by how busy the instance was (a lease on an instance with
        free slots "delays nobody"): at light load the arithmetic then saw no cost and kept 7-10 s windows
        after slow tools, which held 1.8-2.3x the best fixed tau's KV and lost SCT p50 to it in the
        simulator, and 3.3x its KV on the stack (``services/router/README.md``). A lone instance has nowhere
        to steer calls to: there the lease delays them only in proportion to how busy it is (calls running,
        waiting and forwarded over its decode slots). Pure read."""
        prof = self.gw.priced_profile(instance_id, model)
        per_token = min(prof.prefill_per_token, prof.restore_per_token) if prof.restore_per_token > 0 else prof.prefill_per_token
        shape = self.gw.shapes.shape(model)
        mean_call_s = shape.suffix_tokens * prof.prefill_per_token + shape.decode_tokens * prof.decode_step
        now = self.gw.wall()
        reg = self.gw.registry
        rate = sum(self.gw.demand.rate(m, now) for m in self.gw.demand.models()) / max(1, len(reg.instances))
        if any(iid != instance_id and reg.healthy(o) for iid, o in reg.instances.items()):
            exposed = 1.0  # the charge steers arrivals to the other instances, at any load
        else:  # nowhere to steer them: the lease delays them only when the instance's slots are taken
            v, spec = reg.instances.get(instance_id), self.gw.pools.get(instance_id)
            calls = (v.running + v.snapshot.num_waiting + v.inflight) if v is not None else 0
            exposed = min(1.0, calls / max(1, spec.max_num_seqs if spec is not None else 1))
        off_device = committed * per_token  # the prefix restored or recomputed: here, or elsewhere without a session
        saved = off_device
        if session_id:
            nxt = self.gw.request(session_id, model, committed + int(shape.suffix_tokens), max(1, int(shape.decode_tokens)))
            d, _ = self.gw.decide(nxt, use_lease=False)
            mine = next((c for c in d.costs if c.instance_id == instance_id), None)
            alt = min((c for c in d.costs if c.instance_id != instance_id and not c.reject), key=lambda c: c.total, default=None)
            if mine is not None and alt is not None:  # the return that lost residency goes where it is cheaper
                saved = min(off_device, max(0.0, (alt.total - alt.queue_s) - (mine.total - mine.queue_s)))
        lift = self.residency.lift()  # measured: how often a lease changes the outcome, what losing residency costs
        if lift is not None:
            share, loss_s = lift
            saved = share * max(saved, loss_s)
        qs = self.gw.queues.scale(instance_id) if self.gw.params.queue_learned else 1.0  # the queueing a lease imposes, as measured
        return LeaseCosts(saved_s=saved, harm_per_s=exposed * rate * self.gw.params.admission_unit * mean_call_s * qs)

    def size_lease(self, instance_id: str, model: str, tool: str, committed: int, hint_s: float | None = None, session_id: str = "") -> tuple:
        """(gap estimate, ``LeaseJudgement``) of a lease after a call of ``(model, tool)``. ``hint_s``: the
        caller's expected tool time (request hint; wins over the learned gap). Reads only (a policy decision
        for the session's next call is evaluated, not committed)."""
        est = self.gaps.predict(model, tool, hint_s)
        costs = self.lease_costs(instance_id, model, committed, session_id)
        window = self.gaps.window(est)
        if self.gw.params.lease_arithmetic:  # without it every lease is installed at its quantile window
            window = best_window(est, costs, self.gaps.p.floor_s, window)
        return est, judge_lease(est, window, costs)

    def lease_tau(self, hook: pb.CompletionHook, tau: float) -> float:
        """The lease length after a call: ``tau`` (the fixed Talaria §3.3 tau, or the adaptive window, which
        already took the caller's ``expected_tool_s`` hint), capped by the caller's ``cache_ttl_s`` hint. Pure."""
        ttl = hook.hints.cache_ttl_s if hook.HasField("hints") else 0.0
        return min(tau, ttl) if ttl > 0 else tau

    def lease_judged(self, d: Decision) -> None:
        """Count a lease the decision consumed or discarded (call once per lease seen)."""
        self.lease_token_s += d.lease_held_s * d.lease_tokens
        if d.lease == "outweighed":
            self.stats["lease_outweighed"] += 1
        elif d.lease == "eq2":  # honouring it would have opened a replica Eq. 2 rejects (policy._eq2_denies)
            self.stats["lease_eq2_denied"] += 1
        if d.lease == "hit":
            self.stats["lease_hits"] += 1
        elif d.lease == "expired":
            self.stats["lease_expiries"] += 1
        elif d.lease in ("unhealthy", "prefix-invalid"):
            self.stats["lease_misses"] += 1
            self.stats[f"lease_miss_{d.lease.replace('-', '_')}"] += 1

    def lease_raced(self) -> None:
        self.stats["lease_misses"] += 1
        self.stats["lease_miss_raced"] += 1


    def metrics(self) -> dict:
        """``Gateway.metrics`` plus what this service learned: ``lease_token_s`` (judged leases and those still
        in the table), ``return_gaps``, ``lease_residency``, ``lease_sizing``. Pure read."""
        now = self.gw.wall()
        return {
            **self.gw.metrics(),
            "lease_token_s": self.lease_token_s + self.table.held_token_s(now),
            "return_gaps": self.gaps.keys(),
            "lease_residency": self.residency.snapshot(),
            "lease_sizing": {k: {"judged": int(n), "installed": int(i), "window_s": w / n, "saved_s": sv / n, "harm_per_s": h / n}
                             for k, (n, i, w, sv, h) in self._sizing.items()},
        }
