"""``talaria bench matrix``: the paper's configurations side by side on one workload (Talaria §5.1-5.3).

For every configuration of ``CONFIGS`` the local stack (``talaria.up.LocalStack``: embedded NATS, kvstore,
two cold-pool engines serving the same three models, router, telemetry service) is brought up, warmed up
the same way (one short call per model), the same workload file is replayed closed-loop through the HTTP
API (``bench/replay.py``), the telemetry sources are read, and the stack is stopped. Then one report
(``bench/report.py``) compares them: ratios are measured side by side in one run, as absolute times on a
shared 2-core machine are noise.

Repetitions (``--repeats N``, default 1; **5** for any claim (issue 12) — one configuration's SCT varied by
±35 % between single runs): every configuration runs N times, interleaved — repetition ``r`` runs the
configurations in the listed order rotated left by ``r`` (A B C D, B C D A, C D A B), so drift in machine
load hits all of them alike — into ``<out>/rep<r>/<configuration>``. The report gives per configuration the
medians over repetitions of SCT p50/p95 and TTFT p50/p95, the median of the *per-repetition* ratios vs
Round-only (each ratio computed within one repetition) with their min-max range, and the per-repetition table
(``bench/report.py``: ``aggregate_repeats``, ``combine_repeats``). The detailed columns and the plots show
each configuration's median repetition (the one with the median SCT p50), not pooled samples. Beside the
Round-only ratios the report gives the ratios vs the best baseline (per repetition and metric, the fastest of
the ``baseline`` rows), their bootstrap CI95 and wins/losses (``bench/stats.py``), and the load average
around every run.

The configurations are config overrides in one table (``CONFIGS``): a dotted path into ``StackConfig``
(``engines[]`` = every engine) and the value. Each row states only what it turns *off* (or changes)
relative to the base stack, whose mechanisms are on by default. A row whose knob is not a field of the
config model in this build is reported as ``not available (knob X missing)`` and not run; it runs as
soon as the field exists (``talaria/config.py`` is read at run time).

The residency regime (``--residency-regime [SECONDS]``): on this testbed a switch is a CPU memcpy of a tiny
model (milliseconds), so where a model is resident never matters and a load-only router ties the session-aware
one. The regime gives every engine a paced host-to-device weight link (``engines[].weight_link_mb_s``,
``regime_link_mb_s``) at which a host-only switch of the largest model takes SECONDS (default 1.5: the paper's
switch seconds against decode steps of milliseconds), replays synthetic sessions spread over the three models
with per-tool gaps, and compares ``REGIME_CONFIGS``: the full router against least-pressure (every mechanism,
a load-only router), with Round-only as the baseline.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from bench import ensure_models
from bench.machine import probe
from bench.stats import loadavg
from bench.workloads import Workload, describe, read_jsonl, write_jsonl

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")


@dataclass(frozen=True)
class MatrixConfig:
    name: str
    overrides: dict[str, Any]
    description: str
    kind: str = "ablation"  # "ablation" (instance-local mechanisms) | "router" (placement policy) | "baseline"


# The matrix (Talaria §5.1): reverse ablations of the instance-local mechanisms, the paper's baselines
# (kind "baseline": every mechanism off, with the full router as the controlled baseline and with the
# least-pressure router as a request-level system would place calls), then router policies. The report's
# "best baseline" is, per repetition and per metric, the best of the "baseline" rows that ran.
OFF = {"engines[].sp": False, "engines[].host_kv": False, "engines[].d2d_staging": False, "engines[].return_hold": False}
CONFIGS: tuple[MatrixConfig, ...] = (
    MatrixConfig("Talaria", {}, "every mechanism on (SP, HKVR, D2D staging), full router (leases + residency cost)"),
    MatrixConfig("no-SP", {"engines[].sp": False}, "session-prefill admission off; HKVR and D2D staging on"),
    MatrixConfig("no-HKVR", {"engines[].host_kv": False}, "host-restorable KV off; SP and D2D staging on"),
    MatrixConfig("H2D-only", {"engines[].d2d_staging": False}, "D2D weight staging off (switches reload from host); SP and HKVR on"),
    MatrixConfig("SP-ungated", {"engines[].sp_gain_check": False},
                 "as Talaria, but SP admits by budget alone (no benefit-vs-harm check, issue 12): shows what the check buys"),
    MatrixConfig("SP-new-sessions", {"engines[].sp_new_sessions": True},
                 "as Talaria, but SP also admits calls without a usable prefix (new sessions) mid-slot, by the same checks (slots/admission.py)"),
    MatrixConfig("no-hold", {"engines[].return_hold": False},
                 "as Talaria, but a slot with nothing to run closes at once instead of holding for returns its leases expect (slots/hold.py)"),
    # issue 16: the other seed systems' mechanisms added to Talaria's, alone and together
    MatrixConfig("+token-deadlines", {"engines[].token_deadlines": True}, "as Talaria, cold pools schedule by per-token deadlines (Aegaeon) instead of rounds"),
    MatrixConfig("+unified-residency", {"engines[].unified_residency": True}, "as Talaria, one device budget for staged layer groups and session KV (JointServe §3)"),
    MatrixConfig("+partial-layers", {"engines[].partial_layers": True}, "as Talaria, streaming hot-swap of later layer groups (JointServe §4.4)"),
    MatrixConfig("+JointServe+Aegaeon", {"engines[].token_deadlines": True, "engines[].unified_residency": True, "engines[].partial_layers": True},
                 "as Talaria with all three issue-16 mechanisms"),
    MatrixConfig("Round-only", dict(OFF), "SP, HKVR and D2D staging all off, full session-aware router: the controlled all-off baseline", "baseline"),
    MatrixConfig("Round-only+LP", {**OFF, "router.placement.policy": "least-pressure"},
                 "SP, HKVR and D2D staging all off, each call to the least-loaded instance: a request-level system (the paper's baseline)", "baseline"),
    MatrixConfig("least-pressure", {"router.placement.policy": "least-pressure"}, "engines as Talaria; each call to the least-loaded instance", "router"),
    MatrixConfig("session-sticky", {"router.placement.policy": "session-sticky"}, "engines as Talaria; a session pinned to its first instance", "router"),
)
# router policy "full" is the Talaria row (same engines, policy "full"; fixed lease tau by default).
# Issue 14 lease rows (kind "lease"): run only when named (--configs), e.g. on the per-tool workload:
#   talaria bench matrix --tool-gaps --configs lease-adaptive lease-fixed-0.5 lease-fixed-1 lease-fixed-2 lease-fixed-5 no-leases
CONFIGS += tuple(
    MatrixConfig(f"lease-fixed-{t:g}", {"router.placement.lease_policy": "fixed", "router.placement.lease_ttl_s": t},
                 f"as Talaria, but the paper's fixed lease tau = {t:g} s for every call", "lease")
    for t in (0.5, 1.0, 2.0, 5.0)
) + (MatrixConfig("lease-adaptive", {"router.placement.lease_policy": "adaptive"},
                  "as Talaria, but adaptive leases: windows from the predicted return gap per (model, tool), lease arithmetic on", "lease"),
    MatrixConfig("lease-adaptive-no-arith", {"router.placement.lease_policy": "adaptive", "router.placement.lease_arithmetic": False},
                  "as lease-adaptive, but every lease installed and honoured (no value-vs-harm check)", "lease"),
    MatrixConfig("no-leases", {"router.placement.lease_ttl_s": 0.0},
                  "as Talaria, but no leases at all (tau 0): the reference that shows what any lease buys", "lease"),
    MatrixConfig("lease-always", {"router.placement.lease_arithmetic": False},
                 "as Talaria, but a valid lease is honoured at the return whatever it delays the call (Algorithm 1 as published; issue 12 item 3 checks it)", "lease"),
    MatrixConfig("no-slot-wait", {"router.placement.slot_wait": False},
                 "as Talaria, but the router prices a cold instance at the bare switch cost, not adding the predicted wait for the model's slot (issue 12)", "lease"),
    MatrixConfig("no-imposed", {"router.placement.charge_imposed": False},
                 "as Talaria, but Eq. 1 prices only the call's own latency, not the delay it imposes on the batch it joins (issue 12)", "lease"),
    MatrixConfig("queue-learned", {"router.placement.queue_learned": True},
                 "as Talaria, but Eq. 1's queue term is scaled per instance by the measured / predicted engine queue of the calls placed there (issue 12)", "lease"),
    MatrixConfig("lease-unit-0.1", {"router.placement.admission_unit": 0.1},
                 "as Talaria, but a live lease charges its instance a tenth of a mean call of queue instead of a whole one (issue 12: the lease charge dominated Eq. 1's queue term)", "lease"),
    MatrixConfig("imposed-prefill", {"router.placement.imposed_prefill": True},
                 "as Talaria, but the imposed-delay term also charges the call's prefill stall of the batch it joins (issue 12)", "lease"),
    MatrixConfig("hold-learned-gap", {"router.placement.retention_learned_gap": True},
                 "as Talaria, but a fixed lease's retention hint carries the learned return-gap distribution, so the slot hold weighs each return by it (issue 12)", "lease"),
    MatrixConfig("write-back", {"engines[].host_kv_write_policy": "back"},
                 "as Talaria, but the host KV store is written only when pages leave the device (write-back), not when every session call ends (issue 12)", "lease"),
    MatrixConfig("no-rotation-eq2", {"router.placement.rotation_eq2": False},
                 "as Talaria, but a call that adds its model to a cold instance's rotation is priced as a plain switch, not gated by Eq. 2", "lease"),
    MatrixConfig("no-prefetch", {"router.placement.intent_prefetch": False},
                 "as Talaria, but no intent prefetch (the next model is not opened ahead of a predicted model switch)", "lease"),
)
QUICK_CONFIGS = ("Talaria", "Round-only")
# The residency regime (``--residency-regime``): the full router against least-pressure (same engines, a
# load-only router), with Round-only as the usual baseline.
REGIME_CONFIGS = ("Talaria", "least-pressure", "Round-only")  # --configs adds e.g. no-rotation-eq2
REGIME_SWITCH_S = 1.5  # default host-only switch seconds of the largest model (the paper's seconds against ms steps)


def regime_link_mb_s(models_dir: Path, models: list[str], switch_s: float, dtype: str = "auto", device: str = "cpu") -> float:
    """The weight-link bandwidth (MB/s, 10^6 bytes) at which a host-only switch to the largest of ``models``
    moves its bank image in ``switch_s`` seconds: the image bytes the engine's weight bank holds (``dtype`` as
    the engines resolve it on ``device``) over ``switch_s``. The link is all the engines are given; they measure
    the switch costs it causes, and the router learns them from their heartbeats as always."""
    from services.engine.model.loader import engine_dtype
    from services.engine.substrate.bank import WeightBank

    if not switch_s > 0:
        raise ValueError("the regime's switch seconds must be > 0")
    bank = WeightBank(pin=False)
    dt = engine_dtype(dtype, device)
    return max(bank.load(m, models_dir / m, dt).nbytes for m in models) / switch_s / 1e6


# ----------------------------------------------------------------------------- knobs / overrides
def knob_missing(path: str, value: Any) -> str | None:
    """None if ``path`` names a field of ``StackConfig`` that accepts ``value``; else the reason."""
    from talaria.config import StackConfig

    model: Any = StackConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        name = part.removesuffix("[]")
        fields = getattr(model, "model_fields", {})
        if name not in fields:
            return f"knob {path} missing"
        ann = fields[name].annotation
        if part.endswith("[]"):
            ann = get_args(ann)[0]
        if i < len(parts) - 1:
            model = ann
        elif get_origin(ann) is Literal and value not in get_args(ann):
            return f"knob {path} has no value {value!r} (allowed: {', '.join(map(str, get_args(ann)))})"
    return None


def availability(cfg: MatrixConfig) -> str | None:
    reasons = [r for p, v in cfg.overrides.items() if (r := knob_missing(p, v))]
    return "; ".join(reasons) or None


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for path, value in overrides.items():
        parts = path.split(".")
        nodes = [out]
        for part in parts[:-1]:
            nxt = []
            for n in nodes:
                if part.endswith("[]"):
                    nxt += n.setdefault(part[:-2], [])
                else:
                    nxt.append(n.setdefault(part, {}))
            nodes = nxt
        last = parts[-1]
        for n in nodes:
            if last.endswith("[]"):
                raise ValueError(f"override path {path} cannot end in []")
            n[last] = value
    return out


# Set on every engine of every configuration when the build's EngineConfig has the field: the round/slot
# scheduler is the common substrate of Talaria and its ablations ("the otherwise identical round scheduler").
BASE_ENGINE_KNOBS = ("slot_scheduler",)


def mechanisms() -> dict[str, str]:
    """Which mechanism knobs this build's config has (reported with the Talaria row)."""
    paths = [f"engines[].{k}" for k in BASE_ENGINE_KNOBS] + list(OFF)
    return {p.split(".")[-1]: ("knob present" if knob_missing(p, False) is None else "knob missing") for p in paths}


