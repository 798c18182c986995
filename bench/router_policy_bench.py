"""``talaria bench placement``: the router's placement policies side by side (Talaria §5.3-5.4).

SIMULATION. The replay runs the router's real placement code (``services.router.gateway.Gateway`` with the
pure ``policy.decide``, registry, session table, lease table, EWMA books) under a virtual clock, against a
profile-driven *simulated* executor: two cold-pool workers, three models, at most ``--slots`` models resident
per worker. No tokens are executed; every cost comes from the profile below. Absolute times are therefore
model outputs, not measurements; what the tables compare is the policies on identical inputs.

Simulated worker (one device)
    A FIFO "prefill server" runs, per call: model activation (0 if active, ``switch_s`` if resident,
    ``open_s`` if not, evicting the least recently used resident model; a switch first waits for the
    running decodes of the outgoing model), KV recovery of the session prefix (0 on device,
    ``restore_per_token`` from host, ``prefill_per_token`` to recompute) and the suffix prefill. The first
    token is out when that work ends (TTFT); the decode (``decode_step`` per token) then runs batched,
    off the server. Session KV stays on device up to ``kv_tokens`` per worker (LRU to host beyond; a model
    evicted from the device sends its sessions' KV to host). Heartbeat snapshots every ``beat_s``.

Workload (fixed per seed, identical for every policy)
    ``--sessions`` agent sessions per seed, ``--calls`` calls each, models drawn 50/30/20 %; first prompt
    1.5-3K tokens, each next call adds the previous answer plus 100-400 tool tokens; answers 40-150 tokens;
    tool gaps log-normal (median 0.39 s, p95 1.3 s, capped at 10 s); closed loop per session; session
    starts Poisson with mean spacing by load (low / medium / high). TTFT is measured from the call's
    enqueue time, SCT from a session's first call to its last response; nearest-rank percentiles pooled
    over ``--seeds`` seeds.

Reported
    1. Policies (full router, least-pressure, session-sticky) per load: avoidable cold opens (the chosen
       worker had to open the model while the other had it resident), model opens, same-worker return rate,
       TTFT p50/p95, SCT p50/p95.
    2. tau sweep (full router, medium load): same-worker returns, lease hits, unused leases (installed and
       never consumed), model opens, returning-call TTFT p50/p95.
    4. Lease policies on the per-tool workload (issue 14; ``--lease-sweep-only`` runs just this): gaps drawn
       per tool from ``bench.workloads.synthetic.TOOLS`` (fast ``ls``/``grep`` ~50 ms ... slow ``pytest`` ~6 s,
       capped at 10 s; the hook names the tool), ``--lease-calls`` calls per session, ``--lease-loads``;
       adaptive leases (``lease_policy: adaptive``, with and without the lease arithmetic) vs fixed tau in
       {0.5, 1, 2, 5} s: SCT p50/p95, lease hits,
       unused leases (installed - hits), expiries, declined (not worth it), outweighed (dropped at the
       return), and device KV held by leases in GiB x s (committed tokens x seconds held x
       ``KV_BYTES_PER_TOKEN``, SmolLM2-135M's 23,040 B/token: 30 layers x 3 KV heads x 64 x K+V x bf16).
    3. Placement decision cost (real time on this machine): microseconds per decision for 10 / 100 / 1000
       cold instances, for the pure ``decide`` on a prepared state and for the gateway path (state build
       from snapshots + overlay + decide); median of ``--cost-repeats`` rounds. ``--decision-cost-only``
       runs just this section. The replica-opening shortlist is ``PolicyParams.replica_shortlist`` (16).
"""

from __future__ import annotations

import heapq
import json
import math
import random
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from bench import format_table
from services.router.gateway import Gateway, PoolSpec
from services.router.lease_service import LeaseService
from services.router.leases import LeaseTable, MemoryLeases
from services.router.policy import PolicyParams, decide
from services.router.profiles import Defaults, ProfileBook, ShapeBook
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from talaria.switch_path import SwitchPath, costs_to_proto
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

MODELS = ("model-a", "model-b", "model-c")
POPULARITY = (0.5, 0.3, 0.2)
LOADS = {"low": 8.0, "medium": 3.0, "high": 1.0}  # mean seconds between session starts


@dataclass(frozen=True)
class SimProfile:
    prefill_per_token: float = 2.5e-4
    decode_step: float = 0.03
    restore_per_token: float = 2e-5
    switch_s: float = 0.4
    open_s: float = 3.0
    kv_tokens: int = 120_000
    beat_s: float = 0.25


