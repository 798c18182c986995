"""Replay workloads: Talaria's own JSONL trace format (``README.md`` in this folder), its reader/writer,
and the distribution summary the generator test and the report use.

A workload is a list of sessions; a session is an ordered list of calls (usually of one model; a two-model
session alternates an agent model and a user-simulator model, each call names its own). Each call fixes
what a fixed replay (Talaria §5.1, Appendix A) holds constant: the request body (prompt as token ids,
text or chat messages), the completion-token count (EOS ignored) and the recorded gap before it.

| module | owns |
|---|---|
| ``__init__`` | ``Call`` / ``Session`` / ``Workload``, JSONL read/write, prompt resolution, ``describe`` |
| ``synthetic`` | seeded generator matching the published SWE-Bench Verified distributions |
| ``mooncake`` | importer of the Mooncake trace (sessions from shared ``hash_ids`` chains) |
| ``miniswe`` | importer of the mini-swe-agent trace (real prompts, real gaps, the tool each call ran) |
| ``traces`` | where the public trace files are: an explicit path, else ``$TALARIA_TRACES_DIR``, else ``data/traces/``; a clear error when absent |

Nothing here talks to a server or reads a clock.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "talaria-replay/1"
GAP_CAP_S = 10.0  # Talaria §5.1: "the next waits for the same recorded tool gap after a 10 s cap"


@dataclass(slots=True)
class Call:
    """One recorded call. Exactly one prompt form is set:

    * ``prompt_tokens``: the full prompt as token ids (``/v1/completions``);
    * ``append_tokens`` (+ ``prefix_tokens``): the prompt is the previous call's prompt cut to
      ``prefix_tokens`` tokens, followed by ``append_tokens`` (compact form of the above);
    * ``prompt_text``: a text prompt (``/v1/completions``);
    * ``messages``: chat messages (``/v1/chat/completions``).

    ``prefix_tokens`` is the reusable prefix: tokens shared with the previous call's prompt (0 for the
    first call). ``gap_s`` is the recorded gap between the previous call's response and this call's
    enqueue (0 for the first call; the replay caps it at 10 s).
    """

    session_id: str
    call_index: int
    model: str
    output_tokens: int
    gap_s: float = 0.0
    prefix_tokens: int = 0
    prompt_tokens: list[int] | None = None
    append_tokens: list[int] | None = None
    prompt_text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tool: str | None = None  # the tool the previous call invoked (None: unknown, or no tool ran before this call)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "session_id": self.session_id,
            "call_index": self.call_index,
            "model": self.model,
            "output_tokens": self.output_tokens,
            "gap_s": round(self.gap_s, 6),
            "prefix_tokens": self.prefix_tokens,
        }
        for k in ("prompt_tokens", "append_tokens", "prompt_text", "messages"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.tool is not None:
            d["tool"] = self.tool
        return d


@dataclass(slots=True)
class Session:
    session_id: str
    start_offset_s: float
    calls: list[Call] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.calls[0].model if self.calls else ""


@dataclass(slots=True)
class Workload:
    sessions: list[Session]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_calls(self) -> int:
        return sum(len(s.calls) for s in self.sessions)

    def models(self) -> list[str]:
        return sorted({c.model for s in self.sessions for c in s.calls})

    def remap_models(self, mapping: dict[str, str]) -> "Workload":
        for s in self.sessions:
            for c in s.calls:
                c.model = mapping.get(c.model, c.model)
        return self


class TraceError(ValueError):
    """A trace file that does not follow the format; the message names the line."""


# ------------------------------------------------------------------------------------------- I/O
def write_jsonl(w: Workload, path: str | Path) -> Path:
    """One ``{"meta": {...}}`` line, then one line per call (sessions in start order, calls in order)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        f.write(json.dumps({"meta": {"format": FORMAT, **w.meta}}, separators=(",", ":")) + "\n")
        for s in sorted(w.sessions, key=lambda s: (s.start_offset_s, s.session_id)):
            for c in s.calls:
                d = c.to_json()
                if c.call_index == 0:
                    d["start_offset_s"] = round(s.start_offset_s, 6)
                f.write(json.dumps(d, separators=(",", ":")) + "\n")
    return p