def base_stack(models_dir: Path, records_file: Path | None, *, kv_cache_mb: int = 64,
               engines: list[dict[str, Any]] | None = None, weight_link_mb_s: float | None = None) -> dict[str, Any]:
    """Two cold-pool engines, each serving all of ``MODELS`` (real placement choices, real switches); or, with
    ``engines`` (the ``engines`` of a ``--stack`` config file), those engines, each with the mechanism knobs on.
    ``weight_link_mb_s``: every engine's weight copies from the host bank cross a link of that bandwidth (the
    residency regime)."""
    from talaria.config import TelemetryConfig

    from talaria.config import EngineConfig

    extra: dict[str, Any] = {k: True for k in BASE_ENGINE_KNOBS if k in EngineConfig.model_fields}
    if weight_link_mb_s is not None:
        extra["weight_link_mb_s"] = weight_link_mb_s
    eng = lambda i: {  # noqa: E731
        "id": f"engine-{i}", "pool": "cold", "models": list(MODELS), "device": "cpu", "kv_cache_mb": kv_cache_mb,
        "torch_threads": 1, "heartbeat_period_s": 0.25, **extra,
    }
    cfg: dict[str, Any] = {
        "namespace": f"bm{uuid.uuid4().hex[:8]}",
        "models_dir": str(models_dir),
        "synthesize_models": False,
        # every placement with its Eq. 1 breakdown, kept for the run's decisions.json (a few hundred bytes each)
        "router": {"port": 0, "placement": {"decisions_kept": 20000}},
        "engines": [eng(0), eng(1)] if engines is None else [{"heartbeat_period_s": 0.25, **e, **extra} for e in engines],
    }
    tf = TelemetryConfig.model_fields
    tel: dict[str, Any] = {}
    if "port" in tf:
        tel["port"] = 0
    if "traces_dir" in tf:
        tel["traces_dir"] = None  # no span files (same for every configuration)
    if records_file is not None and "records_file" in tf:
        tel["records_file"] = str(records_file)
    if tel:
        cfg["telemetry"] = tel
    return cfg