# ------------------------------------------------------------------------------------------ workload


@dataclass
class Call:
    session: str
    model: str
    index: int
    prompt: int
    output: int
    gap_after: float
    arrival: float = 0.0
    first_token: float = 0.0
    done: float = 0.0
    worker: str = ""
    returning: bool = False
    tool: str = ""  # the tool this call invokes (its gap_after is that tool's run); "" = none


def workload(seed: int, sessions: int, calls: int, start_gap: float) -> list[list[Call]]:
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        model = rng.choices(MODELS, POPULARITY)[0]
        prompt = rng.randint(1500, 3000)
        seq = []
        for k in range(calls):
            answer = rng.randint(40, 150)
            gap = min(10.0, math.exp(math.log(0.39) + 0.732 * rng.gauss(0, 1)))
            seq.append(Call(f"s{seed}-{s}", model, k, prompt, answer, gap))
            prompt += answer + rng.randint(100, 400)
        out.append(seq)
    starts, t = [], 0.0
    for _ in range(sessions):
        starts.append(t)
        t += rng.expovariate(1.0 / start_gap)
    for seq, t0 in zip(out, starts):
        seq[0].arrival = t0
    return out


def tool_workload(seed: int, sessions: int, calls: int, start_gap: float) -> list[list[Call]]:
    """As ``workload``, but each call invokes a tool drawn from ``TOOLS`` and the gap after it is that tool's."""
    from bench.workloads.synthetic import TOOLS

    out = workload(seed, sessions, calls, start_gap)
    rng = random.Random(seed + 7919)
    for seq in out:
        for c in seq:
            t = rng.choices(TOOLS, weights=[t.weight for t in TOOLS])[0]
            c.tool, c.gap_after = t.name, min(10.0, t.gap.draw(rng))
    return out


KV_BYTES_PER_TOKEN = 23_040  # SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64 x (K, V) x 2 bytes


# -------------------------------------------------------------------------------- simulated worker


class SimWorker:
    def __init__(self, wid: str, prof: SimProfile, slots: int):
        self.id = wid
        self.p = prof
        self.slots = slots
        self.loaded: OrderedDict[str, None] = OrderedDict()  # LRU of resident models
        self.active: str | None = None
        self.queue: list[Call] = []
        self.busy_until = 0.0
        self.serving = False
        self.decode_end: dict[str, float] = {}
        self.running: list[float] = []  # decode end times
        self.device: OrderedDict[tuple[str, str], int] = OrderedDict()  # (session, model) -> tokens
        self.host: dict[tuple[str, str], int] = {}
        self.opens = 0
        self.seq = 0

    def _evict_kv(self, key) -> None:
        self.host[key] = self.device.pop(key)

    def start_next(self, now: float) -> tuple[float, Call] | None:
        """Start the next queued call on the prefill server; returns (first-token time, call)."""
        if self.serving or not self.queue:
            return None
        c = self.queue.pop(0)
        p = self.p
        t = max(now, self.busy_until)
        if self.active != c.model:
            if self.active is not None:
                t = max(t, self.decode_end.get(self.active, 0.0))  # drain the outgoing model's decodes
            if c.model in self.loaded:
                t += p.switch_s
            else:
                self.opens += 1
                t += p.open_s
                if len(self.loaded) >= self.slots:
                    victim, _ = self.loaded.popitem(last=False)
                    for key in [k for k in self.device if k[1] == victim]:
                        self._evict_kv(key)
            self.active = c.model
        self.loaded[c.model] = None
        self.loaded.move_to_end(c.model)
        key = (c.session, c.model)
        prefix = 0
        if key in self.device:
            prefix = self.device[key]
        elif key in self.host:
            prefix = self.host.pop(key)
            t += prefix * p.restore_per_token
        t += max(1, c.prompt - prefix) * p.prefill_per_token  # no prefix here: the whole prompt (recompute)
        self.busy_until = t
        self.serving = True
        c.first_token, c.worker = t, self.id
        c.done = t + c.output * p.decode_step
        self.decode_end[c.model] = max(self.decode_end.get(c.model, 0.0), c.done)
        self.running.append(c.done)
        return t, c

    def finish(self, c: Call) -> None:
        key = (c.session, c.model)
        self.device.pop(key, None)
        self.device[key] = c.prompt + c.output
        while sum(self.device.values()) > self.p.kv_tokens and len(self.device) > 1:
            self._evict_kv(next(iter(self.device)))
        self.running.remove(c.done)

    def snapshot(self, now: float) -> pb.InstanceSnapshot:
        self.seq += 1
        snap = pb.InstanceSnapshot(
            instance_id=self.id, pool=pb.POOL_COLD, epoch=1, seq=self.seq, sent_unix=now, heartbeat_period_s=self.p.beat_s,
            num_running=len(self.running), num_waiting=len(self.queue) + (1 if self.serving else 0),
            kv_usage=min(1.0, sum(self.device.values()) / self.p.kv_tokens),
        )
        for m in MODELS:
            snap.models.append(pb.ModelState(model=m, loaded=m in self.loaded, active=m == self.active, max_context=1 << 17))
        for (s, m), n in self.device.items():
            snap.sessions.append(pb.SessionState(session_id=s, model=m, committed_tokens=n, state=pb.KV_DEVICE))
        for (s, m), n in self.host.items():
            snap.sessions.append(pb.SessionState(session_id=s, model=m, committed_tokens=n, state=pb.KV_HOST))
        p = self.p
        snap.profile.CopyFrom(
            pb.CostProfile(
                prefill_per_token=p.prefill_per_token, decode_step=p.decode_step, restore_per_token=p.restore_per_token,
                switch_costs=costs_to_proto({SwitchPath.HOST_ONLY: p.switch_s, SwitchPath.OPEN: p.open_s}),
            )
        )
        return snap


