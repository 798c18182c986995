"""Statistics a matrix claim can stand on (issue 12 item 6): bootstrap confidence intervals of SCT ratios,
paired per-session wins/losses, and the machine load recorded beside every number.

Bootstrap design (pure functions, seeded; no clock, no I/O but ``loadavg``). A matrix ratio such as
"Talaria's SCT p50 / the best baseline's" is estimated as the *median over repetitions* of the ratio
computed *within* each repetition (both sides replayed the same sessions on the same machine state). Its
uncertainty has two sources: which sessions the workload happened to contain, and run-to-run drift of the
machine. ``bootstrap_ratio_ci`` resamples both, hierarchically (Efron & Tibshirani, *An Introduction to the
Bootstrap*, ch. 13 percentile intervals; the two-stage resampling of clustered data of Davison & Hinkley,
*Bootstrap Methods*, §3.8): each bootstrap draw picks the repetitions with replacement, and within each
picked repetition picks its sessions with replacement — *paired*: the same session ids on the numerator
and on every denominator, as one session is one unit of work replayed under every configuration — then
recomputes each repetition's ratio and takes the median of them. The percentile interval of those draws is
reported. With one repetition it is a plain paired session bootstrap. Sessions a configuration did not
complete (a failed call) are left out of that repetition's pairing.

A denominator may be several configurations (the "best baseline"): in every draw each one's quantile is
computed on the same resampled sessions and the smallest is used, so the interval accounts for picking the
best baseline after the fact.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any
from pathlib import Path

from bench.workloads import nearest_rank

RatioRep = tuple[Mapping[str, float], Sequence[Mapping[str, float]]]  # (numerator SCTs, denominators' SCTs)


def _paired(rep: RatioRep) -> tuple[list[float], list[list[float]]] | None:
    num, dens = rep
    if not dens:
        return None
    common = sorted(set(num).intersection(*(set(d) for d in dens)))
    if not common:
        return None
    return [num[s] for s in common], [[d[s] for s in common] for d in dens]


def _ratio(num: Sequence[float], dens: Sequence[Sequence[float]], q: float) -> float:
    den = min(nearest_rank(list(d), q) for d in dens)
    return nearest_rank(list(num), q) / den if den > 0 else math.nan


def point_ratio(reps: Sequence[RatioRep], q: float) -> float:
    """Median over repetitions of the within-repetition ratio of the ``q``-th percentiles (paired sessions)."""
    vals = [r for rep in reps if (p := _paired(rep)) and math.isfinite(r := _ratio(p[0], p[1], q))]
    return float(statistics.median(vals)) if vals else math.nan


def bootstrap_ratio_ci(reps: Sequence[RatioRep], q: float, *, n_boot: int = 1000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile interval (``level``) of the median-over-repetitions ratio of SCT ``q``-th percentiles,
    from ``n_boot`` hierarchical paired resamples (repetitions, then sessions within each). ``reps``: per
    repetition, the numerator's session -> SCT and the denominators' (the smallest quantile is the
    denominator). NaN, NaN when no repetition has a session in common. Pure: same input and seed, same answer."""
    if not 0 < level < 1 or n_boot < 1:
        raise ValueError("level in (0, 1) and n_boot >= 1 required")
    paired = [p for rep in reps if (p := _paired(rep)) is not None]
    if not paired:
        return math.nan, math.nan
    rng = random.Random(seed)
    draws: list[float] = []
    for _ in range(n_boot):
        ratios = []
        for _r in range(len(paired)):
            num, dens = paired[rng.randrange(len(paired))]
            idx = [rng.randrange(len(num)) for _ in range(len(num))]
            r = _ratio([num[i] for i in idx], [[d[i] for i in idx] for d in dens], q)
            if math.isfinite(r):
                ratios.append(r)
        if ratios:
            draws.append(statistics.median(ratios))
    if not draws:
        return math.nan, math.nan
    draws.sort()
    lo_k = max(0, math.floor((1 - level) / 2 * len(draws)))
    hi_k = min(len(draws) - 1, math.ceil((1 + level) / 2 * len(draws)) - 1)
    return float(draws[lo_k]), float(draws[hi_k])


def paired_wins(a: Mapping[str, float], b: Mapping[str, float], rel_tol: float = 0.0) -> tuple[int, int, int]:
    """Sessions where ``a`` finished faster than ``b`` / slower / equal (within ``rel_tol`` of ``b``),
    over the sessions both completed."""
    won = lost = tied = 0
    for sid in set(a) & set(b):
        x, y = a[sid], b[sid]
        if abs(x - y) <= rel_tol * abs(y):
            tied += 1
        elif x < y:
            won += 1
        else:
            lost += 1
    return won, lost, tied


def wins_losses(ratios: Sequence[float]) -> tuple[int, int]:
    """(repetitions with ratio < 1, repetitions with ratio > 1); NaN ratios count as neither."""
    fin = [r for r in ratios if isinstance(r, (int, float)) and math.isfinite(r)]
    return sum(1 for r in fin if r < 1.0), sum(1 for r in fin if r > 1.0)