async def _router_decisions(client, api: str, since_unix: float) -> list[dict[str, Any]]:
    """The replay's placement decisions (``GET /router/decisions``, newest last) with their cost breakdowns,
    the warm-up's left out; empty when this build's router does not serve them."""
    r = await client.get(f"{api}/router/decisions")
    if r.status_code != 200:
        return []
    return [d for d in r.json().get("decisions", []) if d.get("at_unix", 0.0) >= since_unix]


# ------------------------------------------------------------------------------ engine snapshots
class HeartbeatListener:
    """Engine heartbeats straight from NATS: the switch records embedded in ``InstanceSnapshot``s."""

    def __init__(self) -> None:
        self.nc = None
        self.switches: dict[tuple, dict[str, Any]] = {}
        self.instances: dict[str, dict[str, Any]] = {}

    async def start(self, url: str, namespace: str) -> "HeartbeatListener":
        import nats
        from google.protobuf.json_format import MessageToDict

        from talaria.subjects import Subjects
        from talaria.v1 import engine_pb2 as pb

        async def on_msg(msg) -> None:
            snap = pb.InstanceSnapshot()
            try:
                snap.ParseFromString(msg.data)
            except Exception:  # noqa: BLE001
                return
            self.instances[snap.instance_id] = {"pool": snap.pool, "num_switches": getattr(snap, "num_switches", 0)}
            for rec in getattr(snap, "switches", ()):
                d = MessageToDict(rec, preserving_proto_field_name=True)
                d.setdefault("instance_id", snap.instance_id)
                self.switches[(snap.instance_id, snap.epoch, int(d.get("seq", 0)), float(d.get("started_unix", 0)))] = d

        self.nc = await nats.connect(url, name="bench-matrix")
        await self.nc.subscribe(Subjects(namespace).all_heartbeats(), cb=on_msg)
        return self

    def window(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [d for d in self.switches.values() if t0 <= float(d.get("started_unix", 0)) <= t1]

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.drain()


def _kvstore_stats(stack) -> dict[str, Any] | None:
    kvs = stack.cfg.kvstore
    if not kvs.enabled or not kvs.port or "kvstore" not in stack.children:
        return None
    try:
        from google.protobuf.json_format import MessageToDict

        from services.kvstore.client import KvStoreClient

        token = stack.secret_env.get("TALARIA__KVSTORE__AUTH_TOKEN") or kvs.auth_token  # issue 17: the store wants it
        c = KvStoreClient(f"{kvs.host}:{kvs.port}", timeout_s=2.0, auth_token=token)
        try:
            return {k: float(v) for k, v in MessageToDict(c.stats(), preserving_proto_field_name=True).items() if isinstance(v, (int, float, str)) and str(v).replace(".", "", 1).isdigit()}
        finally:
            c.close()
    except Exception:  # noqa: BLE001 - a missing source is reported as n/a
        return None


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system, all threads) used so far by the live processes of process group ``pgid``
    (a ``LocalStack`` child runs in its own session, so its group is the service and anything it started).
    Read from ``/proc/<pid>/stat``; 0.0 where /proc is missing. Work, not wall time: on a shared machine it
    hardly depends on how much CPU the other tenants leave (issue 12: a claim measured under load)."""
    import os

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for d in Path("/proc").glob("[0-9]*"):
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(f[2]) == pgid:  # fields after the command: state ppid pgrp ... utime(12) stime(13)
            total += int(f[11]) + int(f[12])
    return total / tick


def stack_cpu_seconds(stack) -> dict[str, float]:
    """``group_cpu_seconds`` of every child of a ``LocalStack`` (engines, kvstore, router, telemetry, NATS)."""
    return {name: group_cpu_seconds(c.proc.pid) for name, c in stack.children.items()}


def _read_records(path: Path, t0: float, t1: float) -> list[dict[str, Any]] | None:
    if not path.exists():
        return None
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if t0 <= float(r.get("recv_unix", 0) or 0) <= t1:
            out.append(r)
    return out


# ----------------------------------------------------------------------------------- one config
async def run_config(mc: MatrixConfig, workload: Workload, models_dir: Path, out: Path, *, progress: bool, say, label: str = "",
                     engines: list[dict[str, Any]] | None = None, weight_link_mb_s: float | None = None,
                     probe_machine: bool = True) -> dict[str, Any]:
    import httpx

    from bench.replay import replay_http, warmup
    from bench.report import summarize_run
    from talaria.config import parse_config
    from talaria.up import LocalStack

    cdir = out / mc.name.replace(": ", "-").replace(" ", "_")
    cdir.mkdir(parents=True, exist_ok=True)
    records = cdir / "records.jsonl"
    records.unlink(missing_ok=True)
    cfg_dict = apply_overrides(base_stack(models_dir, records, engines=engines, weight_link_mb_s=weight_link_mb_s), mc.overrides)
    (cdir / "stack.json").write_text(json.dumps(cfg_dict, indent=1))
    stack = LocalStack(parse_config(cfg_dict), say=lambda _m: None, quiet=True)
    t_up = time.monotonic()
    try:
        await asyncio.to_thread(stack.start)
    except Exception as e:  # noqa: BLE001
        await asyncio.to_thread(stack.stop)
        tails = {n: c.log[-15:] for n, c in stack.children.items()}
        return {"status": f"failed to start: {e}", "logs": tails}
    listener = HeartbeatListener()
    try:
        api = stack.api
        n_eng = len(cfg_dict["engines"])
        async with httpx.AsyncClient(timeout=10) as client:
            deadline = time.monotonic() + 120
            while True:
                h = (await client.get(f"{api}/health")).json()
                if sum(1 for v in h["instances"].values() if v["healthy"]) >= n_eng:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("engines did not report healthy within 120 s")
                await asyncio.sleep(0.1)
            up_s = time.monotonic() - t_up
            await listener.start(stack.nats_url, stack.cfg.namespace)
            await warmup(api, workload.models())
            await asyncio.sleep(0.6)  # let the warmup's hooks and heartbeats land before "before"
            before = (await client.get(f"{api}/health")).json()
            kv_before = _kvstore_stats(stack)
            machine = probe() if probe_machine else {}  # the stack idle: the machine's speed for this run (bench/machine.py)
            load_before = loadavg()
            cpu_before = stack_cpu_seconds(stack)
            w0 = time.time()
            res = await replay_http(workload, api, desc=mc.name, progress=progress)
            w1 = time.time()
            load_after = loadavg()
            cpu = {k: v - cpu_before.get(k, 0.0) for k, v in stack_cpu_seconds(stack).items()}
            await asyncio.sleep(1.0)  # the last heartbeats, hooks and records
            after = (await client.get(f"{api}/health")).json()
            decisions = await _router_decisions(client, api, w0)
        kv_after = _kvstore_stats(stack)
        switches = listener.window(w0, w1)
        recs = _read_records(records, w0, w1 + 1.0)
        note = "" if recs is not None else ("telemetry service not running" if stack.telemetry_url is None else "no records file (telemetry.records_file missing in this build)")
        telemetry = {
            "router_before": before, "router_after": after, "switches": switches,
            "instances": sum(1 for e in cfg_dict["engines"] if e.get("pool") == "cold"),
            "kvstore_before": kv_before, "kvstore_after": kv_after, "records": recs, "records_note": note,
        }
        (cdir / "replay.json").write_text(json.dumps(res.to_json()))
        (cdir / "decisions.json").write_text(json.dumps(decisions))
        (cdir / "telemetry.json").write_text(json.dumps({k: v for k, v in telemetry.items() if k != "records"}, indent=1, default=str))
        summary = summarize_run(res, telemetry)
        summary["stack_up_s"] = up_s
        summary["loadavg_before"], summary["loadavg_after"] = load_before, load_after  # beside every number (issue 12)
        summary["machine"] = machine
        summary["cpu_s"] = cpu  # CPU seconds each service used during the replay (work, hardly load-dependent)
        eng_ids = {e["id"] for e in cfg_dict["engines"]}
        summary["engine_cpu_s"] = sum(v for k, v in cpu.items() if k in eng_ids)
        load = f"{load_before[0]:.2f}->{load_after[0]:.2f}" if load_before and load_after else "n/a"
        say(f"{label}{mc.name}: SCT p50 {summary['sct_p50_s']:.2f}s p95 {summary['sct_p95_s']:.2f}s, TTFT p50 {summary['ttft_p50_s']:.2f}s, "
            f"{summary['calls_failed']} failed, replay {res.wall_s:.0f}s, engine CPU {summary['engine_cpu_s']:.1f}s, load 1m {load}"
            + (f", machine {machine['gemm_gflops']:.0f} GFLOP/s {machine['read_gb_s']:.1f} GB/s" if machine else ""))
        return {"status": "ok", "summary": summary}
    except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
        tails = {n: c.log[-15:] for n, c in stack.children.items()}
        return {"status": f"failed: {type(e).__name__}: {e}", "logs": tails}
    finally:
        await listener.stop()
        await asyncio.to_thread(stack.stop)


# ------------------------------------------------------------------------------------------ run
def default_workload(quick: bool, seed: int = 0) -> Workload:
    from bench.workloads.synthetic import SynthParams, generate

    if quick:
        return generate(SynthParams(sessions=3, seed=seed, length_scale=1 / 128, max_depth=3, mean_interarrival_s=0.5, max_output=8))
    return generate(SynthParams(sessions=10, seed=seed, length_scale=1 / 32, max_depth=20))


def interleaved_orders(names: list[str], repeats: int) -> list[list[str]]:
    """The run order of each repetition: repetition ``r`` (0-based) is ``names`` rotated left by ``r``
    (A B C D, B C D A, C D A B, ...), so every configuration changes position and slow drift in machine
    load is spread over all configurations instead of always hitting the one that runs last."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] if n else [] for r in range(repeats)]


