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
