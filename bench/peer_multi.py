"""``talaria bench peer --multi``: two models, one Talaria stack vs one peer server per model.

What is compared
    A user who runs an agent model and a user-simulator model on one machine either starts one Talaria
    stack serving both (``--talaria-url``, ``--talaria-models AGENT USER``) or one OpenAI-compatible server
    per model (``--peer MODEL=URL`` twice, e.g. two vLLM-CPU servers, each given half the cores and half the
    KV memory: ``bench/README.md``, *Two models*). Both sides serve the same two checkpoints; the i-th
    ``--peer`` model is the i-th Talaria model.

Workload
    The matrix's two-model workload (``bench/workloads/synthetic.py``, ``two_model``): sessions alternate an
    agent model and a user-simulator model (a run of agent calls separated by tool gaps, then one
    user-simulator call after a short hand-off gap), every prompt a true prefix extension of the previous
    call's (token ids, ``/v1/completions``), ``max_tokens`` fixed per call with ``ignore_eos`` so both sides
    generate exactly the same number of tokens, greedy. Half the sessions have the first model as the agent,
    half the second (the generator's seeded round-robin). A new seed per repetition (``seed * 1000 + rep``),
    so no repetition finds the previous one's prefixes cached; within a repetition both sides get the very
    same calls. Played closed-loop by ``bench/replay.py`` (a call is released when the session's previous
    call has finished and its gap has passed), so each side's own speed sets its interleaving.

Metrics (per side and repetition)
    SCT p50/p95 (end of a session's last response - intended enqueue of its first call; sessions with a
    failed call left out, as in the matrix); schedule-aware TTFT p50/p95 of first calls (``call_index`` 0)
    and of returning calls (the rest), and p50 of the returns that change model (the hand-offs, where the
    other model must pick the session up); failed calls (summed over repetitions in the table); memory:
    the peak over the run of the summed RSS of each side's processes (sampled every ``--mem-interval`` s;
    Talaria: the supervisor of ``talaria up`` and every process under it -- NATS, engines, router, kvstore,
    telemetry; the peer: each server's process tree), and the summed PSS beside it (RSS counts the pages two
    processes share -- torch's libraries, say -- once per process; PSS splits them).

    Which processes: by default the one listening on each URL's port, with everything under it; when that
    process's parent is a ``talaria up`` / ``talaria serve`` supervisor, the supervisor's whole tree.
    ``--talaria-pids`` / ``--peer-pids`` name the root processes instead (a server on another host: memory
    is n/a).

How it is reported
    Repetitions are interleaved (Talaria first in even repetitions, the peer first in odd ones). Per metric
    the median over repetitions of each side and the advantage peer / Talaria (every metric here is lower
    = better, so > 1 means Talaria is better); the 1-minute load average at the start and end of every run
    beside the numbers; Talaria's effective configuration (``--talaria-config``, as in the one-model bench).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench import emit, format_table, median
from bench.report import session_scts
from bench.workloads import Workload, nearest_rank

LOWER_IS_BETTER = True  # every metric of this bench is a time, a count of failures or bytes


# ------------------------------------------------------------------------------------ pure parts
def parse_peers(specs: list[str]) -> list[tuple[str, str]]:
    """``MODEL=URL`` specs -> [(model, url)] in the order given; the URL keeps its scheme and path."""
    out = []
    for s in specs:
        model, sep, url = s.partition("=")
        if not sep or not model or not url.startswith(("http://", "https://")):
            raise ValueError(f"--peer wants MODEL=URL (e.g. smollm2=http://127.0.0.1:8001/v1), got {s!r}")
        out.append((model, url))
    if len({m for m, _ in out}) != len(out):
        raise ValueError(f"--peer names a model twice: {[m for m, _ in out]}")
    return out


def api_base(url: str) -> str:
    """An OpenAI base URL (``.../v1``) as the replay client wants it (it appends ``/v1/...`` itself)."""
    u = url.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


def make_workload(models: tuple[str, str], *, sessions: int, seed: int, max_depth: int, length_scale: float,
                  time_scale: float, mean_interarrival_s: float, agent_calls_per_turn: float) -> Workload:
    """The matrix's two-model synthetic workload over ``models`` (token-id prompts; a pure function)."""
    from bench.workloads.synthetic import SynthParams, generate

    return generate(SynthParams(sessions=sessions, models=tuple(models), seed=seed, length_scale=length_scale,
                                time_scale=time_scale, max_depth=max_depth, mean_interarrival_s=mean_interarrival_s,
                                two_model=True, agent_calls_per_turn=agent_calls_per_turn))