def run_matrix(
    out: Path,
    *,
    quick: bool = False,
    names: list[str] | None = None,
    workload: Workload | None = None,
    models_dir: Path | None = None,
    progress: bool = True,
    command: str = "",
    repeats: int = 1,
    say=print,
    stack: Path | None = None,
    residency_switch_s: float | None = None,
    probe_machine: bool = True,
) -> list[dict[str, Any]]:
    """Run the matrix; ``repeats`` > 1 runs every configuration that many times, interleaved
    (``interleaved_orders``), into ``<out>/rep<i>/<configuration>``, and reports medians over repetitions
    (``bench.report.combine_repeats``). With ``repeats`` = 1 the output is laid out as before
    (``<out>/<configuration>``). ``stack``: a stack config file whose engines and models directory replace the
    two synthesized cold engines (its missing models are imported from their packages, never synthesized).
    ``residency_switch_s``: the residency regime -- every engine gets a weight link (``regime_link_mb_s``) at
    which a host-only switch of the largest model takes that many seconds, and the configurations default to
    ``REGIME_CONFIGS``."""
    from bench.report import (ablations_table, baseline_names, combine_repeats, lease_comparison, lease_table, matrix_table, repeats_table,
                              write_matrix_report)

    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    out.mkdir(parents=True, exist_ok=True)
    engines = None
    if stack is not None:
        from talaria.config import load_config
        from talaria.models.importer import import_known

        scfg = load_config(str(stack))
        engines = [e.model_dump(include={"id", "pool", "models", "device", "dtype", "kv_cache_mb", "torch_threads"}) for e in scfg.engines]
        models_dir = Path(models_dir or scfg.models_dir)
        needed = sorted({m for e in scfg.engines for m in e.models if not (models_dir / m / "config.json").exists()})
        left = import_known(needed, models_dir, say)
        if left:
            raise ValueError(f"{stack}: models {left} are neither under {models_dir} nor importable from a package")
    else:
        models_dir = ensure_models(models_dir, list(MODELS), say=say)
    link_mb_s = None
    if residency_switch_s is not None:
        models = sorted({m for e in engines for m in e["models"]}) if engines is not None else list(MODELS)
        dtypes = {e.get("dtype", "auto") for e in engines} if engines is not None else {"auto"}
        link_mb_s = min(regime_link_mb_s(models_dir, models, residency_switch_s, d) for d in dtypes)
        say(f"residency regime: every engine's weight link {link_mb_s:.2f} MB/s (a host-only switch of the largest model "
            f"~{residency_switch_s:g} s; the engines measure it, the router learns it)")
    w = workload if workload is not None else default_workload(quick)
    wpath = write_jsonl(w, out / "workload.jsonl")
    w = read_jsonl(wpath)  # every configuration replays exactly this file
    desc = describe(w)
    say(f"workload: {desc['sessions']} sessions, {desc['calls']} calls, models {desc['models']}, "
        f"meta {json.dumps(w.meta)} -> {wpath}")
    default = list(REGIME_CONFIGS) if residency_switch_s is not None else [c.name for c in CONFIGS if c.kind != "lease"]
    wanted = names or (list(QUICK_CONFIGS) if quick else default)
    unknown = set(wanted) - {c.name for c in CONFIGS}
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; known: {[c.name for c in CONFIGS]}")
    by = {c.name: c for c in CONFIGS}
    selected = [c for c in CONFIGS if c.name in wanted]  # table order
    base_rows: dict[str, dict[str, Any]] = {}
    runnable: list[str] = []
    for mc in selected:
        row: dict[str, Any] = {"name": mc.name, "kind": mc.kind, "overrides": mc.overrides, "description": mc.description}
        why = availability(mc)
        if why:
            row["status"] = f"not available ({why})"
            say(f"{mc.name}: {row['status']}")
        else:
            if mc.name == "Talaria":
                row["description"] += f" — mechanism knobs in this build: {mechanisms()}"
            runnable.append(mc.name)
        base_rows[mc.name] = row
    orders = interleaved_orders(runnable, repeats)
    reps: list[list[dict[str, Any]]] = []
    t0 = time.monotonic()
    load_start = loadavg()
    for ri, order in enumerate(orders):
        rep_out = out if repeats == 1 else out / f"rep{ri + 1}"
        label = "" if repeats == 1 else f"[rep {ri + 1}/{repeats}] "
        if repeats > 1:
            say(f"repetition {ri + 1}/{repeats}: order {' '.join(order)} (elapsed {time.monotonic() - t0:.0f}s)")
        done: dict[str, dict[str, Any]] = {}
        for pos, name in enumerate(order):
            row = dict(base_rows[name], position=pos + 1)
            say(f"{label}{name}: starting the stack ...")
            row.update(asyncio.run(run_config(by[name], w, models_dir, rep_out, progress=progress, say=say, label=label, engines=engines,
                                                weight_link_mb_s=link_mb_s, probe_machine=probe_machine)))
            if row.get("status") != "ok":
                say(f"{label}{name}: {row['status']}")
            done[name] = row
        # table order; configurations that are not available appear in every repetition with their reason
        reps.append([done.get(c.name) or dict(base_rows[c.name]) for c in selected])
    meta = {
        "command": command,
        "workload_file": str(wpath),
        "workload_desc": json.dumps({k: v for k, v in desc.items()}, default=str) + " meta " + json.dumps(w.meta),
        "matrix_wall_s": time.monotonic() - t0,
        "quick": quick,
        "repeats": repeats,
        "orders": orders,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "weight_link_mb_s": link_mb_s,  # the residency regime's paced weight link (None: not paced)
    }
    if repeats == 1:
        rows = reps[0] if reps else [dict(base_rows[c.name]) for c in selected]
        for r in rows:
            r.pop("position", None)
        report = write_matrix_report(out, rows, meta)
    else:
        rows, agg = combine_repeats(reps)
        report = write_matrix_report(out, rows, meta, repeats=reps)
    say("")
    if repeats > 1:
        say(f"medians over {repeats} interleaved repetitions; ratios: median of per-repetition ratios [min-max], "
            f"CI95 = hierarchical bootstrap, W/L = repetitions below/above 1; load 1m {meta['loadavg_start']} -> {meta['loadavg_end']}")
        say(repeats_table(agg))
        abl = ablations_table(agg, baseline_names(rows))
        if abl:
            say("\neach configuration against Talaria (paired per repetition; CI95, W/L, verdict per quantile)")
            say(abl)
        lt = lease_table(lease_comparison(reps))
        if lt:
            say("\nlease policies against the best fixed tau (issue 14; paired per repetition, geometric means, 95 % interval)")
            say(lt)
        say("\ndetail: median repetition per configuration")
    say(matrix_table(rows))
    say(f"\nreport: {report} (matrix took {meta['matrix_wall_s']:.0f}s)")
    return rows


