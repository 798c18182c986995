"""``talaria sim``: run | paper | router-sweep | scale | pools | leases | catalog | validate (see sim/README.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_TP8 = "profiles/paper-tp8.yaml"
DEFAULT_TP4 = "profiles/paper-tp4-router.yaml"


def paper_output_scale() -> float:
    from .paper import OUTPUT_SCALE

    return OUTPUT_SCALE


_OPEN_HELP = ("the router testbed's switch from host (its H2D phase), seconds, or 'profile' for the profile's own "
              "bandwidth-scaled value; not published: the default is the paper's measured TP=8 H2D switch (sim/README.md)")


def _open_s(value: str) -> float | None:
    """``--router-open-s``: seconds, or "profile" (None: the profile's own switch from host)."""
    return None if value.strip().lower() in ("profile", "none") else float(value)


def _run(args) -> int:
    from bench.workloads import read_jsonl
    from bench.workloads.mooncake import MooncakeParams, import_mooncake

    from . import paper, report, workload
    from .profile import load

    prof = load(args.profile)
    if args.workload:
        w = read_jsonl(args.workload)
    elif args.mooncake:
        w = import_mooncake(MooncakeParams(path=args.mooncake, sessions=args.sessions, models=tuple(args.models.split(",")), seed=args.seed,
                                           length_scale=1.0, time_scale=1.0, max_prompt=131072, max_output=4096, vocab=32000))  # full scale
    else:
        w = workload.full_scale(args.sessions, args.seed, args.models.split(","))
    rows = paper.replay_summaries(prof, w, args.configs.split(","), args.instances)
    out = Path(args.out)
    report.write(out, rows, {"profile": args.profile, "workload": args.workload or args.mooncake or "synthetic full scale"}, "Simulated run")
    if args.json:
        print(json.dumps([report.lean(s) for s in rows], indent=2, default=str))
    else:
        print(report.table(rows))
    return 0


def _paper(args) -> int:
    from .paper import run_paper

    s = run_paper(Path(args.out), tp8_profile=args.profile, router_profile=args.router_profile, seed=args.seed,
                  configs=args.configs.split(",") if args.configs else None, say=lambda m: print(m, file=sys.stderr),
                  output_scale=args.output_scale, start_gap_s=args.start_gap, park=args.park, taus=tuple(float(t) for t in args.taus.split(",")) if args.taus else (),
                  router_start_gap_s=args.router_start_gap, router_open_h2d_s=_open_s(args.router_open_s), router_seeds=args.router_seeds)
    print(json.dumps(s if args.json else {k: s[k] for k in ("tp8", "router", "router_repetitions") if k in s}, indent=2, default=str))
    return 0


def _router_sweep(args) -> int:
    from .paper import router_sweep
    from .profile import load

    rows = router_sweep(load(args.router_profile), args.routers.split(), [float(g) for g in args.gaps.split(",")], args.seeds,
                        say=lambda m: print(m, file=sys.stderr), open_h2d_s=_open_s(args.router_open_s))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "router_sweep.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2) if args.json else f"{len(rows)} rows -> {Path(args.out) / 'router_sweep.json'}")
    return 0


def _scale(args) -> int:
    from .scale import run_scale

    s = run_scale(Path(args.out), profile=args.profile, instances=args.instances, models=args.models, sessions=args.sessions,
                  seed=args.seed, say=lambda m: print(m, file=sys.stderr))
    print(json.dumps(s, indent=2, default=str))
    return 0


def _pools(args) -> int:
    from .scale import run_pools

    rows = run_pools(Path(args.out), profile=args.profile, instances=args.instances, models=args.models, sessions=args.sessions,
                     seed=args.seed, rate_per_s=args.rate, say=lambda m: print(m, file=sys.stderr))
    print(json.dumps(rows, indent=2, default=str))
    return 0


def _catalog(args) -> int:
    from .scale import run_catalog

    rows = run_catalog(Path(args.out), profile=args.profile, instances=args.instances, catalogs=tuple(int(x) for x in args.catalogs.split(",")),
                       sessions=args.sessions, seed=args.seed, rate_per_s=args.rate, per_model=args.per_model,
                       hot_fraction=args.hot_fraction, gpus_per_instance=args.gpus_per_instance, config=args.config,
                       say=lambda m: print(m, file=sys.stderr))
    print(json.dumps(rows, indent=2, default=str))
    return 0


def _leases(args) -> int:
    from .leases import run_leases, table

    s = run_leases(Path(args.out), profile=args.profile, workloads=tuple(args.workloads.split(",")), seeds=args.seeds, seed=args.seed,
                   sessions=args.sessions, max_depth=args.max_depth, taus=tuple(float(t) for t in args.taus.split(",")), start_gap_s=args.start_gap,
                   miniswe_path=args.miniswe, with_no_arith=args.no_arith, with_decay=args.decay,
                   no_lease_row=not args.no_reference, say=lambda m: print(m, file=sys.stderr))
    print(json.dumps(s, indent=2, default=str) if args.json else table(s))
    return 0


def add_cli(sub) -> None:
    from .paper import ROUTER_OPEN_H2D_S, ROUTER_SEEDS, ROUTER_START_GAP_S

    p = sub.add_parser("sim", help="discrete-event simulator: the real policies under a virtual clock")
    ps = p.add_subparsers(dest="sim_cmd", required=True)
    r = ps.add_parser("run", help="simulate a replay workload on N cold instances, configurations side by side")
    r.add_argument("--profile", default=DEFAULT_TP8)
    r.add_argument("--workload", help="talaria-replay/1 JSONL")
    r.add_argument("--mooncake", help="a Mooncake trace file (bench/workloads/mooncake.py; data/traces/README.md says where to get it)")
    r.add_argument("--sessions", type=int, default=10, help="synthetic sessions (full scale) when no workload is given")
    r.add_argument("--models", default="qwen3-235b,glm5-nvfp4,qwen3.5-122b-a10b")
    r.add_argument("--instances", type=int, default=1)
    r.add_argument("--configs", default="Talaria,Round-only", help="comma list of Talaria,no-SP,no-HKVR,H2D-only,no-hold,Round-only (and SP-new-sessions, token-deadlines, token-deadlines-no-HKVR, partial-layers, partial-layers-H2D-only, partial-layers+token-deadlines, unified-residency, unified-residency+partial-layers, JointServe+Aegaeon)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default="sim-out")
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=_run)
    pp = ps.add_parser("paper", help="reproduce the paper's TP=8 replay and router experiment; writes OUT/summary.json")
    pp.add_argument("--out", required=True)
    pp.add_argument("--profile", default=DEFAULT_TP8)
    pp.add_argument("--router-profile", default=DEFAULT_TP4)
    pp.add_argument("--configs", help="subset of the TP=8 configurations (default all six)")
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--output-scale", type=float, default=paper_output_scale(), help="completion lengths x this (not published; see README)")
    pp.add_argument("--start-gap", type=float, default=26.0, help="seconds between session starts of the TP=8 replay (not published)")
    pp.add_argument("--router-start-gap", type=float, default=ROUTER_START_GAP_S,
                    help="seconds between session starts of the router testbed ('high load', not published; the default is calibrated, sim/README.md)")
    pp.add_argument("--router-open-s", default=str(ROUTER_OPEN_H2D_S), help=_OPEN_HELP)
    pp.add_argument("--taus", default="0,0.5,1,2,5", help="tau sweep (§5.4); empty to skip")
    pp.add_argument("--router-seeds", type=int, default=ROUTER_SEEDS,
                    help="repetitions of the router experiment: task orders 0..N-1 beside least-pressure, medians and paired "
                    "per-seed ratios in summary.json 'router_repetitions' (0 to skip)")
    pp.add_argument("--park", action=argparse.BooleanOptionalAction, default=False,
                    help="instances park in-flight calls at a switch (the slot scheduler's can_park mode; their context goes to "
                    "host KV, or is recomputed without it); default --no-park: D_fin drains them (Talaria §3.4, §4.2; see sim/README.md)")
    pp.add_argument("--json", action="store_true", help="print the whole summary")
    pp.set_defaults(fn=_paper)
    rs = ps.add_parser("router-sweep", help="the paper's router testbed over offered loads x seeds: medians and paired ratios vs least-pressure")
    rs.add_argument("--out", default="sim-router-sweep")
    rs.add_argument("--router-profile", default=DEFAULT_TP4)
    rs.add_argument("--routers", default="full full:lease_arithmetic=false",
                    help="space-separated router variants: a policy, optionally ':field=value,...' PolicyParams overrides")
    rs.add_argument("--gaps", default="2,3,4,6", help="seconds between session starts (offered load), comma-separated")
    rs.add_argument("--router-open-s", default=str(ROUTER_OPEN_H2D_S), help=_OPEN_HELP)
    rs.add_argument("--seeds", type=int, default=10, help="task orders per load")
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(fn=_router_sweep)
    sc = ps.add_parser("scale", help="hot/cold cluster past one machine (placement decision cost, sim speed)")
    sc.add_argument("--out", default="sim-scale")
    sc.add_argument("--profile", default=DEFAULT_TP8)
    sc.add_argument("--instances", type=int, default=1000)
    sc.add_argument("--models", type=int, default=100)
    sc.add_argument("--sessions", type=int, default=10000)
    sc.add_argument("--seed", type=int, default=0)
    sc.set_defaults(fn=_scale)
    po = ps.add_parser("pools", help="static hot/cold splits vs the dynamic pool sizer (services/router/pool_sizing.py) on a drifting catalog")
    po.add_argument("--out", default="sim-pools")
    po.add_argument("--profile", default=DEFAULT_TP8)
    po.add_argument("--instances", type=int, default=200)
    po.add_argument("--models", type=int, default=40)
    po.add_argument("--sessions", type=int, default=2000)
    po.add_argument("--rate", type=float, default=5.0, help="session starts per second")
    po.add_argument("--seed", type=int, default=0)
    po.set_defaults(fn=_pools)
    le = ps.add_parser("leases", help="adaptive (tool-aware) leases vs fixed tau on the per-tool and mini-swe-agent workloads (issue 14)")
    le.add_argument("--out", default="sim-leases")
    le.add_argument("--profile", default=DEFAULT_TP4)
    le.add_argument("--workloads", default="tools,miniswe", help="comma list of tools,miniswe")
    le.add_argument("--seeds", type=int, default=12, help="workload seeds (repetitions; geometric means and paired ratios with "
                    "95 %% intervals reported: with 12 seeds the intervals are about +-5-8 %% on SCT p50 and +-2-4 %% on p95)")
    le.add_argument("--seed", type=int, default=0, help="first seed")
    le.add_argument("--sessions", type=int, default=24, help="sessions per seed (miniswe: at most the trace's 20)")
    le.add_argument("--max-depth", type=int, default=40, help="synthetic sessions' depth cap")
    le.add_argument("--taus", default="0.5,1,2,5", help="fixed tau values")
    le.add_argument("--start-gap", type=float, default=4.0, help="mean seconds between session starts (Poisson)")
    le.add_argument("--miniswe", default=None, help="the mini-swe-agent trace file (default: $TALARIA_TRACES_DIR/lmcache_miniswe_trace.jsonl.gz, "
                    "else data/traces/; see data/traces/README.md)")
    le.add_argument("--no-arith", action="store_true", help="also run adaptive leases without the lease arithmetic")
    le.add_argument("--decay", action="store_true", help="also run adaptive leases weighed by their decaying value in placement")
    le.add_argument("--no-reference", action="store_true", help="skip the reference run without any leases")
    le.add_argument("--json", action="store_true")
    le.set_defaults(fn=_leases)
    ca = ps.add_parser("catalog", help="models served per instance at the TTFT SLO as the catalog grows")
    ca.add_argument("--out", default="sim-catalog")
    ca.add_argument("--profile", default=DEFAULT_TP8)
    ca.add_argument("--instances", type=int, default=100)
    ca.add_argument("--catalogs", default="25,50,100,200,400")
    ca.add_argument("--sessions", type=int, default=2000)
    ca.add_argument("--rate", type=float, default=5.0, help="session starts per second")
    ca.add_argument("--hot-fraction", type=float, default=0.5, help="share of instances in the hot pool (0: all pooled)")
    ca.add_argument("--gpus-per-instance", type=int, default=8, help="GPUs per instance, for the per-GPU figure (8: the TP=8 profile)")
    ca.add_argument("--per-model", action="store_true", help="--sessions and --rate are per catalog model: load grows with the catalog "
                    "until the SLO breaks (the ceiling)")
    ca.add_argument("--seed", type=int, default=0)
    ca.add_argument("--config", default="Talaria", help="the cold pool's slot-policy row: Talaria (rounds), token-deadlines, ... (sim paper's rows)")
    ca.set_defaults(fn=_catalog)
    from .validate import RESOLUTION, TOLERANCE

    va = ps.add_parser("validate", help="the simulator against a real `talaria bench matrix` run, with one or more measured profiles (issue 15)")
    va.add_argument("--matrix", required=True, help="the matrix run's --out directory (summary.json, workload.jsonl)")
    va.add_argument("--profiles", nargs="+", required=True, help="profiles from `talaria bench profile` on the same machine")
    va.add_argument("--configs", help="comma list (default: every configuration of the run the simulator models)")
    va.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"allowed |simulated / real - 1| (default {TOLERANCE})")
    va.add_argument("--order-resolution", type=float, default=RESOLUTION,
                    help=f"real medians closer than this are a tie for the ordering check (default {RESOLUTION})")
    va.add_argument("--out", help="also write the result as JSON here")
    va.add_argument("--json", action="store_true")
    va.set_defaults(fn=_validate)


def _validate(args) -> int:
    from .validate import run_validate, table

    try:
        r = run_validate(Path(args.matrix), args.profiles, args.configs.split(",") if args.configs else None, args.tolerance,
                         say=lambda m: print(m, file=sys.stderr), resolution=args.order_resolution)
    except ValueError as e:
        print(f"talaria sim validate: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1))
    print(json.dumps(r, indent=2) if args.json else table(r))
    return 0 if r["within_all"] and r["same_order_all"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="talaria")
    add_cli(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    return int(args.fn(args) or 0)
