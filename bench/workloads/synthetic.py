"""Seeded synthetic agent sessions matching the published SWE-Bench Verified distributions.

Targets (Talaria §2.1 / Fig. 2, the paper's characterisation of 445 SWE-Bench Verified sessions, 7,386 calls):

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

Two options, off by default (the default workload is unchanged, draw for draw):

* **per-tool gaps** (``tool_gaps``, issue 14): every continuation names the tool the previous call ran
  (``Call.tool``), drawn from ``TOOLS`` (fast: read/search commands; medium: edits and git; slow: running
  code and tests), and its gap is drawn from that tool's own log-normal. The tool names and their mix are
  those the mini-swe-agent trace runs most (``miniswe.py``); the per-tool gap medians/p95s are **assumed**
  (the published characterisation gives only the pooled distribution) and chosen an order of magnitude
  apart, so a fixed lease τ is too long for the fast tools and too short for the slow ones.
* **two-model sessions** (``two_model``, issue 12): a session alternates an agent model and a
  user-simulator model (the next model in the seeded model order). The agent's turn is a run of calls
  (geometric, mean ``agent_calls_per_turn``) separated by tool gaps; then the user simulator answers and the
  agent resumes, each after a short hand-off gap (``HANDOFF_S``, assumed: the harness passes a message on).
  Both models see the same growing transcript, so every call's prompt still extends the previous call's
  (token reuse is real, but KV is per model: a call can reuse only what its own model computed).

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
HANDOFF_S = LogNormal(0.02, 0.1)  # two-model sessions: the harness hands one model's message to the other


@dataclass(frozen=True, slots=True)
class ToolGap:
    name: str
    weight: float  # share of tool calls
    gap: LogNormal  # seconds from the response to the next call (the tool's run + the harness)


# Per-tool gaps (assumed, see the module docstring): fast / medium / slow, an order of magnitude apart.
TOOLS: tuple[ToolGap, ...] = (
    ToolGap("grep", 0.17, LogNormal(0.05, 0.25)),
    ToolGap("find", 0.15, LogNormal(0.05, 0.25)),
    ToolGap("cat", 0.12, LogNormal(0.04, 0.2)),
    ToolGap("ls", 0.06, LogNormal(0.03, 0.15)),
    ToolGap("sed", 0.17, LogNormal(0.3, 1.2)),
    ToolGap("git", 0.08, LogNormal(0.4, 1.5)),
    ToolGap("python", 0.15, LogNormal(3.0, 9.0)),
    ToolGap("pytest", 0.10, LogNormal(6.0, 20.0)),
)


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
    tool_gaps: bool = False  # per-tool gap distributions (TOOLS); continuations carry ``tool``
    two_model: bool = False  # agent + user-simulator sessions
    agent_calls_per_turn: float = 2.0  # two-model: mean agent calls between two user-simulator calls

    def __post_init__(self) -> None:
        if self.two_model and len(self.models) < 2:
            raise ValueError("two_model needs at least two models")
        if self.agent_calls_per_turn < 1:
            raise ValueError("agent_calls_per_turn must be >= 1")


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
        user = order[(si + 1) % len(order)] if p.two_model else None
        sessions.append(_session(rng, p, sid, model, t, user))
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
    if p.tool_gaps:
        meta["tool_gaps"] = {t.name: {"weight": t.weight, "gap_p50_s": t.gap.median, "gap_p95_s": t.gap.p95} for t in TOOLS}
    if p.two_model:
        meta["two_model"] = {"agent_calls_per_turn": p.agent_calls_per_turn, "handoff_p50_s": HANDOFF_S.median, "handoff_p95_s": HANDOFF_S.p95}
    return Workload(sessions, meta)


def _next_call(rng: random.Random, p: SynthParams, prev_model: str, agent: str, user: str | None) -> tuple[str, float, str | None]:
    """(model, gap, tool) of a continuation after a call of ``prev_model``. Without options: one draw of
    the pooled gap (the default workload's exact draw sequence)."""
    model = agent
    if user is not None:
        if prev_model == user or rng.random() < 1.0 / p.agent_calls_per_turn:
            model = user if prev_model == agent else agent  # the turn passes to the other model
            return model, HANDOFF_S.draw(rng) * p.time_scale, None
    if p.tool_gaps:
        t = rng.choices(TOOLS, weights=[t.weight for t in TOOLS])[0]
        return model, t.gap.draw(rng) * p.time_scale, t.name
    return model, GAP_S.draw(rng) * p.time_scale, None


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return rng.choices(range(3, vocab), k=n)


def _session(rng: random.Random, p: SynthParams, sid: str, model: str, offset: float, user: str | None = None) -> Session:
    depth = max(1, min(p.max_depth, DEPTH_MAX, round(DEPTH.draw(rng))))
    lengths = sorted(
        max(p.min_prompt, min(p.max_prompt, round(PROMPT_TOKENS.draw(rng) * p.length_scale))) for _ in range(depth)
    )
    outputs = [max(1, min(p.max_output, round(OUTPUT_TOKENS.draw(rng) * p.length_scale))) for _ in range(depth)]
    calls: list[Call] = []
    prev: list[int] = []
    cur = model
    for i in range(depth):
        if i == 0:
            prompt = _tokens(rng, lengths[0], p.vocab)
            calls.append(Call(sid, 0, model, outputs[0], 0.0, 0, prompt_tokens=prompt))
        else:
            cur, gap, tool = _next_call(rng, p, cur, model, user)
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
            calls.append(Call(sid, i, cur, outputs[i], gap, keep, append_tokens=append, tool=tool))
        prev = prompt
    return Session(sid, offset, calls)