def main(args) -> int:
    from bench.replay import load_workload

    out = Path(args.out or f".talaria/bench/matrix-{time.strftime('%Y%m%d-%H%M%S')}")
    workload = None
    regime = getattr(args, "residency_regime", None)
    if regime is not None and not (args.workload or args.mooncake or args.miniswe):
        args.tool_gaps = True  # the regime's synthetic sessions carry their tools' gaps
    if args.workload or args.mooncake or args.miniswe or args.tool_gaps or args.two_model or args.sessions is not None:
        if args.sessions is None:
            args.sessions = 10
        workload = load_workload(args)
    rows = run_matrix(
        out, quick=args.quick, names=args.configs, workload=workload, models_dir=Path(args.models_dir) if args.models_dir else None,
        progress=not args.no_progress, command=" ".join(shlex.quote(a) for a in sys.argv), repeats=args.repeats,
        stack=Path(args.stack) if args.stack else None, residency_switch_s=regime, probe_machine=not args.no_probe,
    )
    ran = [r for r in rows if r.get("status") == "ok"]
    failed = sum(r["aggregate"]["calls_failed_total"] if "aggregate" in r else r["summary"]["calls_failed"] for r in ran)
    return 0 if ran and failed == 0 and not any(r.get("failed_repetitions") for r in ran) else 1