# ------------------------------------------------------------------------------------------ replay


def replay(policy: str, tau: float, sessions: list[list[Call]], prof: SimProfile, slots: int, workers: int = 2, lease_policy: str = "fixed") -> dict:
    """``lease_policy``: fixed | adaptive | adaptive-no-arith (adaptive windows, lease arithmetic off)."""
    arith = lease_policy != "adaptive-no-arith"
    lease_policy = "adaptive" if lease_policy.startswith("adaptive") else lease_policy
    clock = ManualClock(0.0)
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
    table = LeaseTable()
    store = MemoryLeases(table)
    pools = {f"w{i}": PoolSpec("cold", MODELS) for i in range(workers)}
    defaults = Defaults(prof.prefill_per_token, prof.decode_step, prof.restore_per_token, prof.switch_s, prof.open_s)
    gw = Gateway(
        PolicyParams(policy=policy, lease_policy=lease_policy, lease_arithmetic=arith), reg, SessionTable(clock), table, clock.now, profiles=ProfileBook(defaults),
        shapes=ShapeBook(), tau_s=tau, pools=pools, decisions_kept=0,
    )
    leases = LeaseService(gw, store)
    ws = {wid: SimWorker(wid, prof, slots) for wid in pools}
    events: list = []
    n = 0

    def push(t, kind, obj):
        nonlocal n
        n += 1
        heapq.heappush(events, (t, n, kind, obj))

    for seq in sessions:
        push(seq[0].arrival, "arrive", seq[0])
    push(0.0, "beat", None)
    by_session = {seq[0].session: seq for seq in sessions}
    remaining = sum(len(s) for s in sessions)
    while events and remaining:
        t, _, kind, obj = heapq.heappop(events)
        clock.t = max(clock.t, t)
        if kind == "beat":
            for w in ws.values():
                gw.on_snapshot(w.snapshot(t))
            push(t + prof.beat_s, "beat", None)
        elif kind == "arrive":
            c: Call = obj
            req = gw.request(c.session, c.model, c.prompt, 256)
            if not c.returning and c.index > 0:
                c.returning = True
            leases.arrival(req)
            d, rev = gw.decide(req)
            leases.settle_now(d, rev, c.session, c.model)  # one router: a lease is never lost to a race
            if d.instance_id is None:  # overload: the gateway queue retries shortly
                push(t + 0.1, "retry", c)
                continue
            leases.commit(req, d)
            w = ws[d.instance_id]
            w.queue.append(c)
            started = w.start_next(t)
            if started:
                push(started[0], "first", started[1])
        elif kind == "retry":
            push(t, "arrive", obj)
        elif kind == "first":
            c = obj
            w = ws[c.worker]
            w.serving = False
            push(c.done, "done", c)
            started = w.start_next(t)
            if started:
                push(started[0], "first", started[1])
        elif kind == "done":
            c = obj
            w = ws[c.worker]
            w.finish(c)
            remaining -= 1
            hook = pb.CompletionHook(
                request_id=f"{c.session}-{c.index}", session_id=c.session, model=c.model, instance_id=c.worker, finish_unix=t,
                prefix=cpb.PrefixHandle(model=c.model, committed_tokens=c.prompt + c.output),
                usage=cpb.Usage(prompt_tokens=c.prompt, completion_tokens=c.output),
            )
            if c.tool:
                hook.tool_names.append(c.tool)
            lease = leases.on_hook(hook)
            if lease is not None:
                store.install_now(lease)
            seq = by_session[c.session]
            if c.index + 1 < len(seq):
                nxt = seq[c.index + 1]
                nxt.arrival = t + c.gap_after
                push(nxt.arrival, "arrive", nxt)
    calls = [c for seq in sessions for c in seq]
    m = leases.metrics()
    return {
        "calls": calls,
        "sct": [seq[-1].done - seq[0].arrival for seq in sessions],
        "stats": m,
        "opens": sum(w.opens for w in ws.values()),
    }


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100.0 * len(s)) - 1)]