def loadavg(path: str | Path = "/proc/loadavg") -> list[float] | None:
    """The 1/5/15-minute load averages (None where the file is missing: not Linux)."""
    try:
        return [float(x) for x in Path(path).read_text().split()[:3]]
    except (OSError, ValueError):
        return None


# two-sided 95 % Student t quantiles by degrees of freedom (1-30); above 30 the normal's 1.96 is within 4 %
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110,
         2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Unit by unit (a simulator seed, a matrix repetition) ``a[i] / b[i]``: their geometric mean (``ratio``)
    with its 95 % interval (Student t over the log ratios), median, min, max, units where ``a`` is lower
    (``wins``) and ``n``. Pairing removes the spread between units (a seed's workload, a repetition's machine
    state) that both sides share. Pure."""
    logs = [math.log(x / y) for x, y in zip(a, b) if x > 0 and y > 0]
    if not logs:
        return {}
    n, mean = len(logs), statistics.fmean(logs)
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * statistics.stdev(logs) / math.sqrt(n) if n > 1 else math.inf
    ratios = [math.exp(x) for x in logs]
    return {"ratio": math.exp(mean), "lo": math.exp(mean - half) if math.isfinite(half) else 0.0, "hi": math.exp(mean + half),
            "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "wins": sum(x < 0 for x in logs), "n": n}


def unit_means(runs: Sequence[Mapping[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """Per key over the units (simulator seeds, matrix repetitions): the geometric mean of the latency figures
    (``sct_*``, ``ttft_*``: ratios of these are what a paired comparison reads; a median of a few units jumps by
    the one in the middle), the arithmetic mean of everything else (counts, KV held); a latency figure with a
    non-positive value falls back to the arithmetic mean. Pure."""
    out = {}
    for k in keys:
        xs = [float(r[k]) for r in runs]
        out[k] = math.exp(statistics.fmean(math.log(x) for x in xs)) if k.startswith(("sct_", "ttft_")) and min(xs) > 0 else statistics.fmean(xs)
    return out


def vs_best_fixed(rows: Mapping[str, Mapping[str, float]], name: str, fixed: Sequence[str],
                  per_unit: Mapping[str, Sequence[Mapping[str, float]]] | None = None, *, kv_key: str) -> dict[str, Any]:
    """Issue 14's lease comparison: variant ``name`` against the best of the ``fixed`` lease rows (lowest SCT
    p50; p95 against the lowest p95; ``rows`` are aggregates over units, e.g. geometric means), with the
    device KV the leases held under ``kv_key`` (GiB x s in the simulator, committed token x s on the stack).

    Without ``per_unit``: ratios of those rows, ``goal_met`` = both ratios <= 1 with less KV than the best-p50
    fixed tau. With ``per_unit`` (every row's runs, unit by unit in the same order) the comparison is
    *paired*: per metric ``paired_*`` is the geometric mean of the per-unit ratios against the best fixed
    tau's runs, with its 95 % interval (``paired_ratio``). Then ``beats`` = both paired ratios <= 1 and
    ``goal_met`` = neither is measurably worse (each interval reaches down to 1 or below: the variant
    *matches or beats* the best fixed tau as far as these units resolve), in both cases with less KV than the
    best-p50 fixed tau; the interval's width says how far that is. ``{}`` when the variant or every fixed row
    is missing. Pure."""
    fx = {k: rows[k] for k in fixed if k in rows}
    ad = rows.get(name)
    if not fx or ad is None:
        return {}
    paired = bool(per_unit) and name in per_unit and all(k in per_unit for k in fx)  # type: ignore[operator]
    best50 = min(fx, key=lambda k: fx[k]["sct_p50_s"])
    best95 = min(fx, key=lambda k: fx[k]["sct_p95_s"])
    kv = fx[best50][kv_key]
    out: dict[str, Any] = {
        "best_fixed_p50": best50, "best_fixed_p95": best95,
        "sct_p50_vs_best": ad["sct_p50_s"] / fx[best50]["sct_p50_s"],
        "sct_p95_vs_best": ad["sct_p95_s"] / fx[best95]["sct_p95_s"],
        "kv_vs_best": ad[kv_key] / kv if kv > 0 else math.nan,
    }
    less_kv = ad[kv_key] < kv
    out["goal_met"] = out["sct_p50_vs_best"] <= 1.0 and out["sct_p95_vs_best"] <= 1.0 and less_kv
    if paired:
        for key, best in (("sct_p50_s", best50), ("sct_p95_s", best95)):
            out[f"paired_{key[:7]}_vs_best"] = paired_ratio([r[key] for r in per_unit[name]], [r[key] for r in per_unit[best]])  # type: ignore[index]
        p50, p95 = out["paired_sct_p50_vs_best"], out["paired_sct_p95_vs_best"]
        out["beats"] = bool(p50) and bool(p95) and p50["ratio"] <= 1.0 and p95["ratio"] <= 1.0 and less_kv
        out["goal_met"] = bool(p50) and bool(p95) and p50["lo"] <= 1.0 and p95["lo"] <= 1.0 and less_kv
    return out