def summarize(res) -> dict[str, float]:
    """The per-run metrics of a ``bench.replay.ReplayResult`` (see the module doc). Pure."""
    nan = float("nan")
    scts = list(session_scts(res).values())
    by: dict[str, list] = {}
    for c in res.calls:
        by.setdefault(c.session_id, []).append(c)
    first, returns, handoffs = [], [], []
    for cs in by.values():
        cs.sort(key=lambda c: c.call_index)
        for prev, c in zip([None] + cs[:-1], cs):
            if not c.ok:
                continue
            if prev is None:
                first.append(c.ttft)
            else:
                returns.append(c.ttft)
                if c.model != prev.model:
                    handoffs.append(c.ttft)

    def pct(xs: list[float], q: float) -> float:
        return nearest_rank(xs, q) if xs else nan

    return {
        "sct_p50_s": pct(scts, 50), "sct_p95_s": pct(scts, 95),
        "first_ttft_p50_s": pct(first, 50), "first_ttft_p95_s": pct(first, 95),
        "return_ttft_p50_s": pct(returns, 50), "return_ttft_p95_s": pct(returns, 95),
        "handoff_ttft_p50_s": pct(handoffs, 50),
        "failed_calls": float(sum(1 for c in res.calls if not c.ok)),
        "sessions_complete": float(len(scts)),
    }


SUMMED = ("failed_calls",)  # reported as the total over repetitions, not the median
NO_RATIO = ("failed_calls", "sessions_complete")


