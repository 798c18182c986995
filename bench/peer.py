"""``talaria bench peer``: the same workloads against Talaria and another OpenAI-compatible server.

What is measured (issue 20 §1)
    Two targets, each an OpenAI-compatible base URL and a served model name: Talaria (``--talaria-url``,
    ``--talaria-model``) and the peer (``--url``, ``--model``), serving the same checkpoint. Every call
    goes through the official ``openai`` client as a streaming ``/v1/completions`` call, greedy
    (temperature 0), with ``stream_options.include_usage`` (the servers' own token counts) and the
    session id as an ``x-session-id`` header (Talaria's session key; other servers ignore it).
    Prompts are text built from a fixed word list, unique per call (a random seed word sequence), so no
    call hits a prefix cache unless the workload shares a prefix on purpose.

    * ``ttft``: one call at a time with a prompt of ~N tokens (default 512 and 2,048), ``max_tokens=1``:
      time from sending to the first streamed text. ``--ttft-calls`` calls per length and repetition.
    * ``decode``: S concurrent streams (default 1, 8, 16), short prompts, ``max_tokens`` =
      ``--decode-tokens`` with ``ignore_eos``: per stream ``(completion_tokens - 1) / (t_last - t_first)``,
      summed over the streams (aggregate decode tokens/s).
    * ``agent``: ``--sessions`` sessions x ``--calls`` calls, run concurrently; each session's first
      prompt has ~``--first-tokens`` tokens, each next prompt is the previous prompt + the answer +
      ~``--turn-tokens`` new tokens, ``--gap`` seconds after an answer before the next call,
      ``max_tokens=--agent-tokens``. SCT = a session's last answer end - its first call start; p50/p95
      over sessions; TTFT of returns = TTFT of calls 2..N (p50/p95).
    * ``agent-chat``: the same sessions as streaming ``/v1/chat/completions`` calls, the way an agent harness
      sends them: a system prompt of ~``--system-tokens`` tokens shared by every session of a repetition (new
      per repetition, so no repetition finds the previous one's), a first user turn making the first prompt
      ~``--first-tokens``, then per call the answer as an assistant message and a ~``--turn-tokens`` user
      (tool result) message. All sessions start together, so their first calls arrive together and share
      the system prompt: besides SCT and the returns' TTFT it reports the first calls' TTFT and the prompt
      tokens the server reports cached for them (``usage.prompt_tokens_details.cached_tokens``).

    ``agent-chat`` counts failed calls (``chat_failed_calls``; a failed call ends its session); in the other
    workloads a failed call fails the run.

    What Talaria runs: ``--talaria-config FILE`` names the stack config the Talaria target was started with
    (``talaria up --config FILE``; ``default`` = the embedded defaults ``talaria up`` ships); the report prints
    its effective engine and kvstore settings (defaults filled in) and says when the host KV tier is off,
    which is not what users of the default stack run.

    ``--multi`` (``bench/peer_multi.py``) compares two models instead: one Talaria stack serving both against
    one peer server per model (``--peer MODEL=URL`` twice), on the matrix's two-model agent workload.

    Token counts of the prompts are calibrated once on the Talaria target (``usage.prompt_tokens`` of a
    probe call, tokens per word); both targets get the very same texts.

How it is reported
    Repetitions are interleaved: in every repetition each workload runs on both targets back to back, the
    order alternating (Talaria first in even repetitions, the peer first in odd ones), so load on a shared
    machine hits both alike. Per metric: the median over repetitions (>= 3 by default) of each target, and
    the ratio oriented so that > 1 means Talaria is better (peer/Talaria for times, Talaria/peer for rates);
    beside it the same ratio paired within each repetition (median [min-max], repetitions won), where the
    machine's state of a repetition, shared by both targets, cancels. Before each repetition, with both servers
    idle, a probe of the machine's speed (``bench/machine.py``) whose samples end the report.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from bench import emit, format_table, median, percentile

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will can more about said up out my what "
    "time could them into other these only some than then now its also two first any like over new after most "
    "years people way made many state before did work long through where much should well great back good water "
    "little world very still own see men place old such three year house might part while life came small last "
    "never under city found going number around went because both between each point right show school system "
    "program file directory command error output function return value test build server request token model"
).split()


argparse_like = Any  # the parsed ``talaria bench peer`` arguments (see add_args)


@dataclass(slots=True)
class Target:
    name: str
    url: str
    model: str
    client: Any = field(default=None, repr=False)
    texts: list[str] = field(default_factory=list)  # every completion's text, in completion order


@dataclass(slots=True)
class CallResult:
    ttft: float
    t_first: float
    t_end: float
    completion_tokens: int
    prompt_tokens: int
    text: str
    cached_tokens: int = 0


def make_text(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def call(t: Target, prompt: str, max_tokens: int, session: str = "", ignore_eos: bool = False) -> CallResult:
    """One streaming completion; times measured here (perf_counter), token counts from the server."""
    extra = {"ignore_eos": True} if ignore_eos else None
    headers = {"x-session-id": session} if session else None
    t0 = time.perf_counter()
    stream = await t.client.completions.create(
        model=t.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra, extra_headers=headers,
    )
    t_first = 0.0
    text: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if not t_first:
                t_first = time.perf_counter()
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    t_end = time.perf_counter()
    t_first = t_first or t_end
    t.texts.append("".join(text))
    return CallResult(t_first - t0, t_first, t_end, usage.completion_tokens if usage else len(text),
                      usage.prompt_tokens if usage else 0, "".join(text))


async def chat_call(t: Target, messages: list[dict], max_tokens: int, session: str) -> CallResult:
    """One streaming chat completion (greedy); like ``call``, plus the cached prompt tokens the server reports."""
    t0 = time.perf_counter()
    stream = await t.client.chat.completions.create(
        model=t.model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-session-id": session},
    )
    t_first = 0.0
    text: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
            if not t_first:
                t_first = time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    t_end = time.perf_counter()
    t_first = t_first or t_end
    t.texts.append("".join(text))
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    return CallResult(t_first - t0, t_first, t_end, usage.completion_tokens if usage else len(text),
                      usage.prompt_tokens if usage else 0, "".join(text), cached)


async def ttft_workload(t: Target, lengths: list[int], calls: int, words_per_token: float, rng: random.Random) -> dict[str, float]:
    out = {}
    for n in lengths:
        xs = [(await call(t, make_text(max(1, round(n * words_per_token)), rng), 1)).ttft for _ in range(calls)]
        out[f"ttft_{n}_s"] = median(xs)
    return out


async def decode_workload(t: Target, streams: list[int], tokens: int, rng: random.Random) -> dict[str, float]:
    out = {}
    for s in streams:
        prompts = [make_text(24, rng) for _ in range(s)]
        res = await asyncio.gather(*(call(t, p, tokens, ignore_eos=True) for p in prompts))
        out[f"decode_{s}_tok_s"] = sum((r.completion_tokens - 1) / (r.t_end - r.t_first) for r in res if r.t_end > r.t_first)
    return out


async def _session(t: Target, sid: str, a: argparse_like, wpt: float, rng: random.Random) -> tuple[float, list[float]]:
    prompt = make_text(round(a.first_tokens * wpt), rng)
    start = time.perf_counter()
    returns: list[float] = []
    for k in range(a.calls):
        r = await call(t, prompt, a.agent_tokens, session=sid)
        if k:
            returns.append(r.ttft)
        if k + 1 < a.calls:
            prompt = prompt + r.text + " " + make_text(round(a.turn_tokens * wpt), rng)
            await asyncio.sleep(a.gap)
    return time.perf_counter() - start, returns


async def agent_workload(t: Target, a: argparse_like, wpt: float, rng: random.Random, tag: str) -> dict[str, float]:
    seeds = [rng.randrange(1 << 30) for _ in range(a.sessions)]
    res = await asyncio.gather(*(_session(t, f"peer-{tag}-{i}", a, wpt, random.Random(seeds[i])) for i in range(a.sessions)))
    scts = [r[0] for r in res]
    rets = [x for r in res for x in r[1]]
    return {"sct_p50_s": percentile(scts, 50), "sct_p95_s": percentile(scts, 95),
            "return_ttft_p50_s": percentile(rets, 50), "return_ttft_p95_s": percentile(rets, 95)}


async def _chat_session(t: Target, sid: str, system: str, a: argparse_like, wpt: float, rng: random.Random) -> dict[str, Any]:
    first_words = max(1, round((a.first_tokens - a.system_tokens) * wpt))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": make_text(first_words, rng)}]
    start = time.perf_counter()
    out: dict[str, Any] = {"returns": [], "first": None, "failed": 0, "sct": None}
    for k in range(a.calls):
        try:
            r = await chat_call(t, messages, a.agent_tokens, sid)
        except Exception:  # noqa: BLE001 - a failed call is counted and ends the session (it cannot go on)
            out["failed"] += 1
            return out
        if k:
            out["returns"].append(r.ttft)
        else:
            out["first"] = r
        if k + 1 < a.calls:
            messages = messages + [{"role": "assistant", "content": r.text},
                                   {"role": "user", "content": make_text(round(a.turn_tokens * wpt), rng)}]
            await asyncio.sleep(a.gap)
    out["sct"] = time.perf_counter() - start
    return out


async def agent_chat_workload(t: Target, a: argparse_like, wpt: float, rng: random.Random, tag: str) -> dict[str, float]:
    system = "You are a coding agent. " + make_text(max(1, round(a.system_tokens * wpt)), rng)
    seeds = [rng.randrange(1 << 30) for _ in range(a.sessions)]
    res = await asyncio.gather(*(_chat_session(t, f"chat-{tag}-{i}", system, a, wpt, random.Random(seeds[i])) for i in range(a.sessions)))
    scts = [r["sct"] for r in res if r["sct"] is not None]
    rets = [x for r in res for x in r["returns"]]
    firsts = [r["first"] for r in res if r["first"] is not None]
    nan = float("nan")
    return {"chat_sct_p50_s": percentile(scts, 50) if scts else nan, "chat_sct_p95_s": percentile(scts, 95) if scts else nan,
            "chat_return_ttft_p50_s": percentile(rets, 50) if rets else nan,
            "chat_first_ttft_p50_s": percentile([f.ttft for f in firsts], 50) if firsts else nan,
            "chat_first_cached_tokens": float(sum(f.cached_tokens for f in firsts)),
            "chat_failed_calls": float(sum(r["failed"] for r in res))}


HIGHER_IS_BETTER = ("_tok_s", "_cached_tokens")


async def run_peer_bench(a: argparse_like, say=print) -> dict[str, Any]:
    """Run every selected workload on both targets, interleaved, ``a.repeats`` times (see module doc)."""
    import openai

    targets = [Target("talaria", a.talaria_url, a.talaria_model or a.model), Target("peer", a.url, a.model)]
    for t in targets:
        t.client = openai.AsyncOpenAI(base_url=t.url, api_key="bench", timeout=a.timeout, max_retries=0)
    probe = await call(targets[0], make_text(400, random.Random(a.seed)), 1)
    wpt = 400 / probe.prompt_tokens if probe.prompt_tokens else 0.75
    say(f"calibration: 400 words = {probe.prompt_tokens} tokens on {targets[0].name}")
    runs: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
    machine: list[dict[str, Any]] = []
    for rep in range(a.repeats):
        machine.append(probe_machine(a))  # both servers idle here: the machine's speed for this repetition
        order = targets if rep % 2 == 0 else targets[::-1]
        per: dict[str, dict[str, float]] = {t.name: {} for t in targets}
        for wl in a.workloads:
            for t in order:
                rng = random.Random(f"{a.seed}-{rep}-{wl}")  # same texts for both targets, new ones per repetition
                if wl == "ttft":
                    per[t.name].update(await ttft_workload(t, a.ttft_lengths, a.ttft_calls, wpt, rng))
                elif wl == "decode":
                    per[t.name].update(await decode_workload(t, a.streams, a.decode_tokens, rng))
                elif wl == "agent-chat":
                    per[t.name].update(await agent_chat_workload(t, a, wpt, rng, f"{t.name}-{rep}-{a.seed}"))
                else:
                    per[t.name].update(await agent_workload(t, a, wpt, rng, f"{t.name}-{rep}-{a.seed}"))
        for t in targets:
            runs[t.name].append(per[t.name])
        say(f"  repetition {rep + 1}/{a.repeats}: " + ", ".join(f"{k} {per['talaria'][k]:.3g} vs {per['peer'][k]:.3g}" for k in per["talaria"]))
    for t in targets:
        await t.client.close()
    rows = compare_runs(runs)
    # greedy, same texts: two servers of the same checkpoint should produce the same completions
    agree = sum(x == y for x, y in zip(sorted(targets[0].texts[1:]), sorted(targets[1].texts))) / max(len(targets[1].texts), 1)
    return {"bench": "peer", "talaria": {"url": a.talaria_url, "model": targets[0].model, "config": effective_config(a.talaria_config)},
            "peer": {"url": a.url, "model": a.model},
            "repeats": a.repeats, "words_per_token": wpt, "rows": rows, "runs": runs, "identical_completions": agree,
            "machine": machine}


def compare_runs(runs: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Per metric: each side's median over repetitions and Talaria's advantage of the medians (> 1 = better),
    plus the advantage paired within each repetition (both sides ran it back to back, so the machine's state of
    that repetition cancels): its median, min and max and the repetitions Talaria won. Pure."""
    rows = []
    for metric in runs["talaria"][0]:
        mine = [r[metric] for r in runs["talaria"]]
        peer = [r[metric] for r in runs["peer"]]
        ours, theirs = median(mine), median(peer)
        better_high = metric.endswith(HIGHER_IS_BETTER)

        def adv(o: float, t: float) -> float:
            return (o / t if better_high else t / o) if o and t else float("nan")

        paired = [x for x in (adv(o, t) for o, t in zip(mine, peer)) if math.isfinite(x)]
        rows.append({"metric": metric, "talaria": ours, "peer": theirs, "talaria_advantage": adv(ours, theirs),
                     "paired": {"median": median(paired), "min": min(paired), "max": max(paired),
                                "won": sum(x > 1 for x in paired), "n": len(paired)} if paired else None})
    return rows


