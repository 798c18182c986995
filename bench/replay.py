"""``talaria bench replay``: closed-loop fixed replay of a workload against a running stack (Talaria §5.1,
Appendix A), through the public OpenAI-compatible HTTP API with a real HTTP client (``httpx``, streaming).

What is held fixed
    Per session: the call order, the request bodies (prompt token ids / text / messages, ``temperature 0``,
    ``max_tokens`` = the recorded completion-token count with ``ignore_eos: true`` so every call produces
    exactly that many tokens), the model and the session id (header ``X-Session-ID``), and the recorded gaps.

Closed loop
    Session ``s`` starts at ``t0 + start_offset_s``. Call ``k > 0`` is *released* (its intended enqueue
    time) when call ``k-1`` of the same session has finished and its gap, capped at 10 s, has elapsed:
    ``intended[k] = end[k-1] + min(gap[k], 10)``. The global interleaving therefore depends on how fast the
    system under test answers, as in the paper. A 429/503 answer is retried after its ``Retry-After``
    (the retries stay inside the call: its intended time does not move).

What is recorded per call (client clock, ``time.monotonic`` relative to the run start, plus the wall time
of the start so records can be aligned with telemetry): intended enqueue time, send time, first token
(first streamed chunk with text), last token, end of response; HTTP status, retries, the instance and
placement reason the router answered with (``X-Talaria-Instance`` / ``X-Talaria-Placement``), usage
(prompt, completion, cached tokens).

Derived (``bench/report.py``): schedule-aware TTFT = first token - intended enqueue; SCT = end of a
session's last response - intended enqueue of its first call; nearest-rank percentiles.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.workloads import GAP_CAP_S, Call, Session, Workload, prompt_len, resolve_prompts

MAX_RETRIES = 200  # 429/503 answers retried per call (each after its Retry-After)


@dataclass(slots=True)
class CallResult:
    session_id: str
    call_index: int
    model: str
    intended: float  # s since run start: when the schedule released the call
    sent: float = float("nan")  # the (last) request was sent
    first_token: float = float("nan")
    last_token: float = float("nan")
    end: float = float("nan")  # the response finished (or failed)
    status: int = 0
    error: str = ""
    retries: int = 0
    instance: str = ""
    placement: str = ""
    prompt_tokens: int = 0  # usage reported by the server
    completion_tokens: int = 0
    cached_tokens: int = 0
    restored_tokens: int | None = None  # of the cached tokens, restored from host KV (None: server did not say)
    recorded_prompt_tokens: int = 0  # from the trace
    recorded_prefix_tokens: int = 0
    recorded_output_tokens: int = 0
    gap_applied_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        """Schedule-aware TTFT (from the intended enqueue time)."""
        return self.first_token - self.intended

    @property
    def ttft_request(self) -> float:
        """Request-local TTFT (from the moment the successful request was sent)."""
        return self.first_token - self.sent


@dataclass(slots=True)
class Outcome:
    """What one HTTP exchange produced (``send`` fills it; timestamps are absolute clock values)."""

    status: int = 0
    error: str = ""
    retry_after_s: float | None = None
    first_token: float = float("nan")
    last_token: float = float("nan")
    end: float = float("nan")
    instance: str = ""
    placement: str = ""
    usage: dict[str, Any] = field(default_factory=dict)


Send = Callable[[Session, Call, Any, float], Awaitable[Outcome]]  # (session, call, prompt, sent_at) -> outcome


@dataclass(slots=True)
class ReplayResult:
    calls: list[CallResult]
    start_wall: float  # time.time() at run start (t = 0 of every CallResult timestamp)
    wall_s: float  # run duration
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"start_wall": self.start_wall, "wall_s": self.wall_s, "meta": self.meta, "calls": [asdict(c) for c in self.calls]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReplayResult":
        return cls([CallResult(**c) for c in d["calls"]], d["start_wall"], d["wall_s"], d.get("meta", {}))


async def replay(
    workload: Workload,
    send: Send,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    gap_cap_s: float = GAP_CAP_S,
    on_call_done: Callable[[CallResult], None] | None = None,
    max_retries: int = MAX_RETRIES,
) -> ReplayResult:
    """Run every session as its own closed loop; ``send`` performs one HTTP exchange. Pure scheduling:
    the clock and sleep are injected (the unit tests drive it with a virtual clock)."""
    t0 = clock()
    wall0 = time.time()
    results: list[CallResult] = []

    async def until(t: float) -> None:
        d = t - clock()
        if d > 0:
            await sleep(d)

    async def run_session(s: Session) -> None:
        prompts = resolve_prompts(s)
        intended = t0 + s.start_offset_s
        for i, (c, p) in enumerate(zip(s.calls, prompts)):
            gap = min(c.gap_s, gap_cap_s) if i else 0.0
            if i:
                intended = results_by_session[s.session_id][-1].end + t0 + gap
            r = CallResult(
                s.session_id, c.call_index, c.model, intended - t0,
                recorded_prompt_tokens=prompt_len(p), recorded_prefix_tokens=c.prefix_tokens,
                recorded_output_tokens=c.output_tokens, gap_applied_s=gap,
            )
            await until(intended)
            out = Outcome()
            for attempt in range(max_retries + 1):
                r.sent = clock() - t0
                out = await send(s, c, p, r.sent + t0)
                if out.status in (429, 503) and attempt < max_retries:
                    r.retries += 1
                    await sleep(max(0.05, out.retry_after_s if out.retry_after_s is not None else 1.0))
                    continue
                break
            r.status, r.error = out.status, out.error
            r.first_token = out.first_token - t0
            r.last_token = out.last_token - t0
            r.end = (out.end if out.end == out.end else clock()) - t0
            r.instance, r.placement = out.instance, out.placement
            u = out.usage or {}
            r.prompt_tokens = int(u.get("prompt_tokens", 0) or 0)
            r.completion_tokens = int(u.get("completion_tokens", 0) or 0)
            details = u.get("prompt_tokens_details") or {}
            r.cached_tokens = int(details.get("cached_tokens", 0) or 0)
            if "restored_tokens" in details:  # Talaria extension: exact host-KV share of the cached tokens
                r.restored_tokens = int(details["restored_tokens"] or 0)
            results_by_session[s.session_id].append(r)
            results.append(r)
            if on_call_done is not None:
                on_call_done(r)

    results_by_session: dict[str, list[CallResult]] = {s.session_id: [] for s in workload.sessions}
    await asyncio.gather(*(run_session(s) for s in workload.sessions))
    results.sort(key=lambda r: (r.session_id, r.call_index))
    return ReplayResult(results, wall0, clock() - t0, {"workload": workload.meta, "gap_cap_s": gap_cap_s})


# --------------------------------------------------------------------------------- HTTP client
class HttpSender:
    """One streaming OpenAI-API call per ``send`` over a shared ``httpx.AsyncClient``.

    Token-id and text prompts go to ``/v1/completions``, chat messages to ``/v1/chat/completions``; the
    body asks for ``max_tokens`` = the recorded output count, ``ignore_eos`` (the router's extension for
    fixed-length replays), greedy sampling and a final usage chunk."""

    def __init__(self, api: str, *, timeout_s: float = 600.0, max_connections: int = 256, clock: Callable[[], float] = time.monotonic):
        import httpx

        self.api = api.rstrip("/")
        self.clock = clock
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    @staticmethod
    def body(call: Call, prompt: Any) -> tuple[str, dict[str, Any]]:
        common = {
            "model": call.model,
            "max_tokens": call.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return "/v1/chat/completions", {**common, "messages": prompt}
        return "/v1/completions", {**common, "prompt": prompt}

    async def __call__(self, session: Session, call: Call, prompt: Any, sent_at: float) -> Outcome:
        import httpx

        path, body = self.body(call, prompt)
        out = Outcome()
        try:
            headers = {"X-Session-ID": session.session_id}
            nxt = next((c for c in session.calls if c.call_index == call.call_index + 1), None)
            if nxt is not None and nxt.tool:  # the tool this call invokes (issue 14): the next call's `tool`
                headers["X-Talaria-Tool"] = nxt.tool
            async with self.client.stream("POST", self.api + path, json=body, headers=headers) as resp:
                out.status = resp.status_code
                out.instance = resp.headers.get("x-talaria-instance", "")
                out.placement = resp.headers.get("x-talaria-placement", "")
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    ra = resp.headers.get("retry-after")
                    out.retry_after_s = float(ra) if ra and ra.replace(".", "", 1).isdigit() else None
                    out.error = f"http_{resp.status_code}: {_error_message(text)}"
                    out.end = self.clock()
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = self.clock()
                    try:
                        ev = json.loads(data)
                    except json.JSONDecodeError:
                        continue
                    if "error" in ev:
                        out.error = f"stream_error: {_error_message(json.dumps(ev))}"
                        break
                    if ev.get("usage"):
                        out.usage = ev["usage"]
                    for ch in ev.get("choices") or ():
                        text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                        if text:
                            if out.first_token != out.first_token:
                                out.first_token = now
                            out.last_token = now
                out.end = self.clock()
        except httpx.HTTPError as e:
            out.error = f"{type(e).__name__}: {e}"
            out.end = self.clock()
        if not out.error and out.first_token != out.first_token:
            out.error = "no_tokens"
        return out


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except Exception:  # noqa: BLE001
        return text[:200]


class Progress:
    """tqdm when it is installed (it is: ``openai`` depends on it), else one line per 10 % on stderr."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.n, self.errors = total, desc, 0, 0
        self._bar = None
        self._enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="call", dynamic_ncols=True, leave=True)
            except ImportError:
                pass

    def update(self, r: CallResult) -> None:
        self.n += 1
        self.errors += 0 if r.ok else 1
        if self._bar is not None:
            self._bar.update(1)
            if self.errors:
                self._bar.set_postfix(errors=self.errors)
        elif self._enabled and (self.n == self.total or self.n % max(1, self.total // 10) == 0):
            print(f"{self.desc}: {self.n}/{self.total} calls ({self.errors} errors)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def replay_http(workload: Workload, api: str, *, desc: str = "replay", progress: bool = True, gap_cap_s: float = GAP_CAP_S) -> ReplayResult:
    sender = HttpSender(api, max_connections=max(16, len(workload.sessions) * 2))
    bar = Progress(workload.num_calls, desc, progress)
    try:
        return await replay(workload, sender, gap_cap_s=gap_cap_s, on_call_done=bar.update)
    finally:
        bar.close()
        await sender.aclose()


async def warmup(api: str, models: list[str], *, prompt_tokens: int = 16, rounds: int = 1) -> None:
    """The same pre-window warmup for every configuration (Talaria §5.1): one short call per model (and
    round), sequential, with its own session ids; excluded from every measurement."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        for r in range(rounds):
            for i, m in enumerate(models):
                body = {"model": m, "prompt": [3 + (7 * j + i) % 4000 for j in range(prompt_tokens)], "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
                for _ in range(50):
                    resp = await client.post(f"{api}/v1/completions", json=body, headers={"X-Session-ID": f"warmup-{r}-{m}"})
                    if resp.status_code not in (429, 503):
                        break
                    await asyncio.sleep(0.5)
                if resp.status_code != 200:
                    raise RuntimeError(f"warmup call for {m} failed: {resp.status_code} {resp.text[:200]}")


# ------------------------------------------------------------------------------------------ CLI
def load_workload(args) -> Workload:
    """``--workload FILE`` (our JSONL), ``--miniswe FILE``, ``--mooncake FILE`` or the synthetic generator
    (``--tool-gaps`` / ``--two-model`` select its options)."""
    from bench.workloads import read_jsonl

    if getattr(args, "workload", None):
        w = read_jsonl(args.workload)
    elif getattr(args, "miniswe", None):
        from bench.workloads.miniswe import MiniSweParams, import_miniswe

        w = import_miniswe(MiniSweParams(path=args.miniswe, sessions=args.sessions, models=tuple(args.models), seed=args.seed,
                                         length_scale=args.length_scale or 1 / 16, time_scale=args.time_scale or 1.0))
    elif getattr(args, "mooncake", None):
        from bench.workloads.mooncake import MooncakeParams, import_mooncake

        w = import_mooncake(MooncakeParams(path=args.mooncake, sessions=args.sessions, models=tuple(args.models), seed=args.seed,
                                           length_scale=args.length_scale or 1 / 16, time_scale=args.time_scale or 1 / 100))
    else:
        from bench.workloads.synthetic import SynthParams, generate

        w = generate(SynthParams(sessions=args.sessions, models=tuple(args.models), seed=args.seed, length_scale=args.length_scale or 1 / 32,
                                 time_scale=args.time_scale or 1.0, max_depth=args.max_depth,
                                 tool_gaps=getattr(args, "tool_gaps", False), two_model=getattr(args, "two_model", False)))
    if getattr(args, "model_map", None):
        w.remap_models(dict(kv.split("=", 1) for kv in args.model_map))
    return w


def add_workload_args(p) -> None:
    g = p.add_argument_group("workload (one of --workload / --miniswe / --mooncake / synthetic by default)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--workload", help="a trace in Talaria's JSONL format (bench/workloads/README.md)")
    src.add_argument("--miniswe", help="import a mini-swe-agent trace file (an optional input: bench/workloads/README.md, Trace inputs)")
    src.add_argument("--mooncake", help="import a Mooncake trace file (an optional input: bench/workloads/README.md, Trace inputs)")
    g.add_argument("--tool-gaps", action="store_true", help="synthetic: per-tool gap distributions (fast/slow tools; calls carry `tool`)")
    g.add_argument("--two-model", action="store_true", help="synthetic: agent + user-simulator sessions alternating two models")
    g.add_argument("--sessions", type=int, default=None, help="sessions to generate / import")
    g.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-qwen2", "tiny-qwen3"], help="models the sessions are assigned to")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--length-scale", type=float, default=None, help="token lengths x this (synthetic 1/32, miniswe 1/16, mooncake 1/16)")
    g.add_argument("--time-scale", type=float, default=None, help="gaps and offsets x this (synthetic 1, miniswe 1, mooncake 1/100)")
    g.add_argument("--max-depth", type=int, default=187, help="synthetic: calls per session at most")
    g.add_argument("--model-map", nargs="*", metavar="FROM=TO", help="rename the trace's models")
    g.add_argument("--save-workload", metavar="FILE", help="write the workload as Talaria JSONL")


def main(args) -> int:
    """``talaria bench replay --api URL [workload] --out DIR``: replay against a running stack."""
    from bench.report import summarize_run, write_single_report

    if args.sessions is None:
        args.sessions = 12
    w = load_workload(args)
    if args.save_workload:
        from bench.workloads import write_jsonl

        write_jsonl(w, args.save_workload)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    api = args.api.rstrip("/")
    if api.endswith("/v1"):
        api = api[:-3]
    if args.warmup:
        asyncio.run(warmup(api, w.models()))
    res = asyncio.run(replay_http(w, api, desc="replay", progress=not args.no_progress))
    (out / "replay.json").write_text(json.dumps(res.to_json()))
    summary = summarize_run(res, telemetry={})
    write_single_report(out, summary, res)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, (list, dict))}, indent=2))
    return 0 if summary["calls_failed"] == 0 else 1


def add_args(p) -> None:
    p.add_argument("--api", default="http://127.0.0.1:8000", help="router base URL of a running stack (default http://127.0.0.1:8000)")
    add_workload_args(p)
    p.add_argument("--out", default=".talaria/bench/replay", help="output folder: replay.json, README.md, PNG plots")
    p.add_argument("--warmup", action="store_true", help="one short call per model before the replay (excluded)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