def compare(runs: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Rows of the report from per-repetition metrics of ``talaria`` and ``peer``: the median over
    repetitions (the sum for ``SUMMED``) of the repetitions that have a value (NaN = not measured there, e.g.
    no session completed) and the advantage peer / Talaria (> 1 = Talaria better; NaN when a side has no
    value, and for counts). Pure."""
    nan = float("nan")

    def agg(metric: str, side: str) -> float:
        xs = [x for x in (r.get(metric, nan) for r in runs[side]) if x == x]
        return float(sum(xs) if metric in SUMMED else median(xs))

    rows = []
    for metric in runs["talaria"][0]:
        ours, theirs = agg(metric, "talaria"), agg(metric, "peer")
        ok = metric not in NO_RATIO and ours == ours and theirs == theirs and ours > 0
        rows.append({"metric": metric, "talaria": ours, "peer": theirs, "talaria_advantage": theirs / ours if ok else nan})
    return rows


# ------------------------------------------------------------------------------------- memory
@dataclass(slots=True)
class MemSample:
    rss: int = 0
    pss: int = 0
    per_process: dict[str, int] = field(default_factory=dict)  # label -> RSS bytes


def _label(p) -> str:
    """A short name for a process: ``python -m X`` -> X, else the executable's name; plus its pid."""
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001 - gone or not readable
        cmd = []
    name = p.name() if cmd == [] else os.path.basename(cmd[0])
    if "-m" in cmd and cmd.index("-m") + 1 < len(cmd):
        name = cmd[cmd.index("-m") + 1]
        rest = cmd[cmd.index("-m") + 2:]
        if name == "talaria.cli" and rest:
            name = f"talaria {rest[0]}"
    return f"{name}[{p.pid}]"


def tree_memory(roots: list[int]) -> MemSample:
    """Summed RSS and PSS of the processes ``roots`` and all their descendants (each counted once).
    Reads /proc through psutil; a process that exits meanwhile is skipped."""
    import psutil

    seen: dict[int, Any] = {}
    for pid in roots:
        try:
            r = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        for p in [r] + r.children(recursive=True):
            seen.setdefault(p.pid, p)
    s = MemSample()
    for p in seen.values():
        try:
            m = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        s.rss += m.rss
        s.pss += getattr(m, "pss", m.rss)
        s.per_process[_label(p)] = m.rss
    return s


def listener_pid(url: str) -> int | None:
    """The pid of the local process listening on ``url``'s port (None: none here, or not visible)."""
    import psutil

    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    if u.hostname not in ("127.0.0.1", "localhost", "0.0.0.0", "::1"):
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return c.pid
    return None


def stack_root(pid: int) -> int:
    """``pid``, or its parent when that is a ``talaria up`` / ``talaria serve`` supervisor (whose tree holds
    NATS, the engines, the kvstore and telemetry besides the router that listens)."""
    import psutil

    try:
        parent = psutil.Process(pid).parent()
        cmd = parent.cmdline() if parent else []
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return pid
    joined = " ".join(cmd)
    if "talaria" in joined and any(a in ("up", "serve") for a in cmd):
        return parent.pid
    return pid


class MemoryMonitor:
    """Samples ``tree_memory(roots)`` every ``interval`` s on a thread between ``start()`` and ``stop()``;
    keeps the sample with the largest summed RSS (``peak``)."""

    def __init__(self, roots: list[int], interval: float = 1.0):
        self.roots, self.interval = roots, interval
        self.peak: MemSample | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _take(self) -> None:
        s = tree_memory(self.roots)
        if self.peak is None or s.rss > self.peak.rss:
            self.peak = s

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def start(self) -> "MemoryMonitor":
        if self.roots:
            self._take()
            self._thread = threading.Thread(target=self._run, daemon=True, name="mem-monitor")
            self._thread.start()
        return self

    def stop(self) -> MemSample | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._take()
        return self.peak


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# ------------------------------------------------------------------------------------- running
class RoutedSender:
    """The replay's ``send`` for a side whose models live behind different base URLs (one per model)."""

    def __init__(self, urls: dict[str, str], timeout_s: float):
        from bench.replay import HttpSender

        self.by_model = {m: HttpSender(api_base(u), timeout_s=timeout_s) for m, u in urls.items()}

    async def __call__(self, session, call, prompt, sent_at):
        return await self.by_model[call.model](session, call, prompt, sent_at)

    async def aclose(self) -> None:
        for s in self.by_model.values():
            await s.aclose()


@dataclass(slots=True)
class Side:
    name: str
    urls: dict[str, str]  # model (as this side names it) -> OpenAI base URL
    roots: list[int]  # processes whose trees are this side's memory (empty: not measured)


async def run_side(side: Side, w: Workload, a) -> tuple[dict[str, float], dict[str, Any]]:
    """Replay ``w`` against one side while sampling its memory; returns (metrics, extra)."""
    from bench.replay import replay

    sender = RoutedSender(side.urls, a.timeout)
    mon = MemoryMonitor(side.roots, a.mem_interval).start()
    load0 = loadavg()
    try:
        res = await replay(w, sender)
    finally:
        peak = await asyncio.to_thread(mon.stop)
        await sender.aclose()
    m = summarize(res)
    nan = float("nan")
    m["rss_peak_mib"] = peak.rss / 2**20 if peak else nan
    m["pss_peak_mib"] = peak.pss / 2**20 if peak else nan
    extra = {"load_start": load0, "load_end": loadavg(), "wall_s": res.wall_s,
             "errors": sorted({c.error for c in res.calls if c.error})[:5],
             "memory_by_process_mib": {k: v / 2**20 for k, v in (peak.per_process.items() if peak else [])},
             "calls": res.to_json()["calls"]}  # per call: times, status, error, usage (for --json readers)
    return m, extra


async def run_multi_bench(a, say=print) -> dict[str, Any]:
    """Every repetition: the same two-model workload on both sides, the order alternating (module doc)."""
    from bench.peer import effective_config, probe_machine
    from bench.replay import warmup

    peers = parse_peers(a.peer)
    if len(peers) != 2:
        raise SystemExit(f"--multi compares two models: give --peer MODEL=URL twice (got {len(peers)})")
    tal_models = tuple(a.talaria_models or [m for m, _ in peers])
    if len(tal_models) != 2:
        raise SystemExit("--talaria-models wants the two model names Talaria serves (agent and user simulator)")
    to_peer = dict(zip(tal_models, (m for m, _ in peers)))

    def roots(explicit: list[int] | None, urls: list[str]) -> list[int]:
        if explicit:
            return list(explicit)
        pids = [listener_pid(u) for u in urls]
        return sorted({stack_root(p) for p in pids if p is not None})

    sides = [Side("talaria", {m: a.talaria_url for m in tal_models}, roots(a.talaria_pids, [a.talaria_url])),
             Side("peer", dict(peers), roots(a.peer_pids, [u for _, u in peers]))]
    for s in sides:
        say(f"{s.name}: " + ", ".join(f"{m} at {u}" for m, u in s.urls.items())
            + (f"; memory of process trees {s.roots}" if s.roots else "; memory: no local process found (n/a)"))
        for m, u in s.urls.items():
            await warmup(api_base(u), [m])
    runs: dict[str, list[dict[str, float]]] = {"talaria": [], "peer": []}
    extras: dict[str, list[dict[str, Any]]] = {"talaria": [], "peer": []}
    workload_meta = None
    machine: list[dict[str, Any]] = []
    for rep in range(a.repeats):
        machine.append(probe_machine(a))  # both sides idle: the machine's speed for this repetition
        params = dict(sessions=a.sessions, seed=a.seed * 1000 + rep, max_depth=a.max_depth, length_scale=a.length_scale,
                      time_scale=a.time_scale, mean_interarrival_s=a.mean_interarrival, agent_calls_per_turn=a.agent_calls_per_turn)
        order = sides if rep % 2 == 0 else sides[::-1]
        for s in order:
            w = make_workload(tal_models, **params)  # a fresh copy per side: the replay reads it, remap edits it
            if s.name == "peer":
                w.remap_models(to_peer)
            workload_meta = workload_meta or {**w.meta, "calls_first_repetition": w.num_calls}
            m, x = await run_side(s, w, a)
            runs[s.name].append(m)
            extras[s.name].append(x)
        t, p = runs["talaria"][-1], runs["peer"][-1]
        say(f"  repetition {rep + 1}/{a.repeats}: SCT p50 {t['sct_p50_s']:.2f} vs {p['sct_p50_s']:.2f} s, "
            f"failed {t['failed_calls']:.0f} vs {p['failed_calls']:.0f}, RSS {t['rss_peak_mib']:.0f} vs {p['rss_peak_mib']:.0f} MiB, "
            f"load {extras['talaria'][-1]['load_start']:.2f}-{extras['talaria'][-1]['load_end']:.2f} / "
            f"{extras['peer'][-1]['load_start']:.2f}-{extras['peer'][-1]['load_end']:.2f}")
    loads = [v for side in extras.values() for x in side for v in (x["load_start"], x["load_end"])]
    return {"bench": "peer-multi", "repeats": a.repeats, "workload": workload_meta,
            "talaria": {"url": a.talaria_url, "models": list(tal_models), "config": effective_config(a.talaria_config)},
            "peer": {"servers": [{"model": m, "url": u} for m, u in peers]},
            "rows": compare(runs), "runs": runs, "extras": extras,
            "load_1min": {"min": min(loads), "max": max(loads)} if loads else None, "machine": machine}


def render(r: dict[str, Any]) -> str:
    from bench.machine import render_samples
    from bench.peer import render_config

    peers = ", ".join(f"{s['model']} at {s['url']}" for s in r["peer"]["servers"])
    load = r.get("load_1min") or {}
    head = (f"peer bench --multi: Talaria {' + '.join(r['talaria']['models'])} at {r['talaria']['url']} vs one server per "
            f"model ({peers}); two-model agent workload ({r['workload'].get('calls_first_repetition')} calls in repetition 1); "
            f"medians of {r['repeats']} interleaved repetitions (failed_calls: total); advantage = peer / Talaria, > 1 = Talaria better; "
            f"1-minute load {load.get('min', float('nan')):.2f}-{load.get('max', float('nan')):.2f}\n"
            + render_config(r["talaria"].get("config")))
    table = format_table(["metric", "talaria", "peer", "talaria advantage"],
                         [[x["metric"], x["talaria"], x["peer"], x["talaria_advantage"]] for x in r["rows"]])
    mem = []
    for side in ("talaria", "peer"):
        last = r["extras"][side][-1]["memory_by_process_mib"] if r["extras"][side] else {}
        if last:
            mem.append(f"{side} RSS at its peak, last repetition: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(last.items())) + " MiB")
    errs = [f"{side}: {e}" for side in ("talaria", "peer") for x in r["extras"][side] for e in x["errors"]]
    return "\n".join([head, "", table, ""] + mem + [render_samples(r.get("machine", []))]
                     + (["errors: " + "; ".join(sorted(set(errs)))] if errs else []))


def add_args(p) -> None:
    """The ``--multi`` options of ``talaria bench peer`` (the shared ones are in ``bench.peer.add_args``)."""
    g = p.add_argument_group("--multi: two models, one Talaria stack vs one peer server per model")
    g.add_argument("--multi", action="store_true", help="run the two-model comparison instead of the one-model workloads")
    g.add_argument("--peer", action="append", default=[], metavar="MODEL=URL",
                   help="--multi: a peer server and the model it serves (twice: agent model, user-simulator model)")
    g.add_argument("--talaria-models", nargs=2, metavar=("A", "B"),
                   help="--multi: Talaria's names of the two models, in --peer order (default: the peer's names)")
    g.add_argument("--talaria-pids", type=int, nargs="+", help="--multi: root processes of Talaria's memory (default: found from --talaria-url)")
    g.add_argument("--peer-pids", type=int, nargs="+", help="--multi: root processes of the peer's memory (default: found from the --peer URLs)")
    g.add_argument("--max-depth", type=int, default=12, help="--multi: calls per session at most (default 12)")
    g.add_argument("--length-scale", type=float, default=1 / 32, help="--multi: token lengths x this (default 1/32: prompts p50 ~780, p95 ~3,300 tokens)")
    g.add_argument("--time-scale", type=float, default=1.0, help="--multi: gaps and session starts x this (default 1)")
    g.add_argument("--mean-interarrival", type=float, default=2.0, help="--multi: mean seconds between session starts (default 2)")
    g.add_argument("--agent-calls-per-turn", type=float, default=2.0, help="--multi: mean agent calls between user-simulator calls (default 2)")
    g.add_argument("--mem-interval", type=float, default=1.0, help="--multi: seconds between memory samples (default 1)")


def main(a) -> int:
    result = asyncio.run(run_multi_bench(a))
    return emit(result, render(result), a.json)
