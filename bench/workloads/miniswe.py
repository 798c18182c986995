"""Importer of the public mini-swe-agent trace (``lmcache_miniswe_trace.jsonl.gz``: 20 real sessions on
SWE-bench Django tasks, 402 calls with full prompt and response text) into Talaria's replay format. The file is
not in the repository: ``traces.py`` finds it (``--miniswe FILE``, else ``$TALARIA_TRACES_DIR``, else
``data/traces/``; ``data/traces/README.md`` says where it comes from).

The source: one JSON object per call — ``timestamp`` (µs, request start),
``input`` (the prompt text), ``output`` (the response text), ``session_id``. Within a session (sorted by
timestamp; the file order is scrambled) ``input`` grows append-only: call ``i+1``'s input is call ``i``'s
input followed by the observation of the command call ``i`` ran. The responses are not in the inputs; as in
the recorded conversation, each response sits between the input it answered and the next observation, so
the full prompt of call ``i`` is

    in_0 + out_0 + (in_1 − in_0) + out_1 + … + out_{i−1} + (in_i − in_{i−1}).

Tokens. The replay sends token ids (``/v1/completions``); text becomes ids by cutting each segment above into
chunks of ``chars_per_token`` characters (default ``4 / length_scale``: the usual ~4 characters per token,
scaled) and hashing every chunk (with the seed) into ``[3, vocab)``. Segments are cut separately, so call
``i``'s prompt is a true token prefix of call ``i+1``'s, and equal text gives equal ids: the KV reuse the
replay offers is the reuse of the real prompts (p50 96 % of the previous prompt). Output tokens: the
response length in tokens at the same scale (at least 1, at most ``max_output``). A session is cut before
the first call whose prompt would exceed ``max_prompt`` (stated in the meta as ``calls_dropped``).

Tools. Each response ends with the one shell command mini-swe-agent ran (a fenced ``bash`` block). The
command's program (``tool_of``: the first word of the first segment that is not a ``cd``, env assignments
skipped, path stripped) is the ``tool`` of the *next* call, i.e. the tool whose run the gap before that
call contains. A response without a command (the final submission) gives no tool.

Times (stated in the meta). The trace has request *start* times only, so a recorded gap is the difference
of two start times: it includes the previous call's service time on the recording system (p50 1.08 s,
p95 2.35 s) — an upper bound of the tool time, as in the Mooncake importer; times x ``time_scale``. The
20 sessions were recorded one after another (no overlap), so their recorded start offsets would replay
them sequentially; instead sessions start as a seeded Poisson process with mean ``mean_interarrival_s``
(in recorded order; ``mean_interarrival_s=None`` keeps the recorded offsets x ``time_scale``). Models are
assigned to sessions round-robin in a seeded order. The ``sessions`` first sessions (recorded order) are kept.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

from bench.workloads import Call, Session, Workload
from bench.workloads.traces import MINISWE, trace_path

_BASH = re.compile(r"```bash\s*\n(.*?)```", re.S)
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True, slots=True)
class MiniSweParams:
    path: str | None = None  # None: found by bench/workloads/traces.py ($TALARIA_TRACES_DIR, else data/traces/)
    sessions: int = 20
    models: tuple[str, ...] = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
    seed: int = 0
    length_scale: float = 1 / 16  # tokens x this (156K characters, the longest session, -> ~2.4K tokens)
    time_scale: float = 1.0
    mean_interarrival_s: float | None = 2.0  # None: recorded start offsets (sequential sessions)
    max_prompt: int = 3584
    max_output: int = 256
    vocab: int = 4096

    @property
    def chars_per_token(self) -> int:
        return max(1, round(4 / self.length_scale))


def tool_of(output: str) -> str | None:
    """The program the response's last ``bash`` block runs (``cd X && pytest ...`` -> ``pytest``), or None."""
    blocks = _BASH.findall(output)
    if not blocks:
        return None
    for seg in re.split(r"&&|\|\||;|\|", blocks[-1].strip()):
        words = [w for w in seg.split() if not _ASSIGN.match(w)]
        if words and words[0] not in ("cd", "sudo", "time", "env"):
            return os.path.basename(words[0]) or None
        if words and words[0] in ("sudo", "time", "env") and len(words) > 1:
            return os.path.basename(words[1]) or None
    return None