def read_jsonl(path: str | Path) -> Workload:
    """Read and validate a trace: calls of a session are sorted by ``call_index``, which must run 0..n-1;
    every call has exactly one prompt form; ``append_tokens`` needs a token-id previous prompt."""
    meta: dict[str, Any] = {}
    by_session: dict[str, list[Call]] = {}
    offsets: dict[str, float] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{n}: not JSON: {e}") from None
        if "meta" in d:
            meta.update(d["meta"])
            continue
        try:
            c = Call(
                session_id=str(d["session_id"]),
                call_index=int(d["call_index"]),
                model=str(d["model"]),
                output_tokens=int(d["output_tokens"]),
                gap_s=float(d.get("gap_s", 0.0)),
                prefix_tokens=int(d.get("prefix_tokens", 0)),
                prompt_tokens=d.get("prompt_tokens"),
                append_tokens=d.get("append_tokens"),
                prompt_text=d.get("prompt_text"),
                messages=d.get("messages"),
                tool=d.get("tool"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{path}:{n}: bad call record: {e!r}") from None
        forms = [k for k in ("prompt_tokens", "append_tokens", "prompt_text", "messages") if getattr(c, k) is not None]
        if len(forms) != 1:
            raise TraceError(f"{path}:{n}: exactly one of prompt_tokens/append_tokens/prompt_text/messages, got {forms}")
        if c.tool is not None and not isinstance(c.tool, str):
            raise TraceError(f"{path}:{n}: tool must be a string, got {type(c.tool).__name__}")
        if c.output_tokens < 1 or c.gap_s < 0 or c.prefix_tokens < 0:
            raise TraceError(f"{path}:{n}: output_tokens >= 1, gap_s >= 0, prefix_tokens >= 0 required")
        by_session.setdefault(c.session_id, []).append(c)
        if "start_offset_s" in d:
            offsets[c.session_id] = float(d["start_offset_s"])
    sessions = []
    for sid, calls in by_session.items():
        calls.sort(key=lambda c: c.call_index)
        if [c.call_index for c in calls] != list(range(len(calls))):
            raise TraceError(f"{path}: session {sid!r}: call_index must run 0..{len(calls) - 1}")
        if calls[0].append_tokens is not None:
            raise TraceError(f"{path}: session {sid!r}: the first call cannot use append_tokens")
        for prev, c in zip(calls, calls[1:]):
            if c.append_tokens is not None and prev.prompt_tokens is None and prev.append_tokens is None:
                raise TraceError(f"{path}: session {sid!r} call {c.call_index}: append_tokens after a non-token prompt")
        sessions.append(Session(sid, offsets.get(sid, 0.0), calls))
    sessions.sort(key=lambda s: (s.start_offset_s, s.session_id))
    return Workload(sessions, meta)


# ------------------------------------------------------------------------------ prompt resolution
def resolve_prompts(session: Session) -> list[list[int] | str | list[dict[str, Any]]]:
    """The request prompt of every call: token ids (``append_tokens`` expanded against the previous
    prompt), text, or chat messages."""
    out: list[Any] = []
    prev: list[int] | None = None
    for c in session.calls:
        if c.prompt_tokens is not None:
            p: Any = list(c.prompt_tokens)
        elif c.append_tokens is not None:
            assert prev is not None
            p = prev[: c.prefix_tokens] + list(c.append_tokens)
        elif c.prompt_text is not None:
            p = c.prompt_text
        else:
            p = c.messages
        out.append(p)
        prev = p if isinstance(p, list) and (not p or isinstance(p[0], int)) else None
    return out


def prompt_len(p: Any) -> int:
    """Prompt length in tokens (token ids) or an estimate (4 characters per token) for text/messages."""
    if isinstance(p, str):
        return max(1, len(p) // 4)
    if p and isinstance(p[0], dict):
        return max(1, sum(len(str(m.get("content", ""))) for m in p) // 4)
    return len(p)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ------------------------------------------------------------------------------------ statistics
def nearest_rank(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (Talaria §5.1): the observation at rank ceil(q*N/100); NaN if empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(1, math.ceil(q * len(s) / 100.0))
    return float(s[min(k, len(s)) - 1])


def describe(w: Workload) -> dict[str, Any]:
    """The distributions the paper publishes for its characterisation trace, measured on ``w``: session
    depth, gaps, prompt tokens, and the share of continuations that reuse more than half of the prior prompt."""
    depths = [len(s.calls) for s in w.sessions]
    gaps: list[float] = []
    prompts: list[float] = []
    outputs: list[float] = []
    reuse_frac: list[float] = []
    by_tool: dict[str, list[float]] = {}
    for s in w.sessions:
        ps = resolve_prompts(s)
        for i, (c, p) in enumerate(zip(s.calls, ps)):
            prompts.append(prompt_len(p))
            outputs.append(c.output_tokens)
            if i:
                gaps.append(c.gap_s)
                if c.tool is not None:
                    by_tool.setdefault(c.tool, []).append(c.gap_s)
                prior = prompt_len(ps[i - 1])
                reuse_frac.append(c.prefix_tokens / prior if prior else 0.0)
    over_half = sum(1 for r in reuse_frac if r > 0.5)
    return {
        "sessions": len(w.sessions),
        "calls": w.num_calls,
        "models": w.models(),
        "depth_p50": nearest_rank(depths, 50), "depth_p95": nearest_rank(depths, 95), "depth_max": max(depths, default=0),
        "gap_p50_s": nearest_rank(gaps, 50), "gap_p95_s": nearest_rank(gaps, 95),
        "gaps_capped": sum(1 for g in gaps if g > GAP_CAP_S),
        "prompt_p50": nearest_rank(prompts, 50), "prompt_p95": nearest_rank(prompts, 95), "prompt_max": max(prompts, default=0),
        "output_p50": nearest_rank(outputs, 50), "output_p95": nearest_rank(outputs, 95),
        "continuations": len(reuse_frac),
        "reuse_over_half_share": (over_half / len(reuse_frac)) if reuse_frac else float("nan"),
        "total_prompt_tokens": int(sum(prompts)), "total_output_tokens": int(sum(outputs)),
        "last_start_offset_s": max((s.start_offset_s for s in w.sessions), default=0.0),
        "models_per_session_max": max((len({c.model for c in s.calls}) for s in w.sessions), default=0),
        "gap_by_tool": {t: {"n": len(v), "p50_s": nearest_rank(v, 50), "p95_s": nearest_rank(v, 95)}
                        for t, v in sorted(by_tool.items(), key=lambda kv: -len(kv[1]))},
    }
