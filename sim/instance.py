"""One simulated serving instance: the *mechanism* side of an engine, driven by the real slot scheduler.

Design NOTE (Talaria §3.4-§3.5, §4.2-§4.4). The policy is ``services.engine.slots.SlotScheduler``
unchanged: at every decode boundary the instance builds the scheduler's ``InstanceView``, calls
``decide(view, now)`` and carries the decision out, charging time from the profile (``profile.py``) and
reporting what it "measured" through ``observe_step``/``observe_switch``, exactly like the cold engine.
Staging picks its target with ``services.engine.substrate.policy.predict_next`` (the engine's staging
policy) and the load path is ``classify``-ed from the staged fraction like the engine's switch. Host KV goes
through the real ``services.kvstore.registry.HostKVRegistry`` (reserve/commit on checkpoint, agreed-prefix
lookup on restore, its eviction under capacity). What is simulated is only the mechanism: a step's
duration, device KV capacity, staged bytes growing at the H2D rate in the arena's free tail.

Device KV: the active model's finished sessions keep their KV on device until a switch releases the
active KV region (Talaria §4.2) or device memory runs out (least recently used first); with ``host_kv``
every finished call is checkpointed to the host registry (free in time on a GPU: asynchronous D2H, §4.3; a CPU
profile's ``checkpoint_per_token_s`` charges its copies to the instance's next step, as they run on the same cores).

Cold instances have a set of *loaded* models (in rotation); a call for another catalog model opens it
(``max_loaded`` bounds the set; an idle model leaves first). Hot instances pin one model (``endless``).

Per-token deadlines (issue 16, Aegaeon): every instance scores every token against its deadline (first
token: arrival + T_TTFT; token i: first token + (i - 1) T_TPOT) in a ``DeadlineTracker``, as the cold engine
does in both modes; with ``SlotPolicy.token_deadlines`` a cold instance is driven by
``services.engine.slots.deadlines.DeadlineScheduler`` (EDF switches at token boundaries) instead of the round
scheduler, chosen by the engine's own ``deadlines.make_scheduler``, fed the same arrivals and emitted tokens. A decode step of ``quantum`` tokens emits its
tokens at their own step ends (one decode step apart), not all at the step's end.

Streaming hot-swap (issue 16, ``partial_layers``; JointServe §4.4, the engine's ``streaming_swap.py``): the
model is ``layer_groups`` equal groups (the profile's knob: one per decoder layer, as the engine's default
``layers_per_group: 1``). A switch's phase 2 moves the staged groups device-to-device and copies host-to-device
only the startup prefix k*, chosen by the engine's own ``streaming_swap.startup_prefix`` from the H2D copy time
per group and the compute the engine expects (its learned prefill seconds per token x the tokens the target's
queued calls will compute, as ``HotSwapStreamer.k_for``); the later groups stream back to back from the switch's end. The
first forward after it runs group by group, each group starting only when its copy has landed: its duration is
the pipeline's end (any wait is a stall, counted in ``stream_stall_s`` and in the step the scheduler observes).
A KV restore in that step takes the channel first (the transfer scheduler's floor for restores), so the
stream's remaining arrivals move back by the restore's time. A switch while a stream is still in flight
waits for it (the engine's ``before_kv_release`` barrier). Staging for the next model is not slowed by the
stream (one channel in the engine; not modelled).

Unified residency (issue 16, ``unified_residency``; JointServe §3): staging and the device session cache follow
the plans of the engine's ``ResidencyManager`` instead of ``predict_next`` and LRU alone (``residency.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.engine.kv.session_residency import KvLocation
from services.engine.slots import CostModel, CostProfile, SlotPolicy
from services.engine.slots.deadlines import DeadlineTargets, DeadlineTracker, make_scheduler
from services.engine.slots.types import CallView, Decision, InstanceView, ModelView, ReturnView
from services.engine.streaming_swap import startup_prefix
from services.engine.substrate.policy import EngineView, classify_path, predict_next
from services.kvstore.registry import Family, HostKVRegistry, Layout

from .profile import Profile
from .residency import SimResidency

PATH_CHUNKS = 100  # staged fraction resolution when classifying a switch's load path
DEFAULT_LAYER_GROUPS = 32  # a profile without a ``layer_groups`` knob: a typical decoder depth


@dataclass(slots=True)
class SimCall:
    """One call of the workload as the simulator runs it (times in simulated seconds)."""

    request_id: str
    session_id: str
    index: int
    model: str
    prompt_tokens: int
    prefix_tokens: int  # tokens shared with the session's previous prompt
    output_tokens: int
    gap_s: float  # tool gap before this call (capped)
    intended: float = 0.0  # schedule-aware enqueue time (§5.1)
    instance: str = ""
    arrival: float = 0.0  # reached the instance
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    prefill_left: int = 0
    restore_left: int = 0
    cached: int = 0  # prompt tokens not recomputed
    restored: int = 0  # of those, restored from host
    kv_source: str = "none"  # device | host | recompute | none
    decoded: int = 0
    continuation: bool = False
    prefill_total: int = 0  # tokens this admission computes or restores (prompt, or a parked call's context)
    parked_ctx: int = 0  # parked at a switch (can_park): context tokens (prompt + decoded) it needs back
    tool: str = ""  # the tool this call's answer invoked (the gap after it is that tool's run; the hook names it)

    @property
    def ctx_needed(self) -> int:
        """Tokens of KV this call needs at admission: its prompt, or, when parked, prompt + decoded."""
        return self.parked_ctx or self.prompt_tokens


@dataclass(slots=True)
class StepOutcome:
    seconds: float
    first_tokens: list[SimCall] = field(default_factory=list)
    finished: list[SimCall] = field(default_factory=list)


class SimInstance:
    """Mechanism state of one instance. Mutated only through ``submit``/``begin``/``complete``."""

    def __init__(self, iid: str, pool: str, catalog: list[str], profile: Profile, policy: SlotPolicy, *,
                 host: HostKVRegistry | None, loaded: list[str] | None = None, max_loaded: int = 0,
                 decode_quantum: int = 1, can_park: bool = False, partial_layers: bool = False, unified_residency: bool = False) -> None:
        self.iid, self.pool, self.profile, self.policy = iid, pool, profile, policy
        self.catalog = list(catalog)
        self.loaded: list[str] = list(loaded if loaded is not None else catalog)
        self.max_loaded = max_loaded
        self.quantum = max(1, decode_quantum)
        self.can_park = can_park  # model of the paper's engine (§5.5): in-flight calls parked at a switch
        self.parked = 0
        self.partial_layers = partial_layers  # streaming hot-swap of later layer groups (issue 16)
        self.groups = int(profile.knobs.get("layer_groups", DEFAULT_LAYER_GROUPS))
        self.stream: list[float] = []  # arrival times of the groups still streaming in, group order (groups before: resident)
        self.stream_stall_s = 0.0
        self.streams = 0
        self.startup_k: list[int] = []  # k* of every streamed switch
        self.unified_residency = unified_residency  # one device budget for staged layer groups and session KV (issue 16)
        self.residency = SimResidency() if unified_residency else None
        self.checkpoint_debt_s = 0.0  # host KV checkpoint compute not yet charged to a step (profile checkpoint_per_token_s)
        m0 = self.loaded[0] if self.loaded else None
        c0 = profile.model(m0 or "")
        seed = CostProfile(
            prefill_per_token=c0.prefill_per_token_at(8192), decode_step=c0.decode_s(1, 0),
            restore_per_token=c0.restore_per_token_s,
            switch_by_path={"full_staged": profile.switch.total(1.0), "partial": profile.switch.total(0.5), "host_only": profile.switch.total(0.0)},
        )
        self.seed_costs = seed  # what the scheduler starts from (tests replay with the same)
        # per-token deadlines scored in both modes (as the engine's SlotSwitching); kept across reconfigure
        self.tracker = DeadlineTracker(DeadlineTargets(policy.ttft_s, policy.tpot_s))
        self.scheduler = make_scheduler(policy, CostModel(seed), self.tracker)
        self.active: str | None = m0
        self.previous: str | None = None
        self.queues: dict[str, list[SimCall]] = {m: [] for m in self.catalog}
        self.batch: list[SimCall] = []
        self.device: dict[str, tuple[str, int]] = {}  # session -> (model, committed tokens) on device (active model)
        self.device_used: dict[str, float] = {}  # session -> when its device KV was last written (its call's end)
        self.seen: set[tuple[str, str]] = set()  # (model, session) served here
        self.last_work: dict[str, float] = {}
        # (model, session) -> (call end, its ReturnView as of the call end): the returns the router's leases
        # expect here (what its retention hints tell the engine); the scheduler may hold a slot for them
        # (services/engine/slots/hold.py). Dropped when the session's next call arrives here.
        self.expected: dict[tuple[str, str], tuple[float, ReturnView]] = {}
        self.host = host
        self.pages: dict[tuple[str, str], list[int]] = {}  # (model, session) -> page hash chain
        self._hash_ctr = 0
        self._agreed: dict[tuple[str, str], tuple[tuple[int, int, int, int], int]] = {}
        self._layouts: dict[str, Layout] = {}
        self.staging: tuple[str, float] | None = None  # (model, started)
        self.busy_until: float | None = None
        self.pending: Decision | None = None
        self.switches: list[dict] = []
        self.rounds: list = []
        self.steps = 0
        self.step_s = 0.0
        self.switch_s = 0.0
        self.epoch = 1
        self.seq = 0

    # ------------------------------------------------------------------ intake
    def submit(self, c: SimCall, now: float) -> bool:
        """Queue a call; opens its model when not loaded (cold). Returns False if the model cannot be served."""
        if c.model not in self.loaded:
            if self.pool == "hot" or c.model not in self.catalog:
                return False
            self._open(c.model, now)
        c.instance, c.arrival = self.iid, now
        c.continuation = (c.model, c.session_id) in self.seen
        self.expected.pop((c.model, c.session_id), None)
        if self.residency is not None:
            self.residency.observe_call(c.model, c.session_id, c.prompt_tokens, now)
        self.queues[c.model].append(c)
        self.last_work[c.model] = now
        return True

    def _open(self, model: str, now: float) -> None:
        self.loaded.append(model)
        self.last_work[model] = now
        self._shrink(keep=model)

    def _shrink(self, keep: str | None = None) -> None:
        """Close idle models (no queue, not active, not ``keep``) beyond ``max_loaded``, least recently used first."""
        while self.max_loaded and len(self.loaded) > self.max_loaded:
            idle = [m for m in self.loaded if m not in (self.active, keep) and not self.queues[m]]
            if not idle:
                return
            victim = min(idle, key=lambda m: self.last_work.get(m, 0.0))
            self.loaded.remove(victim)
            self.seen = {(m, s) for (m, s) in self.seen if m != victim}

    def idle(self) -> bool:
        return not self.batch and not any(self.queues.values())

    def reconfigure(self, pool: str, catalog: list[str], model: str | None, policy: SlotPolicy) -> float:
        """Move this (idle) instance to ``pool``: hot pins ``model``; cold serves ``catalog`` starting with
        ``model`` (or nothing) loaded. Device KV is dropped, host KV kept; a new engine epoch and a fresh
        scheduler. Returns the seconds the move costs (opening the pinned model host-only). Mutates self."""
        assert self.idle(), "reconfigure a busy instance"
        self.pool, self.policy = pool, policy
        self.catalog = list(catalog)
        self.loaded = [model] if model else []
        for m in self.catalog:
            self.queues.setdefault(m, [])
        self.device.clear()
        self.seen.clear()
        self.previous, self.active = self.active, (model or None)
        self.staging = None
        self.stream = []
        self.residency = SimResidency() if self.unified_residency else None
        self.scheduler = make_scheduler(policy, CostModel(self.seed_costs), self.tracker)
        self.epoch += 1
        self.seq = 0
        return self.profile.switch.total(0.0) if model else 0.0

    # ------------------------------------------------------------------ views
    def _kv_capacity_tokens(self) -> int:
        c = self.profile.model(self.active or "")
        free = self.profile.arena_bytes - c.weight_bytes
        return max(0, free // max(1, c.kv_bytes_per_token))

    def _kv_used_tokens(self) -> int:
        return sum(c.prompt_tokens + c.decoded for c in self.batch) + sum(t for _, t in self.device.values())

    def host_tokens(self, model: str, session: str) -> int:
        if self.host is None or not self.policy.host_kv:
            return 0
        chain = self.pages.get((model, session))
        if not chain:
            return 0
        # memoised on the registry's state: only commits (bytes_in) and evictions change what is agreed
        stamp = (self.host.counters.bytes_in, self.host.counters.evictions, len(chain), chain[-1])
        hit = self._agreed.get((model, session))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        n, _ = self.host.agreed_pages(self._layout(model), chain)
        self._agreed[(model, session)] = (stamp, n * self.profile.page_tokens)
        return n * self.profile.page_tokens

    def prefix_of(self, c: SimCall) -> tuple[int, KvLocation]:
        got = self.device.get(c.session_id)
        want = c.parked_ctx or c.prefix_tokens
        if got is not None and got[0] == c.model and c.model == self.active:
            return min(got[1], want), KvLocation.DEVICE
        n = min(self.host_tokens(c.model, c.session_id), want)
        if n > 0:
            return n, KvLocation.HOST
        return 0, KvLocation.MISSING

    def expect(self, c: SimCall, now: float, gap_mu: float, gap_sigma: float, window_s: float) -> None:
        """The router installed a lease for ``c``'s session here (its retention hint). Mutates ``expected``."""
        rv = ReturnView(c.session_id, 0.0, gap_mu, gap_sigma, window_s, c.decoded, c.prompt_tokens - c.cached, c.prompt_tokens + c.decoded)
        self.expected[(c.model, c.session_id)] = (now, rv)

    def _returns(self, model: str, now: float) -> tuple[ReturnView, ...]:
        out = []
        for key, (t, rv) in list(self.expected.items()):
            if now - t >= rv.window_s:  # the lease window ended
                del self.expected[key]
            elif key[0] == model:
                out.append(replace(rv, elapsed_s=now - t))
        return tuple(out)

    def view(self, now: float) -> InstanceView:
        mvs = []
        for m in self.loaded:
            queued = []
            for c in self.queues[m]:
                self.tracker.arrive(c.request_id, m, c.arrival)  # idempotent: a parked call keeps its clock
                n, where = self.prefix_of(c)
                queued.append(CallView(c.request_id, m, c.arrival, c.ctx_needed, c.output_tokens - c.decoded, c.session_id, n, where,
                                       c.continuation or c.parked_ctx > 0))
            batch = self.batch if m == self.active else []
            mvs.append(ModelView(
                m, running=len(batch), prefilling=sum(1 for c in batch if c.prefill_left > 0 or c.restore_left > 0),
                max_remaining_decode=max((c.output_tokens - c.decoded for c in batch), default=0), queued=tuple(queued),
                returns=self._returns(m, now),
            ))
        free = max(0, self._kv_capacity_tokens() - self._kv_used_tokens())
        staged = {m: self.staged_fraction(m, now) for m in self.loaded if m != self.active}
        return InstanceView(self.active, tuple(mvs), free, staged, can_park=self.can_park)

    def engine_view(self) -> EngineView:
        queued = {m: len(q) for m, q in self.queues.items() if q and m != self.active}
        oldest = {m: q[0].arrival for m, q in self.queues.items() if q and m != self.active}
        busy = bool(self.batch) or bool(self.active and self.queues.get(self.active))
        return EngineView(self.active, busy, queued, oldest, None, self.previous, tuple(self.loaded))

    # ------------------------------------------------------------------ staging (§4.4)
    def kv_free_bytes(self) -> int:
        """Bytes of the active model's KV region not holding KV (where weights are staged)."""
        c = self.profile.model(self.active or "")
        return max(0, self.profile.arena_bytes - c.weight_bytes - self._kv_used_tokens() * c.kv_bytes_per_token)

    def restage(self, now: float) -> None:
        """Pick the staging target with the engine's ``predict_next``; a new target restarts staging."""
        if not self.policy.d2d_staging or self.pool == "hot":
            self.staging = None
            return
        if self.residency is not None:  # unified residency: the plan says what to stage (sim/residency.py)
            self.residency.step(self, now)
            return
        target = predict_next(self.engine_view(), now)
        if target is None:
            self.staging = None
        elif self.staging is None or self.staging[0] != target:
            self.staging = (target, now)

    def staged_fraction(self, model: str, now: float) -> float:
        if self.residency is not None and self.policy.d2d_staging:
            return self.residency.fraction(self, model, now)
        if not self.policy.d2d_staging or self.staging is None or self.staging[0] != model:
            return 0.0
        w = self.profile.model(model).weight_bytes
        written = (now - self.staging[1]) * self.profile.h2d_bytes_per_s(model)
        return max(0.0, min(1.0, min(written, self.kv_free_bytes()) / max(1, w)))

    # ------------------------------------------------------------------ actions
    def switch(self, target: str, now: float) -> tuple[str, float, tuple[float, ...]]:
        """Release the active KV region (to host with host_kv), open ``target``; returns (path, seconds, phases)."""
        assert not self.batch or self.can_park, "switch with calls in flight"
        barrier = max(0.0, (self.stream[-1] if self.stream else now) - now)  # the outgoing model's stream completes first
        self.stream = []
        self._park_batch()
        frac = self.staged_fraction(target, now)
        d2d_chunks = int(frac * PATH_CHUNKS + 1e-9)
        path = classify_path(PATH_CHUNKS, d2d_chunks)
        phases = self.profile.switch.phases(d2d_chunks / PATH_CHUNKS)
        if self.partial_layers:
            phases = self._stream_plan(target, d2d_chunks / PATH_CHUNKS, phases, now + barrier)
        if self.residency is not None:
            self.residency.activated(target)
        if barrier:
            phases = (phases[0] + barrier, *phases[1:])
        self.device.clear()
        self.device_used.clear()
        self.previous, self.active = self.active, target
        self.staging = None
        self._shrink()
        secs = sum(phases)
        self.switches.append({"t": now, "from": self.previous or "", "to": target, "path": path, "seconds": secs, "staged_fraction": frac})
        self.switch_s += secs
        return path, secs, phases

    def first_prefill_tokens(self, model: str) -> int:
        """Tokens the first forward after a switch to ``model`` computes, at least: the smallest of its waiting
        calls' prompts minus the prefix this instance can restore (a slot's P admission may take one call), at
        most one step's token budget (as the engine's ``SlotSwitching.first_prefill_tokens``). Pure read."""
        need = [max(1, c.ctx_needed - self.prefix_of(c)[0]) for c in self.queues.get(model, ())]
        return min(self.profile.max_batched_tokens, min(need, default=0))

    def group_copy_s(self) -> float:
        """Seconds to copy one layer group host-to-device (the H2D open phase moves the whole model)."""
        return self.profile.switch.open_h2d_s / self.groups

    def k_star(self, model: str, tokens: int) -> int:
        """k* of ``model`` for a first forward of ``tokens`` tokens: the engine's ``startup_prefix`` on the
        group copy time and the compute the scheduler's learned prefill cost predicts (as
        ``HotSwapStreamer.k_for``). Pure read."""
        g = self.groups
        fwd = self.scheduler.costs.prefill_per_token(model) * max(tokens, 1)
        return startup_prefix([self.group_copy_s()] * g, [fwd / g] * g)

    def _stream_plan(self, target: str, staged: float, phases: tuple[float, ...], start: float) -> tuple[float, ...]:
        """Streaming hot-swap of ``target``: k* from the engine's ``startup_prefix``; phase 2 shrinks to the staged
        groups (D2D) plus the H2D copy of the unstaged part of the startup prefix; the later groups' arrival times
        (from the switch's end, back to back) go to ``stream``. Returns the new phases. Mutates ``stream``,
        ``streams``, ``startup_k``."""
        g = self.groups
        sw = self.profile.switch
        copy = self.group_copy_s()
        k = self.k_star(target, self.first_prefill_tokens(target))
        first = max(k, int(staged * g + 1e-9))  # staged groups move device-to-device in phase 2
        if first >= g:
            return phases
        p2 = staged * sw.open_d2d_s + max(0.0, k / g - staged) * sw.open_h2d_s
        out = (phases[0], p2, *phases[2:])
        end = start + sum(out)
        self.stream = [end + copy * (j - first + 1) for j in range(first, g)]
        self.streams += 1
        self.startup_k.append(k)
        return out

    def _streamed(self, now: float, restore_s: float, compute_s: float) -> float:
        """The first forward after a streamed switch: ``compute_s`` spread evenly over the groups, each group
        starting when its copy has landed (the restore first takes the channel, ``restore_s``). Returns the
        stall (seconds the forward waited on copies); the stream is then complete. Mutates ``stream``."""
        t = now + restore_s
        arrivals = [a + restore_s if a > now else a for a in self.stream]
        per = compute_s / self.groups
        first = self.groups - len(self.stream)  # groups before it are resident
        for j in range(self.groups):
            if j >= first:
                t = max(t, arrivals[j - first])
            t += per
        self.stream = []
        stall = max(0.0, t - (now + restore_s + compute_s))
        self.stream_stall_s += stall
        return stall

    def _park_batch(self) -> None:
        """Move the in-flight calls back to the front of their queue (the paper's engine parks them at a
        switch, §5.5); with host KV their context is checkpointed so the next slot restores it."""
        if not self.batch:
            return
        q = self.queues[self.active or ""]
        for c in reversed(self.batch):
            c.parked_ctx = c.prompt_tokens + c.decoded
            if self.host is not None and self.policy.host_kv:
                self._checkpoint(c, c.parked_ctx)
            q.insert(0, c)
            self.parked += 1
        self.batch.clear()

    def admit(self, ids: tuple[str, ...], now: float) -> None:
        q = self.queues[self.active] if self.active else []
        by_id = {c.request_id: c for c in q}
        for rid in ids:
            c = by_id[rid]
            q.remove(c)
            n, where = self.prefix_of(c)
            need = c.ctx_needed
            reuse = min(n, need - 1)
            if c.parked_ctx:  # a parked call resumes: its KV comes back (host) or is recomputed; TTFT is unchanged
                c.restore_left = reuse if where is not KvLocation.MISSING else 0
                c.prefill_left = need - (reuse if where is not KvLocation.MISSING else 0)
                c.prefill_total, c.parked_ctx = need, 0
                self.batch.append(c)
                continue
            if where is KvLocation.DEVICE:
                self.device.pop(c.session_id, None)
                c.cached, c.kv_source = reuse, "device"
            elif where is KvLocation.HOST and reuse > 0:
                c.restore_left, c.cached, c.restored, c.kv_source = reuse, reuse, reuse, "host"
            else:
                reuse = 0
                c.kv_source = "recompute" if c.prefix_tokens > 0 else "none"
            c.prefill_left = c.prompt_tokens - reuse
            c.prefill_total = c.prompt_tokens
            c.admitted_at = now
            self.batch.append(c)

    def step(self, now: float) -> StepOutcome:
        """One executor step: decoders get ``quantum`` tokens (1 unless coarsened), prefills share the
        token budget, restores complete. Returns the duration and the calls that got first tokens / ended."""
        cm = self.profile.model(self.active or "")
        decoders = [c for c in self.batch if c.prefill_left == 0 and c.restore_left == 0]
        dec = {id(c) for c in decoders}
        k = self.quantum if decoders and all(c.prefill_left == 0 and c.restore_left == 0 for c in self.batch) else 1
        if decoders:
            k = min(k, min(c.output_tokens - c.decoded for c in decoders))
        budget = self.profile.max_batched_tokens - len(decoders)
        secs = restore_s = 0.0
        prefill = restore = 0
        for c in self.batch:
            if id(c) in dec:
                continue
            if c.restore_left:
                restore_s += c.restore_left * cm.restore_per_token_s
                restore += c.restore_left
                c.restore_left = 0
            n = min(c.prefill_left, max(budget, 0))
            done_before = c.prefill_total - c.prefill_left
            secs += cm.prefill_s(done_before, n)
            c.prefill_left -= n
            prefill += n
            budget -= n
        per = 0.0
        if decoders:
            ctx = sum(c.prompt_tokens + c.decoded for c in decoders)
            per = cm.decode_s(len(decoders), ctx)
            secs += k * per
        if self.stream:  # the first forward after a streamed switch waits on the groups still in flight
            secs += self._streamed(now, restore_s, secs - (k - 1) * per)
        secs += restore_s + self.checkpoint_debt_s  # checkpoints of calls that ended (CPU profiles only)
        self.checkpoint_debt_s = 0.0
        out = StepOutcome(secs)
        t = now + secs
        for c in list(self.batch):
            if id(c) in dec or (c.prefill_left == 0 and c.restore_left == 0):
                n = k if id(c) in dec else 1
                c.decoded += n
                for j in range(n):  # each token at the end of its own decode step
                    self.tracker.emit(c.request_id, 1, t - (n - 1 - j) * per)
                if c.first_token_at is None:
                    c.first_token_at = t
                    out.first_tokens.append(c)
                if c.decoded >= c.output_tokens:
                    c.finished_at = t
                    self.batch.remove(c)
                    self.tracker.finish(c.request_id)
                    out.finished.append(c)
        self.steps += 1
        self.step_s += secs
        self._obs = (prefill, restore, len(decoders), secs / k if k > 1 else secs)
        return out

    def observed(self) -> tuple[int, int, int, float]:
        return self._obs

    # ------------------------------------------------------------------ KV bookkeeping
    def _layout(self, model: str) -> Layout:
        lay = self._layouts.get(model)
        if lay is None:
            c = self.profile.model(model)
            pb = c.kv_bytes_per_token * self.profile.page_tokens
            lay = self._layouts[model] = Layout(model, 0, 1, self.profile.page_tokens, "bf16", Family.MHA, (pb,), pb)
        return lay

    def keep(self, c: SimCall, now: float) -> None:
        """A call finished: its session's KV stays on device (LRU-bounded) and is checkpointed to host."""
        committed = c.prompt_tokens + c.decoded
        self.seen.add((c.model, c.session_id))
        self.last_work[c.model] = now
        if c.model == self.active:
            self.device.pop(c.session_id, None)
            self.device[c.session_id] = (c.model, committed)
            self.device_used[c.session_id] = now
            cap = self._kv_capacity_tokens()
            while self.device and self._kv_used_tokens() > cap:
                self.device.pop(next(iter(self.device)))
        if self.host is not None and self.policy.host_kv:
            self._checkpoint(c)
            # on a CPU the checkpoint's copies run on the serving cores: its compute lands on the next step
            self.checkpoint_debt_s += committed * self.profile.model(c.model).checkpoint_per_token_s

    def _checkpoint(self, c: SimCall, ctx: int | None = None) -> None:
        key = (c.model, c.session_id)
        chain = self.pages.get(key, [])
        keep_pages = min(len(chain), c.prefix_tokens // self.profile.page_tokens)
        chain = chain[:keep_pages]
        # generated tokens are not part of the next prompt (but are a parked call's context)
        full = (ctx or c.prompt_tokens) // self.profile.page_tokens
        while len(chain) < full:
            self._hash_ctr += 1
            chain.append(hash((self.iid, c.session_id, self._hash_ctr)) & ((1 << 63) - 1))
        self.pages[key] = chain
        if chain:
            assert self.host is not None
            res = self.host.reserve(self._layout(c.model), chain)
            if res.lease_id:
                self.host.commit(res.lease_id, [b.block_id for b in res.blocks])

    # ------------------------------------------------------------------ telemetry
    @property
    def running(self) -> int:
        return len(self.batch)

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def kv_usage(self) -> float:
        cap = self._kv_capacity_tokens()
        return min(1.0, self._kv_used_tokens() / cap) if cap else 0.0

    def kv_pages_total(self) -> int:
        return self._kv_capacity_tokens() // self.profile.page_tokens

    def sessions(self) -> list[tuple[str, str, int, str]]:
        """(session, model, committed tokens, "device" | "host") this instance can reuse."""
        out = [(s, m, t, "device") for s, (m, t) in self.device.items()]
        if self.host is not None and self.policy.host_kv:
            on_dev = {s for s, _ in self.device.items()}
            for (m, s), chain in self.pages.items():
                if s in on_dev and self.device[s][0] == m:
                    continue
                n = self.host_tokens(m, s)
                if n > 0:
                    out.append((s, m, n, "host"))
        return out