def run_policies(args, prof: SimProfile) -> list[dict]:
    rows = []
    for load, gap in LOADS.items():
        for policy in ("full", "least-pressure", "session-sticky"):
            agg = {"calls": [], "sct": [], "avoidable": 0, "opens": 0, "returns": 0, "same": 0}
            for seed in range(args.seeds):
                res = replay(policy, args.tau, workload(args.seed + seed, args.sessions, args.calls, gap), prof, args.slots)
                agg["calls"] += res["calls"]
                agg["sct"] += res["sct"]
                st = res["stats"]
                agg["avoidable"] += st["avoidable_cold_opens"]
                agg["opens"] += res["opens"]
                agg["returns"] += st["returns"]
                agg["same"] += st["same_instance_returns"]
            ttft = [c.first_token - c.arrival for c in agg["calls"]]
            rows.append(
                {
                    "load": load, "policy": policy, "calls": len(agg["calls"]), "avoidable_cold_opens": agg["avoidable"],
                    "model_opens": agg["opens"], "same_worker_return_rate": agg["same"] / max(1, agg["returns"]),
                    "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95), "sct_p50": pct(agg["sct"], 50), "sct_p95": pct(agg["sct"], 95),
                }
            )
    return rows


def run_tau_sweep(args, prof: SimProfile) -> list[dict]:
    rows = []
    for tau in args.taus:
        agg = {"calls": [], "opens": 0, "returns": 0, "same": 0, "hits": 0, "installed": 0, "avoidable": 0}
        for seed in range(args.seeds):
            res = replay("full", tau, workload(args.seed + seed, args.sessions, args.calls, LOADS["medium"]), prof, args.slots)
            st = res["stats"]
            agg["calls"] += res["calls"]
            agg["opens"] += res["opens"]
            agg["returns"] += st["returns"]
            agg["same"] += st["same_instance_returns"]
            agg["hits"] += st["lease_hits"]
            agg["installed"] += st["leases_installed"]
            agg["avoidable"] += st["avoidable_cold_opens"]
        ttft = [c.first_token - c.arrival for c in agg["calls"] if c.index > 0]
        rows.append(
            {
                "tau_s": tau, "same_worker_return_rate": agg["same"] / max(1, agg["returns"]), "lease_hits": agg["hits"],
                "unused_leases": max(0, agg["installed"] - agg["hits"] - args.seeds * args.sessions),  # last calls' leases excluded
                "model_opens": agg["opens"], "avoidable_cold_opens": agg["avoidable"],
                "return_ttft_p50": pct(ttft, 50), "return_ttft_p95": pct(ttft, 95),
            }
        )
    return rows


LEASE_CONFIGS = (("fixed", 0.5), ("fixed", 1.0), ("fixed", 2.0), ("fixed", 5.0), ("adaptive", 1.0), ("adaptive-no-arith", 1.0))


