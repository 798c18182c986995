"""Importer of the Mooncake trace format (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``: one id per 512-token prefix block, equal ids = reusable KV) into Talaria's replay format. The
public trace file is not in the repository: ``traces.py`` finds it (``--mooncake FILE``, else
``$TALARIA_TRACES_DIR``, else ``data/traces/``; ``data/traces/README.md`` says where it comes from).

Sessions are not labelled in that trace; they are derived from shared ``hash_ids`` chains:

* for each request (in timestamp order) find the longest run of leading blocks already seen; if it is at
  least ``min_shared_blocks`` (default 2) long, the request continues the conversation of the latest
  earlier request that holds the run's last block;
* it joins that request's session only if it *extends* that request's chain (shares every block of it but
  the last, which is partial and changes when the prompt grows) and that request is still the session's
  newest call; otherwise (a branch off an older turn, a shared system prompt) it starts a new session —
  the shared blocks are still real cross-session KV reuse in the replay.

On the shipped trace this gives 2,725 sessions, 348 of them with two or more calls (p95 depth 5, max 15).

Scaling (stated in the workload's meta and the report): token lengths x ``length_scale`` (block size
becomes ``round(512 x length_scale)`` tokens, prompts are clipped to ``max_prompt``), times x
``time_scale``. The trace has request *start* times only, so a recorded gap is the difference of two
start times (it includes the previous call's service time on the recording system), scaled.

Prompts are token ids: block ``h`` is a fixed pseudo-random token sequence seeded by ``(seed, h)``, so equal
``hash_ids`` give equal tokens and the prefix reuse is real. Models are assigned to sessions round-robin
in a seeded order. Only sessions with at least ``min_depth`` calls are kept; of those the ``sessions``
earliest (by first timestamp) are replayed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from bench.workloads import Call, Session, Workload, common_prefix
from bench.workloads.traces import MOONCAKE, trace_path

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class MooncakeParams:
    path: str | None = None  # None: found by bench/workloads/traces.py ($TALARIA_TRACES_DIR, else data/traces/)
    sessions: int = 12
    min_depth: int = 2
    models: tuple[str, ...] = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
    seed: int = 0
    length_scale: float = 1 / 16
    time_scale: float = 1 / 100
    max_prompt: int = 3584
    max_output: int = 256
    min_shared_blocks: int = 2
    vocab: int = 4096


def derive_sessions(records: list[dict], min_shared_blocks: int = 2) -> list[list[int]]:
    """Indices of ``records`` grouped into sessions (each in timestamp order), sessions by first call."""
    order = sorted(range(len(records)), key=lambda i: (records[i]["timestamp"], i))
    owner: dict[int, int] = {}  # block id -> latest request holding it
    session_of: dict[int, int] = {}
    sessions: list[list[int]] = []
    for i in order:
        h = records[i]["hash_ids"]
        j = 0
        while j < len(h) and h[j] in owner:
            j += 1
        sid = None
        if j >= min_shared_blocks:
            parent = owner[h[j - 1]]
            s = session_of[parent]
            if sessions[s][-1] == parent and j >= len(records[parent]["hash_ids"]) - 1:
                sid = s
        if sid is None:
            sid = len(sessions)
            sessions.append([])
        sessions[sid].append(i)
        session_of[i] = sid
        for b in h:
            owner[b] = i
    return sessions


def import_mooncake(p: MooncakeParams) -> Workload:
    path = trace_path(MOONCAKE, p.path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups = [g for g in derive_sessions(records, p.min_shared_blocks) if len(g) >= p.min_depth][: p.sessions]
    rng = random.Random(p.seed)
    order = list(p.models)
    rng.shuffle(order)
    block = max(1, round(BLOCK_TOKENS * p.length_scale))
    cache: dict[int, list[int]] = {}

    def block_tokens(h: int) -> list[int]:
        if h not in cache:
            r = random.Random(p.seed * 1_000_003 + h)
            cache[h] = [r.randrange(3, p.vocab) for _ in range(block)]
        return cache[h]

    t0 = min((records[g[0]]["timestamp"] for g in groups), default=0)
    sessions: list[Session] = []
    for si, g in enumerate(groups):
        sid = f"mc-{si:04d}"
        model = order[si % len(order)]
        calls: list[Call] = []
        prev: list[int] | None = None
        for ci, idx in enumerate(g):
            r = records[idx]
            n = max(1, min(p.max_prompt, round(r["input_length"] * p.length_scale)))
            toks: list[int] = []
            for h in r["hash_ids"]:
                toks += block_tokens(h)
                if len(toks) >= n:
                    break
            toks = toks[:n]
            if len(toks) < n:  # input_length past the listed blocks: pad deterministically
                need = n - len(toks)
                toks += (block_tokens(-(idx + 1)) * (need // block + 1))[:need]
            out = max(1, min(p.max_output, round(r["output_length"] * p.length_scale)))
            if prev is None:
                calls.append(Call(sid, 0, model, out, 0.0, 0, prompt_tokens=toks))
            else:
                keep = common_prefix(prev, toks)
                gap = max(0.0, (r["timestamp"] - records[g[ci - 1]]["timestamp"]) / 1000.0 * p.time_scale)
                calls.append(Call(sid, ci, model, out, gap, keep, append_tokens=toks[keep:] or toks[-1:]))
                if not toks[keep:]:  # identical prompt: re-send the last token so the call has one new token
                    calls[-1].prefix_tokens = keep = len(toks) - 1
            prev = toks
        sessions.append(Session(sid, (records[g[0]]["timestamp"] - t0) / 1000.0 * p.time_scale, calls))
    meta = {
        "source": f"Mooncake trace {path.name} (bench/workloads/mooncake.py)",
        "seed": p.seed,
        "length_scale": p.length_scale,
        "time_scale": p.time_scale,
        "block_tokens": block,
        "max_prompt": p.max_prompt,
        "min_depth": p.min_depth,
        "models": list(p.models),
    }
    return Workload(sessions, meta)
