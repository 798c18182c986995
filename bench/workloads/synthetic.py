"""Seeded synthetic agent sessions matching the published SWE-Bench Verified distributions.

Targets (Talaria §2.1 / Fig. 2, ``../shared/data/README.md``; 445 sessions, 7,386 calls):

| quantity | p50 | p95 | max | how it is drawn here |
|---|---|---|---|---|
| session depth (calls) | 11 | 49 | 187 | log-normal (median 11, sigma ln(49/11)/1.645), rounded, clipped to [1, max_depth] |
| tool gap (s) | 0.39 | 1.32 | | log-normal (median 0.39, sigma ln(1.32/0.39)/1.645) |
| prompt tokens | 25K | 105K | | per call log-normal (median 25K, sigma ln(105/25)/1.645) x ``length_scale``; a session's draws are sorted so its prompt grows |
| continuations reusing > half of the prior prompt | 96.8 % | | | each continuation keeps the whole prior prompt (+ prior output) except with probability 3.2 %, when it keeps a uniform 5-50 % of it (history rewritten) |

Not published, therefore assumed and stated: output tokens per call log-normal (median 300, p95 1500)
x ``length_scale``; session starts are a Poisson process (``mean_interarrival_s``); sessions are assigned
to the models round-robin in a seeded order. Everything is a pure function of the arguments: the same seed
gives the same workload.

Prompts are token ids (``/v1/completions``), built so every continuation is a true prefix extension:
``prompt[i] = prompt[i-1] + output_placeholder[i-1] + tool_result[i]`` (the placeholder stands for the
recorded answer, as the replay cannot know what a model will generate), so the reuse the engine can find is
real KV reuse. Token ids are drawn from [3, vocab) (0-2 are the synthesized tokenizer's special tokens).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.workloads import Call, Session, Workload

Z95 = 1.6448536269514722  # standard normal 95th percentile


@dataclass(frozen=True, slots=True)
class LogNormal:
    median: float
    p95: float

    @property
    def sigma(self) -> float:
        return math.log(self.p95 / self.median) / Z95

    def draw(self, rng: random.Random) -> float:
        return math.exp(rng.gauss(math.log(self.median), self.sigma))


# Published (SWE-Bench Verified characterisation, Talaria §2.1)
DEPTH = LogNormal(11, 49)
DEPTH_MAX = 187
GAP_S = LogNormal(0.39, 1.32)
PROMPT_TOKENS = LogNormal(25_000, 105_000)
REUSE_OVER_HALF = 0.968
# Assumed (not published)
OUTPUT_TOKENS = LogNormal(300, 1500)


@dataclass(frozen=True, slots=True)
class SynthParams:
    sessions: int = 12
    models: tuple[str, ...] = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
    seed: int = 0
    length_scale: float = 1 / 32  # prompt and output lengths are multiplied by this (CPU-sized)
    time_scale: float = 1.0  # gaps and start offsets are multiplied by this
    max_depth: int = DEPTH_MAX
    max_prompt: int = 3584  # the synthesized models have 4096 positions
    min_prompt: int = 32
    max_output: int = 256
    mean_interarrival_s: float = 2.0
    vocab: int = 4096


def generate(p: SynthParams) -> Workload:
    rng = random.Random(p.seed)
    order = list(p.models)
    rng.shuffle(order)
    sessions: list[Session] = []
    t = 0.0
    for si in range(p.sessions):
        if si:
            t += rng.expovariate(1.0 / p.mean_interarrival_s) * p.time_scale
        sid = f"syn{p.seed}-{si:04d}"
        model = order[si % len(order)]
        sessions.append(_session(rng, p, sid, model, t))
    meta = {
        "source": "synthetic SWE-Bench Verified distributions (bench/workloads/synthetic.py)",
        "seed": p.seed,
        "length_scale": p.length_scale,
        "time_scale": p.time_scale,
        "max_depth": p.max_depth,
        "max_prompt": p.max_prompt,
        "mean_interarrival_s": p.mean_interarrival_s,
        "models": list(p.models),
    }
    return Workload(sessions, meta)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return rng.choices(range(3, vocab), k=n)


def _session(rng: random.Random, p: SynthParams, sid: str, model: str, offset: float) -> Session:
    depth = max(1, min(p.max_depth, DEPTH_MAX, round(DEPTH.draw(rng))))
    lengths = sorted(
        max(p.min_prompt, min(p.max_prompt, round(PROMPT_TOKENS.draw(rng) * p.length_scale))) for _ in range(depth)
    )
    outputs = [max(1, min(p.max_output, round(OUTPUT_TOKENS.draw(rng) * p.length_scale))) for _ in range(depth)]
    calls: list[Call] = []
    prev: list[int] = []
    for i in range(depth):
        if i == 0:
            prompt = _tokens(rng, lengths[0], p.vocab)
            calls.append(Call(sid, 0, model, outputs[0], 0.0, 0, prompt_tokens=prompt))
        else:
            gap = GAP_S.draw(rng) * p.time_scale
            if rng.random() < REUSE_OVER_HALF:
                keep = len(prev)
                base = prev + _tokens(rng, outputs[i - 1], p.vocab)  # the prior answer stays in the context
                if len(base) >= p.max_prompt:  # context full: drop the answer, and compact if still full
                    base = prev if len(prev) < p.max_prompt else prev[: (keep := int(len(prev) * 0.75))]
            else:
                keep = int(len(prev) * rng.uniform(0.05, 0.5))  # history rewritten: < half reused
                base = prev[:keep]
            want = min(max(lengths[i], len(base) + 1), p.max_prompt)
            append = base[keep:] + _tokens(rng, want - len(base), p.vocab)
            prompt = prev[:keep] + append
            calls.append(Call(sid, i, model, outputs[i], gap, keep, append_tokens=append))
        prev = prompt
    return Session(sid, offset, calls)
