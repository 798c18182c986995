"""Workloads for the simulator: the ``talaria-replay/1`` format and generators of ``bench/workloads``,
turned into lengths (the simulator needs token counts, not token ids).

* ``from_workload``: any ``bench.workloads.Workload`` (read from JSONL, the synthetic generator, the Mooncake
  importer) -> ``SimSession``s. Prompt length = ``prefix_tokens + len(append_tokens)`` for the compact form,
  the token-id list length otherwise, ~4 characters per token for text/chat prompts.
* ``paper_tp8``: the §5.1 fixed-replay shape, 10 task sessions x 3 models = 30 model-sessions, 960 calls,
  from the synthetic SWE-Bench generator at full scale (no length scaling).
* ``router_subset``: the §5.1/§5.3 router trace shape, 30 model-sessions and 120 calls.
* ``tiled``: many sessions for the scale run (a generated base set tiled with new ids, models and starts).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from bench.workloads import Session, Workload
from bench.workloads.synthetic import SynthParams, generate

from .instance import SimCall
from .cluster import SimSession

FULL_SCALE_MAX_PROMPT = 131072  # the paper's models serve 128K contexts (§2.1: p95 prompt 105K)


def _len(call, prev_len: int) -> int:
    if call.append_tokens is not None:
        return call.prefix_tokens + len(call.append_tokens)
    if call.prompt_tokens is not None:
        return len(call.prompt_tokens)
    if call.prompt_text is not None:
        return max(1, len(call.prompt_text) // 4)
    return max(1, sum(len(str(m.get("content", ""))) for m in call.messages or []) // 4)


def session_of(s: Session, model: str | None = None, sid: str | None = None, start: float | None = None, output_scale: float = 1.0) -> SimSession:
    """One replay session as lengths; ``output_scale`` multiplies completion tokens (>= 1 each)."""
    sid = sid or s.session_id
    calls: list[SimCall] = []
    prev = 0
    for c in sorted(s.calls, key=lambda c: c.call_index):
        n = _len(c, prev)
        calls.append(SimCall("", sid, c.call_index, model or c.model, n, min(c.prefix_tokens, n), max(1, round(c.output_tokens * output_scale)), c.gap_s if c.call_index else 0.0))
        prev = n
    for i, c in enumerate(calls):
        c.index = i
    return SimSession(sid, s.start_offset_s if start is None else start, calls)


def from_workload(w: Workload) -> list[SimSession]:
    return [session_of(s) for s in w.sessions if s.calls]


def full_scale(sessions: int, seed: int, models: Sequence[str], max_depth: int = 187, mean_interarrival_s: float = 2.0) -> Workload:
    """The synthetic SWE-Bench generator with no length scaling (issue 15: 'at full scale')."""
    return generate(SynthParams(sessions=sessions, models=tuple(models), seed=seed, length_scale=1.0, max_depth=max_depth,
                                max_prompt=FULL_SCALE_MAX_PROMPT, min_prompt=256, max_output=4096, mean_interarrival_s=mean_interarrival_s,
                                vocab=32000))


def _pick(w: Workload, n: int, calls: int, min_depth: int) -> list[Session]:
    """``n`` task sessions (generator order, depth >= min_depth) truncated so they hold exactly ``calls`` calls."""
    chosen = [s for s in w.sessions if len(s.calls) >= min_depth][:n]
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} generated sessions have depth >= {min_depth}")
    total = sum(len(s.calls) for s in chosen)
    while total > calls:  # trim the deepest session by one call (keeps order and prefixes)
        s = max(chosen, key=lambda s: len(s.calls))
        s.calls.pop()
        total -= 1
    if total < calls:
        raise ValueError(f"{n} sessions hold only {total} calls")
    return chosen


def paper_tp8(models: Sequence[str], seed: int = 0, tasks: int = 10, calls_per_model: int = 320, start_gap_s: float = 2.0,
              output_scale: float = 1.0) -> list[SimSession]:
    """§5.1: ten task identities replayed on each of three models (30 model-sessions, 960 calls).
    Depth >= 25 picks tasks as deep as the paper's (960 / 30 = 32 calls per model-session)."""
    base = _pick(full_scale(200, seed, models[:1]), tasks, calls_per_model, 25)
    out = []
    for mi, m in enumerate(models):
        for ti, s in enumerate(base):
            out.append(session_of(s, m, f"{m}/task{ti}", start=(ti * len(models) + mi) * start_gap_s, output_scale=output_scale))
    return out


def router_subset(models: Sequence[str], seed: int = 0, sessions: int = 30, calls: int = 120, start_gap_s: float = 1.0,
                  output_scale: float = 1.0) -> list[SimSession]:
    """§5.1/§5.3: a 120-call, 30-model-session subset (4 calls per model-session), models round-robin."""
    base = _pick(full_scale(400, seed, models[:1], mean_interarrival_s=1.0), sessions, calls, 4)
    for s in base:
        del s.calls[4:]
    out = []
    for i, s in enumerate(base):
        out.append(session_of(s, models[i % len(models)], f"r{i:02d}", start=i * start_gap_s, output_scale=output_scale))
    total = sum(len(s.calls) for s in out)
    assert total == calls, total
    return out


def tiled(n: int, catalog: Sequence[str], weights: Sequence[float], seed: int = 0, rate_per_s: float = 10.0, base_sessions: int = 200,
          max_depth: int = 49) -> list[SimSession]:
    """``n`` sessions for the scale run: a generated base set tiled, each copy on a catalog model drawn by
    popularity ``weights``, starts Poisson at ``rate_per_s``."""
    base = [s for s in full_scale(base_sessions, seed, catalog[:1], max_depth=max_depth).sessions if s.calls]
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        m = rng.choices(catalog, weights)[0]
        out.append(session_of(base[i % len(base)], m, f"s{i:05d}", start=t))
    return out
