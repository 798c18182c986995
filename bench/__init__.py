"""Talaria benchmarks (``talaria bench engine`` / ``talaria bench router``).

Every benchmark measures Talaria and a baseline side by side in one process run on the same machine and
reports the *ratio* (median over repetitions), never an absolute number to compare across machines.
"""

from __future__ import annotations

import statistics
from pathlib import Path

DEFAULT_MODELS_DIR = Path(".talaria/bench-models")


def ensure_models(models_dir: str | Path | None, names: list[str], seed: int = 0, say=print) -> Path:
    """Return ``models_dir`` (default ``.talaria/bench-models``), synthesizing the missing ``names``."""
    out = Path(models_dir) if models_dir else DEFAULT_MODELS_DIR
    missing = [n for n in names if not (out / n / "config.json").exists()]
    if missing:
        from talaria.models.synth import synthesize

        say(f"synthesizing {missing} into {out} (seed {seed}) ...")
        synthesize(out, seed=seed, names=missing)
    return out


def emit(result: dict, text: str, json_path: str | None) -> int:
    """Print a benchmark's rendered table and, with ``json_path``, write its raw result there."""
    import json

    print()
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {json_path}")
    return 0


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile (``q`` in [0, 100])."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c != c:
            return "n/a"
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.2f}" if abs(c) < 100 else f"{c:.1f}"
    return str(c)


class quiet_loggers:
    """Raise the given loggers to WARNING for the duration (per-call INFO lines would be timed too)."""

    def __init__(self, *names: str):
        import logging

        self._loggers = [logging.getLogger(n) for n in names]
        self._levels: list[int] = []

    def __enter__(self) -> "quiet_loggers":
        import logging

        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc) -> None:
        for lg, lvl in zip(self._loggers, self._levels):
            lg.setLevel(lvl)
