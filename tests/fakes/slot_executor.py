"""A profile-driven fake cold-pool executor and a virtual-clock driver for the slot scheduler.

The fake executor keeps exactly the state the scheduler's decisions act on — per-model queues, the batch
of the active model (prefilling / decoding calls), device-resident session prefixes of the active model,
host copies of session prefixes (``host_kv``) — and charges time from a *true* cost profile that the
scheduler only learns through ``observe_step``/``observe_switch`` (its own estimates may start elsewhere).
Switching away from a model drops its device KV (moved to host when ``host_kv``), as the real cold engine
does. No torch, no threads: unit tests now, the discrete-event simulator later.

``simulate`` drives the fake through the engine's own slot driver (``services/engine/cold/driver.py``: build
the view, decide, carry out) and replays closed-loop sessions (each call of a session arrives a tool gap after the previous
one finished; Talaria §5.1) under a :class:`~talaria.clock.ManualClock` and returns per-call TTFT,
per-session SCT and the round summaries.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from talaria.clock import ManualClock
from talaria.switch_path import SwitchPath

from services.engine.cold.driver import SlotDriver
from services.engine.slots.costs import CostProfile
from services.engine.slots.scheduler import SlotScheduler
from services.engine.slots.types import CallView, Decision, InstanceView, ModelView, ReturnView, RoundSummary


@dataclass(slots=True)
class FakeCall:
    request_id: str
    model: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    session_id: str = ""
    prefill_left: int = 0
    restore_left: int = 0
    decoded: int = 0
    cached_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    seconds: float
    prefill_tokens: int
    restore_tokens: int
    decode_seqs: int
    first_tokens: tuple[str, ...]
    finished: tuple[str, ...]


class FakeExecutor:
    def __init__(
        self,
        models: Sequence[str],
        truth: CostProfile | dict[str, CostProfile],
        *,
        host_kv: bool = True,
        d2d_staging: bool = True,
        kv_tokens: int | None = None,
        max_batched_tokens: int = 512,
        initial: str | None = None,
    ) -> None:
        self.models = list(models)
        self._truth = truth
        self.host_kv = host_kv
        self.d2d_staging = d2d_staging
        self.kv_tokens = kv_tokens
        self.max_batched_tokens = max_batched_tokens
        self.active: str | None = initial or (self.models[0] if self.models else None)
        self.queues: dict[str, list[FakeCall]] = {m: [] for m in self.models}
        self.batch: list[FakeCall] = []
        self.device: dict[str, int] = {}  # session -> committed tokens on device (active model's sessions only)
        self.host: dict[tuple[str, str], int] = {}  # (model, session) -> committed tokens in the host store
        self.seen: set[tuple[str, str]] = set()  # (model, session) served here before
        self.calls: dict[str, FakeCall] = {}
        self.switch_log: list[tuple[str, str, str, float]] = []
        # (model, session) -> (call end, its ReturnView as of the call end): returns the router expects (its
        # retention hints); dropped when the session's next call arrives
        self.expected: dict[tuple[str, str], tuple[float, ReturnView]] = {}

    def truth(self, model: str) -> CostProfile:
        return self._truth[model] if isinstance(self._truth, dict) else self._truth

    # ---------------------------------------------------------------- intake
    def submit(self, call: FakeCall) -> None:
        self.calls[call.request_id] = call
        self.expected.pop((call.model, call.session_id), None)
        self.queues[call.model].append(call)

    # ---------------------------------------------------------------- the view
    def _prefix(self, c: FakeCall) -> tuple[int, str]:
        if c.session_id and c.model == self.active and c.session_id in self.device:
            return min(self.device[c.session_id], c.prompt_tokens), "device"
        if c.session_id and (c.model, c.session_id) in self.host:
            return min(self.host[(c.model, c.session_id)], c.prompt_tokens), "host"
        return 0, "missing"

    def view(self, now: float = 0.0) -> InstanceView:
        mvs = []
        for m in self.models:
            queued = []
            for c in self.queues[m]:
                n, where = self._prefix(c)
                queued.append(CallView(c.request_id, m, c.arrival, c.prompt_tokens, c.max_tokens, c.session_id, n, where, (m, c.session_id) in self.seen))
            batch = self.batch if m == self.active else []
            mvs.append(ModelView(
                m, running=len(batch), prefilling=sum(1 for c in batch if c.prefill_left > 0 or c.restore_left > 0),
                max_remaining_decode=max((c.max_tokens - c.decoded for c in batch), default=0), queued=tuple(queued),
                returns=tuple(replace(rv, elapsed_s=now - t) for (mm, _), (t, rv) in self.expected.items() if mm == m),
            ))
        free = None
        if self.kv_tokens is not None:
            used = sum(c.prompt_tokens + c.decoded for c in self.batch) + sum(self.device.values())
            free = max(0, self.kv_tokens - used)
        staged = {m: (1.0 if self.d2d_staging else 0.0) for m in self.models}
        return InstanceView(self.active, tuple(mvs), free, staged)

    # ---------------------------------------------------------------- actions
    def switch(self, target: str) -> tuple[str, float]:
        assert not self.batch, "switch with calls in flight"
        src = self.active
        if src is not None:
            for sid, n in self.device.items():
                if self.host_kv:
                    self.host[(src, sid)] = n
            self.device.clear()
        path = SwitchPath.FULL_STAGED if self.d2d_staging else SwitchPath.HOST_ONLY
        secs = self.truth(target).switch_by_path[path]
        self.active = target
        self.switch_log.append((src or "", target, path, secs))
        return path, secs

    def admit(self, ids: Sequence[str], now: float) -> None:
        q = self.queues[self.active] if self.active else []
        for rid in ids:
            c = next(x for x in q if x.request_id == rid)
            q.remove(c)
            n, where = self._prefix(c)
            reuse = min(n, c.prompt_tokens - 1)
            if where == "device":
                self.device.pop(c.session_id, None)
                c.cached_tokens = reuse
            elif where == "host" and self.host_kv:
                c.restore_left = reuse
                c.cached_tokens = reuse
            else:
                reuse = 0
            c.prefill_left = c.prompt_tokens - reuse
            c.admitted_at = now
            self.batch.append(c)

    def step(self, now: float) -> StepResult:
        """One batch: every decoding call gets one token, prefills share ``max_batched_tokens``."""
        p = self.truth(self.active) if self.active else CostProfile()
        decoders = [c for c in self.batch if c.prefill_left == 0 and c.restore_left == 0]
        dec = {id(c) for c in decoders}
        budget = self.max_batched_tokens - len(decoders)
        prefill = restore = 0
        firsts: list[str] = []
        for c in self.batch:
            if id(c) in dec:
                continue
            restore += c.restore_left
            c.restore_left = 0
            n = min(c.prefill_left, max(budget, 0))
            c.prefill_left -= n
            prefill += n
            budget -= n
        secs = (p.decode_step if decoders else 0.0) + prefill * p.prefill_per_token + restore * p.restore_per_token
        t = now + secs
        done: list[str] = []
        for c in list(self.batch):
            if id(c) in dec or (c.prefill_left == 0 and c.restore_left == 0):
                c.decoded += 1
                if c.first_token_at is None:
                    c.first_token_at = t
                    firsts.append(c.request_id)
                if c.decoded >= c.max_tokens:
                    c.finished_at = t
                    self.batch.remove(c)
                    done.append(c.request_id)
                    if c.session_id:
                        self.device[c.session_id] = c.prompt_tokens + c.decoded
                        self.seen.add((c.model, c.session_id))
        return StepResult(secs, prefill, restore, len(decoders), tuple(firsts), tuple(done))


# ====================================================================== closed-loop replay
@dataclass(frozen=True, slots=True)
class CallSpec:
    prompt_tokens: int
    max_tokens: int
    gap_after_s: float = 0.0  # tool time before the session's next call


@dataclass(frozen=True, slots=True)
class SessionSpec:
    session_id: str
    model: str
    start_s: float
    calls: tuple[CallSpec, ...]


@dataclass(slots=True)
class SimResult:
    calls: list[FakeCall]
    returning: set[str]  # request ids of calls after a session's first
    sct: dict[str, float]  # session -> first arrival .. last finish
    summaries: list[RoundSummary]
    decisions: list[Decision] = field(default_factory=list)
    end: float = 0.0

    def ttft(self, returning: bool | None = None) -> list[float]:
        return [c.first_token_at - c.arrival for c in self.calls if c.first_token_at is not None and (returning is None or (c.request_id in self.returning) == returning)]


class _Replay:
    """The closed-loop replay as the slot driver's port (``services/engine/cold/driver.py``): the fake executor
    carries decisions out, the manual clock advances by what each action took, finished calls schedule their
    session's next call a tool gap later."""

    def __init__(self, sessions: Sequence[SessionSpec], scheduler: SlotScheduler, executor: FakeExecutor, clock: ManualClock,
                 keep_decisions: bool, hint) -> None:
        self.sessions, self.scheduler, self.executor, self.clock = sessions, scheduler, executor, clock
        self.keep_decisions, self.hint = keep_decisions, hint
        self.arrivals: list[tuple[float, int, int]] = [(s.start_s, i, 0) for i, s in enumerate(sessions)]
        heapq.heapify(self.arrivals)
        self.first_arrival: dict[str, float] = {}
        self.last_finish: dict[str, float] = {}
        self.returning: set[str] = set()
        self.owner: dict[str, tuple[int, int]] = {}
        self.unfinished = sum(len(s.calls) for s in sessions)
        self.decisions: list[Decision] = []

    def arrive(self, now: float) -> None:
        """Calls due by ``now`` reach the executor. Mutates the arrival heap and the executor's queues."""
        while self.arrivals and self.arrivals[0][0] <= now + 1e-12:
            t, i, k = heapq.heappop(self.arrivals)
            s = self.sessions[i]
            spec = s.calls[k]
            rid = f"{s.session_id}#{k}"
            self.executor.submit(FakeCall(rid, s.model, t, spec.prompt_tokens, spec.max_tokens, s.session_id))
            self.owner[rid] = (i, k)
            self.first_arrival.setdefault(s.session_id, t)
            if k > 0:
                self.returning.add(rid)

    # ---------------------------------------------------------------- SlotPort
    def slot_view(self, now: float) -> InstanceView:
        return self.executor.view(now)

    def on_decision(self, view: InstanceView, d: Decision, now: float) -> None:
        if self.keep_decisions:
            self.decisions.append(d)

    def switch_slot(self, target: str, now: float) -> float | None:
        path, secs = self.executor.switch(target)
        self.clock.advance(secs)
        self.scheduler.observe_switch(path, secs)
        return None  # the next turn (after the arrivals meanwhile) opens the slot

    def run_step(self, admit: tuple[str, ...], now: float) -> None:
        ex = self.executor
        ex.admit(admit, now)
        res = ex.step(now)
        self.clock.advance(res.seconds)
        self.scheduler.observe_step(ex.active or "", res.prefill_tokens, res.restore_tokens, res.decode_seqs, res.seconds)
        for rid in res.finished:
            self.unfinished -= 1
            i, k = self.owner[rid]
            s = self.sessions[i]
            self.last_finish[s.session_id] = self.clock.now()
            if k + 1 < len(s.calls):
                heapq.heappush(self.arrivals, (self.clock.now() + s.calls[k].gap_after_s, i, k + 1))
                h = self.hint(s.calls[k]) if self.hint is not None else None
                if h is not None:
                    c = ex.calls[rid]
                    rv = ReturnView(s.session_id, 0.0, *h, c.decoded, c.prompt_tokens - c.cached_tokens, c.prompt_tokens + c.decoded)
                    ex.expected[(s.model, s.session_id)] = (self.clock.now(), rv)

    def wait(self, d: Decision, now: float) -> None:
        if not self.arrivals:
            raise RuntimeError(f"scheduler idles with {self.unfinished} calls unfinished: {d}")
        wake = self.arrivals[0][0] if d.hold_s <= 0 else min(self.arrivals[0][0], now + d.hold_s)
        self.clock.advance(max(0.0, wake - now))


def simulate(
    sessions: Sequence[SessionSpec],
    scheduler: SlotScheduler,
    executor: FakeExecutor,
    clock: ManualClock | None = None,
    *,
    keep_decisions: bool = False,
    max_iterations: int = 1_000_000,
    hint=None,
) -> SimResult:
    """``hint(spec) -> (mu, sigma, window) | None``: the router's prediction of the gap after a call (what its
    retention hint would carry), given to the executor when the call finishes; None = no lease."""
    clock = clock or ManualClock()
    replay = _Replay(sessions, scheduler, executor, clock, keep_decisions, hint)
    driver = SlotDriver(scheduler, replay)
    for _ in range(max_iterations):
        replay.arrive(clock.now())
        if replay.unfinished == 0:
            break
        driver.turn(clock.now())
    else:
        raise RuntimeError("simulation did not finish")
    scheduler.decide(executor.view(clock.now()), clock.now())  # closes the last round
    sct = {sid: replay.last_finish[sid] - replay.first_arrival[sid] for sid in replay.last_finish}
    return SimResult(list(executor.calls.values()), replay.returning, sct, scheduler.take_summaries(), replay.decisions, clock.now())