def add_args(p) -> None:
    from bench.replay import add_workload_args

    p.add_argument("--quick", action="store_true", help=f"smoke check: 3 tiny sessions, configurations {', '.join(QUICK_CONFIGS)}")
    p.add_argument("--configs", nargs="+", metavar="NAME", help=f"subset of: {', '.join(repr(c.name) for c in CONFIGS)}")
    p.add_argument("--out", help="output folder (default .talaria/bench/matrix-<time>)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every configuration N times, interleaved (the order rotates each repetition), and report "
                        "medians, the median [min-max] of per-repetition ratios vs Round-only and vs the best baseline, "
                        "bootstrap CI95 and wins/losses (default 1; 5 for any claim: single runs vary by tens of percent "
                        "on a shared machine)")
    p.add_argument("--models-dir", help="checkpoints (default .talaria/bench-models, synthesized if missing)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-probe", action="store_true", help="skip the machine-speed probe before each run (bench/machine.py: "
                   "bf16 GEMM and streaming-read rates, ~0.5 s with the stack idle, reported beside the run's numbers)")
    p.add_argument("--stack", metavar="FILE", help="a stack config whose engines (and models_dir) replace the two synthesized "
                   "cold engines, e.g. deploy/config/two-real-models.yaml with --two-model --models smollm2-135m-instruct gemma3-270m")
    p.add_argument("--residency-regime", nargs="?", type=float, const=REGIME_SWITCH_S, default=None, metavar="SECONDS",
                   help="the regime where model residency matters: every engine's weight copies from the host bank cross a "
                        f"paced link (engines[].weight_link_mb_s) at which a host-only switch of the largest model takes SECONDS "
                        f"(default {REGIME_SWITCH_S:g}); the synthetic workload gets per-tool gaps; configurations default to "
                        f"{', '.join(REGIME_CONFIGS)} (bench/README.md, Residency regime)")
    add_workload_args(p)