def text_tokens(text: str, chars_per_token: int, seed: int, vocab: int) -> list[int]:
    """Deterministic ids for ``text``: one id per ``chars_per_token`` characters (the last chunk may be
    shorter), a hash of (seed, chunk) in ``[3, vocab)``. Pure: equal text, equal ids."""
    out = []
    for i in range(0, len(text), chars_per_token):
        h = hashlib.blake2b(text[i : i + chars_per_token].encode(), digest_size=8, key=str(seed).encode()).digest()
        out.append(3 + int.from_bytes(h, "little") % (vocab - 3))
    return out


def read_sessions(path: str | Path) -> list[list[dict]]:
    """The trace's sessions in recorded order (by first timestamp), each sorted by timestamp."""
    opener = gzip.open if str(path).endswith(".gz") else open
    by: dict[str, list[dict]] = {}
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                by.setdefault(str(r["session_id"]), []).append(r)
    groups = [sorted(g, key=lambda r: r["timestamp"]) for g in by.values()]
    return sorted(groups, key=lambda g: (g[0]["timestamp"], g[0]["session_id"]))


def _segments(records: list[dict]) -> list[tuple[str, str]]:
    """Per call: (the text its prompt adds after the previous call's prompt + response, its response).
    An input that does not extend the previous one (not seen in the shipped trace) raises."""
    out, prev = [], ""
    for r in records:
        inp = r["input"]
        if not inp.startswith(prev):
            raise ValueError(f"session {r['session_id']}: input is not an append-only extension of the previous one")
        out.append((inp[len(prev):], r["output"]))
        prev = inp
    return out


def import_miniswe(p: MiniSweParams) -> Workload:
    path = trace_path(MINISWE, p.path)
    groups = read_sessions(path)[: p.sessions]
    rng = random.Random(p.seed)
    order = list(p.models)
    rng.shuffle(order)
    cpt = p.chars_per_token
    tok = lambda t: text_tokens(t, cpt, p.seed, p.vocab)  # noqa: E731
    t_first = groups[0][0]["timestamp"] if groups else 0
    sessions: list[Session] = []
    dropped = 0
    start = 0.0
    for si, g in enumerate(groups):
        sid = f"mswe-{si:02d}-{g[0]['session_id'][:8]}"
        model = order[si % len(order)]
        calls: list[Call] = []
        prompt_len = 0
        prev_out: list[int] = []
        for ci, ((added, output), r) in enumerate(zip(_segments(g), g)):
            append = prev_out + tok(added)
            if not append or prompt_len + len(append) > p.max_prompt:
                dropped += len(g) - ci
                break
            out_tokens = tok(output)
            n_out = max(1, min(p.max_output, len(out_tokens)))
            if ci == 0:
                calls.append(Call(sid, 0, model, n_out, prompt_tokens=append))
            else:
                gap = max(0.0, (r["timestamp"] - g[ci - 1]["timestamp"]) / 1e6 * p.time_scale)
                calls.append(Call(sid, ci, model, n_out, gap, prompt_len, append_tokens=append, tool=tool_of(g[ci - 1]["output"])))
            prompt_len += len(append)
            prev_out = out_tokens
        if p.mean_interarrival_s is None:
            start = (g[0]["timestamp"] - t_first) / 1e6 * p.time_scale
        elif si:
            start += rng.expovariate(1.0 / p.mean_interarrival_s)
        if calls:
            sessions.append(Session(sid, start, calls))
    meta = {
        "source": f"mini-swe-agent trace {path.name} (bench/workloads/miniswe.py)",
        "seed": p.seed,
        "length_scale": p.length_scale,
        "chars_per_token": cpt,
        "time_scale": p.time_scale,
        "gaps": "start-to-start differences: include the recording system's service time (upper bound of tool time)",
        "session_starts": "recorded offsets" if p.mean_interarrival_s is None else f"Poisson, mean {p.mean_interarrival_s} s (recorded order)",
        "max_prompt": p.max_prompt,
        "calls_dropped": dropped,
        "models": list(p.models),
    }
    return Workload(sessions, meta)