def probe_machine(a: argparse_like) -> dict[str, Any]:
    """One ``bench.machine`` sample, or ``{}`` under ``--no-probe`` (the report then says it was not probed)."""
    if getattr(a, "no_probe", False):
        return {}
    from bench.machine import probe

    return probe()


def effective_config(path: str | None) -> dict[str, Any] | None:
    """The engine and kvstore settings of the stack config ``path`` with every default filled in (``default``:
    the embedded defaults of ``talaria up``); None when not given. Adds ``host_kv_on`` per engine: its tier is
    on only when the engine asks for it and the stack runs a kvstore."""
    if not path:
        return None
    from talaria.config import StackConfig, load_config

    cfg = StackConfig() if path == "default" else load_config(path)
    engines = []
    for e in cfg.engines:
        d = e.model_dump(mode="json")
        d["host_kv_on"] = bool(e.host_kv and cfg.kvstore.enabled)
        engines.append(d)
    return {"source": path, "engines": engines, "kvstore": cfg.kvstore.model_dump(mode="json", exclude={"auth_token"}),
            "telemetry_enabled": cfg.telemetry.enabled}


def render_config(c: dict[str, Any] | None) -> str:
    if c is None:
        return "Talaria's configuration: not given (--talaria-config FILE|default); the numbers may not be the default stack's"
    keys = ("id", "pool", "models", "dtype", "torch_threads", "kv_cache_mb", "host_kv_on", "host_kv_write_policy", "omp_spin_count")
    lines = [f"Talaria's effective configuration ({c['source']}): telemetry {'on' if c['telemetry_enabled'] else 'off'}, "
             f"kvstore {'on' if c['kvstore']['enabled'] else 'OFF'}"]
    for e in c["engines"]:
        lines.append("  engine " + ", ".join(f"{k}={e.get(k)}" for k in keys))
        if not e["host_kv_on"]:
            lines.append("  NOTE: this engine's host KV tier is off -- not what the default stack (`talaria up`) runs")
    return "\n".join(lines)