def run_lease_sweep(args, prof: SimProfile) -> list[dict]:
    """Section 4: lease policies on the per-tool workload, pooled over seeds, per load."""
    rows = []
    for load in args.lease_loads:
        for lp, tau in LEASE_CONFIGS:
            agg = {"sct": [], "ttft": [], "hits": 0, "installed": 0, "expiries": 0, "declined": 0, "outweighed": 0, "token_s": 0.0}
            for seed in range(args.seeds):
                res = replay("full", tau, tool_workload(args.seed + seed, args.sessions, args.lease_calls, LOADS[load]), prof, args.slots, lease_policy=lp)
                st = res["stats"]
                agg["sct"] += res["sct"]
                agg["ttft"] += [c.first_token - c.arrival for c in res["calls"] if c.index > 0]
                agg["hits"] += st["lease_hits"]
                agg["installed"] += st["leases_installed"]
                agg["expiries"] += st["lease_expiries"]
                agg["declined"] += st["leases_declined"]
                agg["outweighed"] += st["lease_outweighed"]
                agg["token_s"] += st["lease_token_s"]
            rows.append({
                "load": load, "lease_policy": lp if lp.startswith("adaptive") else f"fixed {tau:g}s",
                "sct_p50": pct(agg["sct"], 50), "sct_p95": pct(agg["sct"], 95),
                "return_ttft_p50": pct(agg["ttft"], 50), "return_ttft_p95": pct(agg["ttft"], 95),
                "lease_hits": agg["hits"], "leases_installed": agg["installed"], "unused_leases": agg["installed"] - agg["hits"],
                "lease_expiries": agg["expiries"], "leases_declined": agg["declined"], "lease_outweighed": agg["outweighed"],
                "lease_gib_s": agg["token_s"] * KV_BYTES_PER_TOKEN / 2**30,
            })
    return rows


def print_lease_sweep(rows: list[dict], args) -> None:
    print(f"4. Lease policies on the per-tool workload (SIMULATION; {args.sessions} sessions x {args.lease_calls} calls x {args.seeds} seeds per load)")
    print(format_table(
        ["load", "leases", "SCT p50", "SCT p95", "ret.TTFT p50", "ret.TTFT p95", "hits", "unused", "expiries", "declined", "outweighed", "KV GiB*s"],
        [[r["load"], r["lease_policy"], r["sct_p50"], r["sct_p95"], r["return_ttft_p50"], r["return_ttft_p95"], r["lease_hits"], r["unused_leases"],
          r["lease_expiries"], r["leases_declined"], r["lease_outweighed"], r["lease_gib_s"]] for r in rows],
    ))


# ------------------------------------------------------------------------------- decision cost


