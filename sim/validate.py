"""``talaria sim validate``: the simulator against a real ``talaria bench matrix`` run (issue 15, "Validate
against reality").

Design note
-----------
The real run gives, per configuration, the median over its repetitions of SCT p50 and p95 (``summary.json``:
``repetitions`` when the matrix ran ``--repeats``, else each row's summary) and the replayed workload
(``workload.jsonl``). Each profile given (``talaria bench profile`` measured on the same machine, ideally one
before and one after the matrix) simulates every configuration the simulator knows (``sim.paper.CONFIGS``:
Talaria, no-SP, no-HKVR, H2D-only, no-hold, Round-only; the matrix's other rows use routers the simulator
does not model and are listed as skipped) on as many cold instances as the matrix ran engines, with the same
code path as ``talaria sim run``. Reported per profile and configuration: simulated / real - 1 for SCT p50
and p95, whether every error is within ``tolerance`` (the issue's 20 %), and whether the simulation orders
the configurations as the real run does. Only orderings the real run itself resolves count: a pair of
configurations whose order is the same in every repetition (with one repetition, every pair) and whose
medians differ by at least ``resolution`` (5 %: two configurations 1-3 % apart cannot be ordered by a model
whose claim is 20 %); a pair that swapped between repetitions, or lies closer, is a tie of the real run, and
a simulation may put it either way. With two
profiles the spread between them says how much of an error is the profile's own noise: a 20 % claim means
little when two profiles of one machine differ by as much.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

TOLERANCE = 0.20  # issue 15: simulated SCT p50/p95 within 20 % of the measured medians
RESOLUTION = 0.05  # real medians closer than this are a tie for the ordering check
METRICS = ("sct_p50_s", "sct_p95_s")


def measured(matrix_dir: Path, resolution: float = RESOLUTION) -> tuple[dict[str, dict[str, float]], dict[str, list[tuple[str, str]]], Path, int]:
    """Per configuration that ran ok in every repetition it had: the median over repetitions of each metric;
    per metric the (faster, slower) pairs the run resolves (same order in every repetition, medians at least
    ``resolution`` apart); the workload file; the number of cold engines (instances) of the stack."""
    summ = json.loads((matrix_dir / "summary.json").read_text())
    runs: dict[str, list[dict[str, Any]]] = {}
    if summ.get("repetitions"):
        for rep in summ["repetitions"]:
            runs.setdefault(rep["name"], []).append(rep)
    else:
        for row in summ["rows"]:
            runs.setdefault(row["name"], []).append({"status": row.get("status"), **(row.get("summary") or {})})
    ok = {name: rs for name, rs in runs.items() if rs and all(r.get("status") == "ok" for r in rs)}
    real = {name: {m: statistics.median(r[m] for r in rs) for m in METRICS} for name, rs in ok.items()}
    resolved: dict[str, list[tuple[str, str]]] = {m: [] for m in METRICS}
    names = list(ok)
    for i, a in enumerate(names):
        by_rep_a = {r.get("rep", 1): r for r in ok[a]}
        for b in names[i + 1 :]:
            pairs = [(by_rep_a[r.get("rep", 1)], r) for r in ok[b] if r.get("rep", 1) in by_rep_a]
            for m in METRICS:
                signs = {(x[m] > y[m]) - (x[m] < y[m]) for x, y in pairs}
                if abs(real[a][m] / real[b][m] - 1.0) < resolution:
                    continue  # a tie at this resolution
                if signs == {-1}:
                    resolved[m].append((a, b))
                elif signs == {1}:
                    resolved[m].append((b, a))
    wf = Path(summ["meta"].get("workload_file", ""))
    if not wf.is_file():
        wf = matrix_dir / "workload.jsonl"
    instances = 2  # bench matrix base stack: two cold engines, unless a run's telemetry says otherwise
    for tel in sorted(matrix_dir.glob("**/telemetry.json")):
        n = json.loads(tel.read_text()).get("instances")
        if n:
            instances = int(n)
            break
    return real, resolved, wf, instances


def simulate(workload_path: Path, profile_path: str, configs: list[str], instances: int) -> dict[str, dict[str, float]]:
    """SCT p50/p95 of each configuration simulated on ``instances`` cold instances (as ``talaria sim run``)."""
    from bench.workloads import read_jsonl

    from .paper import replay_summaries
    from .profile import load

    rows = replay_summaries(load(profile_path), read_jsonl(workload_path), configs, instances)
    return {name: {m: float(s[m]) for m in METRICS} for name, s in zip(configs, rows)}


def order(values: dict[str, dict[str, float]], metric: str) -> list[str]:
    return sorted(values, key=lambda c: (values[c][metric], c))


def compare(real: dict[str, dict[str, float]], sim: dict[str, dict[str, float]], tolerance: float = TOLERANCE,
            resolved: dict[str, list[tuple[str, str]]] | None = None) -> dict[str, Any]:
    """Errors (simulated / real - 1) per configuration and metric, the within-tolerance verdict and the
    ordering check over ``resolved`` (per metric, the (faster, slower) pairs of the real run; None: every
    pair by the real medians). Pure."""
    configs = [c for c in real if c in sim]
    errors = {c: {m: sim[c][m] / real[c][m] - 1.0 for m in METRICS} for c in configs}
    sub_real = {c: real[c] for c in configs}
    if resolved is None:
        resolved = {m: [(a, b) for i, a in enumerate(order(sub_real, m)) for b in order(sub_real, m)[i + 1 :]] for m in METRICS}
    swapped = {m: [(a, b) for a, b in resolved[m] if a in sim and b in sim and not sim[a][m] < sim[b][m]] for m in METRICS}
    return {
        "errors": errors,
        "within": all(abs(e) <= tolerance for row in errors.values() for e in row.values()),
        "max_abs_error": max((abs(e) for row in errors.values() for e in row.values()), default=0.0),
        "same_order": {m: not swapped[m] for m in METRICS},
        "swapped": swapped,
        "resolved": resolved,
        "order_real": {m: order(sub_real, m) for m in METRICS},
        "order_sim": {m: order({c: sim[c] for c in configs}, m) for m in METRICS},
    }


def run_validate(matrix_dir: Path, profiles: list[str], configs: list[str] | None = None, tolerance: float = TOLERANCE,
                 say=print, resolution: float = RESOLUTION) -> dict[str, Any]:
    from .paper import CONFIGS

    for p in profiles:
        if not Path(p).is_file():
            raise ValueError(f"no profile at {p} (measure one with `talaria bench profile --out {p}`)")
    if not (matrix_dir / "summary.json").is_file():
        raise ValueError(f"no matrix run at {matrix_dir} (its summary.json is missing)")
    real, resolved, wpath, instances = measured(matrix_dir, resolution)
    known = [c for c in real if c in CONFIGS]
    chosen = [c for c in (configs or known) if c in real]
    missing = [c for c in (configs or []) if c not in real]
    if missing:
        raise ValueError(f"not in the matrix run (or failed there): {', '.join(missing)}; it has {', '.join(real)}")
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        raise ValueError(f"the simulator does not model {', '.join(unknown)}; it models {', '.join(CONFIGS)}")
    if not chosen:
        raise ValueError(f"no configuration of the matrix run is one the simulator models ({', '.join(CONFIGS)})")
    result: dict[str, Any] = {"matrix": str(matrix_dir), "workload": str(wpath), "instances": instances, "tolerance": tolerance, "resolution": resolution,
                              "real": {c: real[c] for c in chosen}, "skipped": [c for c in real if c not in chosen], "profiles": {}}
    for p in profiles:
        say(f"simulating {', '.join(chosen)} on {instances} instances with {p} ...")
        sim = simulate(wpath, p, chosen, instances)
        pairs = {m: [(a, b) for a, b in resolved[m] if a in chosen and b in chosen] for m in METRICS}
        result["profiles"][p] = {"sim": sim, **compare(result["real"], sim, tolerance, pairs)}
    result["within_all"] = all(v["within"] for v in result["profiles"].values())
    result["same_order_all"] = all(all(v["same_order"].values()) for v in result["profiles"].values())
    return result


def table(r: dict[str, Any]) -> str:
    lines = [f"real: {r['matrix']} (medians over its repetitions); workload {r['workload']}; {r['instances']} cold instances",
             "| config | real SCT p50 / p95 | " + " | ".join(f"sim ({Path(p).name}) p50 / p95, error" for p in r["profiles"]) + " |",
             "|---|---|" + "---|" * len(r["profiles"])]
    for c, v in r["real"].items():
        cells = []
        for p in r["profiles"].values():
            s, e = p["sim"][c], p["errors"][c]
            cells.append(f"{s['sct_p50_s']:.2f} / {s['sct_p95_s']:.2f} s ({e['sct_p50_s']:+.0%} / {e['sct_p95_s']:+.0%})")
        lines.append(f"| {c} | {v['sct_p50_s']:.2f} / {v['sct_p95_s']:.2f} s | " + " | ".join(cells) + " |")
    for p, v in r["profiles"].items():
        order_txt = []
        for m, label in (("sct_p50_s", "p50"), ("sct_p95_s", "p95")):
            pairs = ", ".join(f"{a} < {b}" for a, b in v["resolved"][m]) or "none"
            bad = ", ".join(f"{a} < {b}" for a, b in v["swapped"][m])
            order_txt.append(f"{label}: {'same' if v['same_order'][m] else 'SWAPPED ' + bad} (real run resolves {pairs}; "
                             f"simulated {' < '.join(v['order_sim'][m])})")
        lines.append(f"{Path(p).name}: max |error| {v['max_abs_error']:.0%} ({'within' if v['within'] else 'NOT within'} "
                     f"{r['tolerance']:.0%}); order {'; '.join(order_txt)}")
    if r["skipped"]:
        lines.append(f"not simulated (router policies the simulator does not model): {', '.join(r['skipped'])}")
    return "\n".join(lines)