def render(r: dict[str, Any]) -> str:
    from bench.machine import render_samples

    head = (f"peer bench: Talaria {r['talaria']['model']} at {r['talaria']['url']} vs peer {r['peer']['model']} at "
            f"{r['peer']['url']}; medians of {r['repeats']} interleaved repetitions; advantage > 1 = Talaria better\n"
            + render_config(r["talaria"].get("config")))

    def paired(x: dict[str, Any]) -> str:
        p = x.get("paired")
        return f"{p['median']:.3f} [{p['min']:.2f}-{p['max']:.2f}] won {p['won']}/{p['n']}" if p else "n/a"

    table = format_table(["metric", "talaria", "peer", "talaria advantage", "paired per repetition"],
                         [[x["metric"], x["talaria"], x["peer"], x["talaria_advantage"], paired(x)] for x in r["rows"]])
    return (f"{head}\n\n{table}\n\nidentical completions (greedy, sanity, not a gate): {r['identical_completions']:.0%}\n"
            + render_samples(r.get("machine", [])))


def add_args(p) -> None:
    p.add_argument("--url", help="the peer's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (required without --multi)")
    p.add_argument("--model", help="the peer's served model name (required without --multi)")
    p.add_argument("--talaria-url", default="http://127.0.0.1:8080/v1", help="Talaria's OpenAI base URL (default http://127.0.0.1:8080/v1)")
    p.add_argument("--talaria-model", default="", help="Talaria's model name (default: --model)")
    p.add_argument("--talaria-config", default=None, metavar="FILE|default",
                   help="the stack config Talaria was started with (`default`: talaria up's embedded defaults); its effective settings go into the report")
    p.add_argument("--workloads", nargs="+", default=["ttft", "decode", "agent"], choices=["ttft", "decode", "agent", "agent-chat"])
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; medians are reported (default 3)")
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=[512, 2048], help="prompt tokens of the TTFT workload")
    p.add_argument("--ttft-calls", type=int, default=3, help="sequential calls per length and repetition (default 3)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16], help="concurrent streams of the decode workload")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per stream (ignore_eos) (default 64)")
    p.add_argument("--sessions", type=int, default=8, help="agent sessions of agent / agent-chat / --multi (default 8)")
    p.add_argument("--calls", type=int, default=8, help="calls per session (default 8)")
    p.add_argument("--first-tokens", type=int, default=800, help="first prompt of a session, tokens (default 800)")
    p.add_argument("--system-tokens", type=int, default=300, help="agent-chat: shared system prompt, tokens (default 300)")
    p.add_argument("--turn-tokens", type=int, default=200, help="new tokens per turn (default 200)")
    p.add_argument("--agent-tokens", type=int, default=32, help="max_tokens of an agent call (default 32)")
    p.add_argument("--gap", type=float, default=0.4, help="seconds between an answer and the next call (default 0.4)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-call timeout, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the machine-speed probe before each repetition (bench/machine.py; ~0.5 s, servers idle)")
    from bench.peer_multi import add_args as add_multi_args

    add_multi_args(p)


def main(args) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.multi:
        from bench.peer_multi import main as multi_main

        return multi_main(args)
    if not args.url or not args.model:
        raise SystemExit("talaria bench peer: --url and --model are required (or --multi with --peer MODEL=URL twice)")
    result = asyncio.run(run_peer_bench(args))
    return emit(result, render(result), args.json)
