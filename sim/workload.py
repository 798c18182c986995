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

import math
import random
from collections.abc import Sequence

from bench.workloads import Session, Workload
from bench.workloads.synthetic import SynthParams, generate

from .instance import SimCall
from .cluster import SimSession

FULL_SCALE_MAX_PROMPT = 131072
# §5.1: "the next waits for the same recorded tool gap after a 10 s cap. The cap affects 20 of 960 calls."
# The pooled gap distribution (§2.1) excludes the long environment gaps, so 20/960 of the replay's gaps
# are set to the cap.
GAP_CAPPED_SHARE = 20 / 960
GAP_CAPPED_S = 10.0  # the paper's models serve 128K contexts (§2.1: p95 prompt 105K)


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
    ordered = sorted(s.calls, key=lambda c: c.call_index)
    for i, c in enumerate(calls):
        c.index = i
        c.tool = (ordered[i + 1].tool or "") if i + 1 < len(ordered) else ""  # a replay call names the tool run *before* it
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
    """§5.1/§5.3: a 120-call, 30-model-session subset (4 calls per model-session), models round-robin,
    lengths/gaps/outputs of the synthetic generator's shape (``lengths_session``)."""
    from bench.workloads.synthetic import DEPTH

    per = calls // sessions
    out = []
    for i in range(sessions):  # the first ``per`` calls of a session of published depth (>= per): its early, shorter prompts
        rng = random.Random(seed * 1000 + i)
        depth = max(per, min(187, round(DEPTH.draw(rng))))
        s = lengths_session(rng, f"r{i:02d}", models[i % len(models)], depth, i * start_gap_s, output_scale)
        del s.calls[per:]
        out.append(s)
    assert sum(len(s.calls) for s in out) == calls
    return out


def tiled(n: int, catalog: Sequence[str], weights: Sequence[float], seed: int = 0, rate_per_s: float = 10.0, base_sessions: int = 200,
          max_depth: int = 49) -> list[SimSession]:
    """``n`` sessions for the scale run: ``base_sessions`` sessions of the generator's shape (published depth,
    capped at ``max_depth``; lengths only, ``lengths_session``) tiled, each copy on a catalog model drawn by
    popularity ``weights``, starts Poisson at ``rate_per_s``."""
    from bench.workloads.synthetic import DEPTH

    base = []
    for i in range(base_sessions):
        r = random.Random(seed * 100_003 + i)
        base.append(lengths_session(r, f"b{i}", "", max(1, min(max_depth, round(DEPTH.draw(r)))), 0.0))
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        m = rng.choices(catalog, weights)[0]
        sid = f"s{i:05d}"
        calls = [SimCall("", sid, c.index, m, c.prompt_tokens, c.prefix_tokens, c.output_tokens, c.gap_s) for c in base[i % len(base)].calls]
        out.append(SimSession(sid, t, calls))
    return out


# ------------------------------------------------------------------ the paper's TP=8 replay shape (§5.1)
def paper_depths(tasks: int = 10, calls: int = 320) -> list[int]:
    """Depths of ``tasks`` sessions holding ``calls`` calls, shaped like the published depth distribution
    (§2.1 / Fig. 2a: log-normal, p50 11, p95 49): the distribution's quantiles at the midpoints
    (i + 0.5) / tasks, scaled by one common factor to sum to ``calls`` (largest remainders rounded up).
    Ten tasks / 320 calls gives 5 ... 101 calls, p50 ~22: a deterministic 'typical' draw of the shape."""
    from statistics import NormalDist

    from bench.workloads.synthetic import DEPTH

    q = [DEPTH.median * math.exp(DEPTH.sigma * NormalDist().inv_cdf((i + 0.5) / tasks)) for i in range(tasks)]
    raw = [x * calls / sum(q) for x in q]
    out = [max(1, int(x)) for x in raw]
    for i in sorted(range(tasks), key=lambda i: raw[i] - int(raw[i]), reverse=True)[: calls - sum(out)]:
        out[i] += 1
    return out


def lengths_session(rng: random.Random, sid: str, model: str, depth: int, start: float, output_scale: float = 1.0,
                    max_prompt: int = FULL_SCALE_MAX_PROMPT, min_prompt: int = 256, max_output: int = 4096) -> SimSession:
    """One session of the synthetic generator's shape (``bench.workloads.synthetic``: its published
    distributions and its prompt-growth rule — the prior prompt plus the prior answer plus a tool result;
    3.2 % of continuations rewrite history and keep 5-50 %), as lengths only (the token-id form costs
    seconds per deep session). Depth is given instead of drawn."""
    from bench.workloads.synthetic import GAP_S, OUTPUT_TOKENS, PROMPT_TOKENS, REUSE_OVER_HALF

    lengths = sorted(max(min_prompt, min(max_prompt, round(PROMPT_TOKENS.draw(rng)))) for _ in range(depth))
    outputs = [max(1, min(max_output, round(OUTPUT_TOKENS.draw(rng)))) for _ in range(depth)]
    calls: list[SimCall] = []
    prev = 0
    for i in range(depth):
        if i == 0:
            n, keep, gap = lengths[0], 0, 0.0
        else:
            gap = GAP_CAPPED_S if rng.random() < GAP_CAPPED_SHARE else GAP_S.draw(rng)
            if rng.random() < REUSE_OVER_HALF:
                keep = prev
                base = prev + outputs[i - 1]
                if base >= max_prompt:
                    base = prev if prev < max_prompt else (keep := int(prev * 0.75))
            else:
                keep = int(prev * rng.uniform(0.05, 0.5))
                base = keep
            n = min(max(lengths[i], base + 1), max_prompt)
        calls.append(SimCall("", sid, i, model, n, keep, max(1, round(outputs[i] * output_scale)), gap))
        prev = n
    return SimSession(sid, start, calls)


def paper_replay(models: Sequence[str], seed: int = 0, tasks: int = 10, calls_per_model: int = 320, start_gap_s: float = 0.0,
                 output_scale: float = 1.0) -> list[SimSession]:
    """§5.1: ten task identities (depths ``paper_depths``) replayed on each of three models: 30
    model-sessions, 960 calls; a task's calls (lengths, gaps, completion tokens) are identical on every
    model (fixed replay). Model-session j (task-major) starts at ``j * start_gap_s``."""
    depths = paper_depths(tasks, calls_per_model)
    order = list(range(tasks))
    random.Random(seed).shuffle(order)  # which task is deep is not tied to its start position
    base = [lengths_session(random.Random(seed * 1000 + t), f"task{t}", "", depths[t], 0.0, output_scale) for t in range(tasks)]
    out = []
    for pos, t in enumerate(order):
        for mi, m in enumerate(models):
            calls = [SimCall("", f"{m}/task{t}", c.index, m, c.prompt_tokens, c.prefix_tokens, c.output_tokens, c.gap_s) for c in base[t].calls]
            out.append(SimSession(f"{m}/task{t}", (pos * len(models) + mi) * start_gap_s, calls))
    return out