def decision_cost(sizes: list[int], seed: int, repeats: int = 1) -> list[dict]:
    """Median over ``repeats`` timing rounds of each loop (same prepared states every round)."""
    rows = []
    catalog = [f"m{k}" for k in range(8)]
    for n in sizes:
        rng = random.Random(seed + n)
        clock = ManualClock(1000.0)
        reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
        pools = {f"i{k}": PoolSpec("cold", tuple(catalog)) for k in range(n)}
        gw = Gateway(PolicyParams(), reg, SessionTable(clock), LeaseTable(), clock.now, tau_s=1.0, pools=pools, decisions_kept=0)
        for k in range(n):
            loaded = set(rng.sample(catalog, 3))
            active = next(iter(loaded))
            snap = pb.InstanceSnapshot(
                instance_id=f"i{k}", pool=pb.POOL_COLD, epoch=1, seq=1, sent_unix=clock.now(), heartbeat_period_s=0.5,
                num_running=rng.randint(0, 8), num_waiting=rng.randint(0, 4), kv_pages_total=100_000, kv_usage=rng.random() * 0.8,
            )
            for m in catalog:
                snap.models.append(pb.ModelState(model=m, loaded=m in loaded, active=m == active))
            for s in range(32):
                snap.sessions.append(pb.SessionState(session_id=f"s{k}-{s}", model=active, committed_tokens=2000, state=pb.KV_DEVICE))
            snap.profile.CopyFrom(pb.CostProfile(prefill_per_token=2.5e-4, decode_step=0.03, switch_costs=costs_to_proto({SwitchPath.HOST_ONLY: 0.4, SwitchPath.OPEN: 3.0})))
            gw.on_snapshot(snap)
        reqs = [gw.request(f"s{rng.randrange(n)}-{rng.randrange(32)}", rng.choice(catalog), 3000, 128) for _ in range(64)]
        states = [gw.state_for(r)[0] for r in reqs]
        reps = max(20, 20_000 // n)
        reps_gw = max(10, 5_000 // n)
        pures, fulls = [], []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            for k in range(reps):
                decide(states[k % len(states)], clock.now())
            pures.append((time.perf_counter() - t0) / reps * 1e6)
            t0 = time.perf_counter()
            for k in range(reps_gw):
                gw.decide(reqs[k % len(reqs)])
            fulls.append((time.perf_counter() - t0) / reps_gw * 1e6)
        pure, full = statistics.median(pures), statistics.median(fulls)
        rows.append({"instances": n, "decide_us": pure, "gateway_us": full, "decide_us_per_instance": pure / n, "repeats": len(pures),
                     "replica_shortlist": gw.params.replica_shortlist})
    return rows


# -------------------------------------------------------------------------------------------- main


def print_decision_cost(rows: list[dict]) -> None:
    print(f"3. Placement decision cost (measured on this machine; 8-model catalog, 3 resident, 32 sessions per instance; "
          f"median of {rows[0]['repeats'] if rows else 0} rounds; replica shortlist k = {rows[0]['replica_shortlist'] if rows else '-'})")
    print(format_table(
        ["instances", "decide (us)", "gateway build+decide (us)", "decide us/instance"],
        [[r["instances"], r["decide_us"], r["gateway_us"], r["decide_us_per_instance"]] for r in rows],
    ))


def main(args) -> int:
    if args.lease_sweep_only:
        rows = run_lease_sweep(args, SimProfile())
        print_lease_sweep(rows, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"simulation": True, "lease_sweep": rows}, indent=2))
            print(f"\nwrote {args.json}")
        return 0
    if args.decision_cost_only:
        rows = decision_cost(args.sizes, args.seed, args.cost_repeats)
        print_decision_cost(rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"decision_cost": rows}, indent=2))
            print(f"\nwrote {args.json}")
        return 0
    prof = SimProfile()
    print("SIMULATION: real router placement code under a virtual clock; profile-driven simulated executor "
          f"(2 cold workers, {args.slots} resident models each, 3 models; {args.sessions} sessions x {args.calls} calls x {args.seeds} seeds)")
    print(f"profile: {prof}\n")
    out: dict = {"simulation": True, "profile": prof.__dict__, "args": {k: v for k, v in vars(args).items() if k != "fn"}}
    rows = run_policies(args, prof)
    out["policies"] = rows
    print(f"1. Policies side by side (tau = {args.tau} s; times in simulated seconds)")
    print(format_table(
        ["load", "policy", "calls", "avoid.opens", "opens", "same-worker", "TTFT p50", "TTFT p95", "SCT p50", "SCT p95"],
        [[r["load"], r["policy"], r["calls"], r["avoidable_cold_opens"], r["model_opens"], f"{100 * r['same_worker_return_rate']:.1f}%",
          r["ttft_p50"], r["ttft_p95"], r["sct_p50"], r["sct_p95"]] for r in rows],
    ))
    tau_rows = run_tau_sweep(args, prof)
    out["tau_sweep"] = tau_rows
    print("\n2. tau sweep (full router, medium load; returning calls only for TTFT)")
    print(format_table(
        ["tau (s)", "same-worker", "lease hits", "unused leases", "opens", "avoid.opens", "ret. TTFT p50", "ret. TTFT p95"],
        [[r["tau_s"], f"{100 * r['same_worker_return_rate']:.1f}%", r["lease_hits"], r["unused_leases"], r["model_opens"],
          r["avoidable_cold_opens"], r["return_ttft_p50"], r["return_ttft_p95"]] for r in tau_rows],
    ))
    lease_rows = run_lease_sweep(args, prof)
    out["lease_sweep"] = lease_rows
    print()
    print_lease_sweep(lease_rows, args)
    cost_rows = decision_cost(args.sizes, args.seed, args.cost_repeats)
    out["decision_cost"] = cost_rows
    print()
    print_decision_cost(cost_rows)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"\nwrote {args.json}")
    return 0


def add_args(p) -> None:
    p.add_argument("--sessions", type=int, default=24, help="sessions per seed (default 24)")
    p.add_argument("--calls", type=int, default=5, help="calls per session (default 5: 120 calls per seed, as in §5.3)")
    p.add_argument("--seeds", type=int, default=5, help="workload seeds pooled (default 5)")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--slots", type=int, default=2, help="models resident per simulated worker (default 2)")
    p.add_argument("--tau", type=float, default=1.0, help="lease timeout of the full router in table 1 (default 1 s)")
    p.add_argument("--taus", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 5.0], help="tau sweep values")
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000], help="instance counts for the decision cost")
    p.add_argument("--cost-repeats", type=int, default=5, help="timing rounds per size in section 3; medians reported (default 5)")
    p.add_argument("--decision-cost-only", action="store_true", help="run only section 3 (placement decision cost)")
    p.add_argument("--lease-sweep-only", action="store_true", help="run only section 4 (lease policies on the per-tool workload)")
    p.add_argument("--lease-calls", type=int, default=20, help="calls per session in section 4 (default 20)")
    p.add_argument("--lease-loads", nargs="+", choices=list(LOADS), default=["low", "medium"], help="loads of section 4 (default low medium)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
