"""``talaria bench router``: latency a call pays for going through NATS and the router.

What is measured
    Sequential calls (one at a time, ``calls`` per round after ``warmup`` calls) with the same short prompt
    (``prompt_len`` random token ids, fewer than a KV page so no prefix-cache reuse plays a part), greedy,
    EOS ignored, for each ``max_tokens`` (default 1 and 16), along these paths:

    (a) ``in-process``: an ``Engine`` on the same model in this process: ``add_request`` then ``step()``
        until the request finishes (the loop ``generate()`` runs), collecting token ids and text;
    (b) ``nats``: a ``GenerateRequest`` (token ids) published on the engine's generate subject with a
        reply inbox, reading the ``TokenChunk`` stream until ``finished`` (``EngineCall``, as the router
        does) against an engine *process*: adds NATS + the engine service (protobuf, its asyncio loop,
        its step thread), no router; ``nats-stream`` the same with ``GenerateRequest.stream`` (a chunk per
        step): the direct call a streaming router call is compared with;
    (c) ``router``: the OpenAI API of a ``LocalStack`` with one engine (``/v1/completions`` with a
        token-id prompt via the official ``openai`` client, non-streaming, ``ignore_eos`` extension):
        adds HTTP, the router's validation, placement and its own NATS hop on top of (b);
    (d) ``router-stream``: the same call with ``stream=True`` (SSE), read to its end: the per-token path
        (one NATS message and one SSE event per token when the reader keeps up). (b) and (c) are
        non-streaming calls: the engine sends their first token at once and the rest with the finished
        chunk (``GenerateRequest.stream`` false), so (d) - (c) is what per-token streaming costs;
    (e) ``router-raw`` and (f) ``router-raw-stream``: (c) and (d) with a minimal HTTP/1.1 client instead of
        the ``openai`` one (one keep-alive ``http.client`` connection, the JSON body encoded with ``json``, the
        answer or each SSE event decoded with ``json``): the client then does what (b)'s does (encode a
        request, decode the answer), so (e) - (b) and (f) - ``nats-stream`` are what the router adds, and (c) - (e) is the ``openai``
        client's own work (its request building, pydantic models, SSE parser: ~1 ms of CPU a call and
        ~0.3 ms an event here), which a user pays with any server.

    Fairness: the engine process runs with ``torch_threads: 1`` and this process sets
    ``torch.set_num_threads(1)`` for (a); same model, dtype (float32), page size and KV budget. The
    stack stays up during (a) so that its idle heartbeats are background noise for every path.
    The paths take turns in blocks of ``block`` calls (a, b, ..., f, then b, ..., f, a, ...: the order rotates
    per block) so that drift on a shared machine hits all of them alike, and the produced tokens/text are
    checked to agree.

How it is reported
    Per path and ``max_tokens``: p50 and p95 of the per-call latency (median over ``repeats`` rounds),
    the added latency ``p50(path) - p50(in-process)`` and the ratio ``p50(path) / p50(in-process)``; and
    what each router path adds over a direct engine call, ``p50(path) - p50(nats)`` (streaming paths:
    ``- p50(nats-stream)``) paired per block (median over the blocks of all rounds), per call (smallest
    ``max_tokens``) and per further token (the slope to the largest).
    And the CPU time each process of the stack spent per call of each path (router, engine, NATS server,
    telemetry service, kvstore, and this bench process: the client, and the engine itself for
    ``in-process``), from ``/proc``: where the time of a path goes among the processes, and whether a process
    that should be there (the telemetry service) ran. CPU time also moves with machine load (clock speed,
    shared caches: on the 2-core development machine the engine's CPU per call varied 1.5x between runs), so
    compare runs made close together, alternating the versions. The stack's telemetry service
    takes a free port: with a fixed one, a second stack on the machine can take it first and the service
    exits, and the router path then loses the ~1 ms of CPU per call the service spends on its call records.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench import emit, ensure_models, format_table, median, percentile, quiet_loggers

DEFAULT_MODEL = "tiny-llama"
ENGINE_ID = "bench-engine-0"
KV_CACHE_MB = 64
PATHS = ("in-process", "nats", "nats-stream", "router", "router-stream", "router-raw", "router-raw-stream")
ROUTER_PATHS = PATHS[3:]
BASE_OF = {"router": "nats", "router-raw": "nats", "router-stream": "nats-stream", "router-raw-stream": "nats-stream"}  # the direct call each pairs with


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _stack_config(models_dir: Path, model: str, stream_interval_ms: float = 0.0) -> dict[str, Any]:
    return {
        "namespace": f"bench{uuid.uuid4().hex[:8]}",
        "models_dir": str(models_dir),
        "synthesize_models": False,
        "router": {"port": 0},
        "telemetry": {"port": 0},  # a free port: a busy fixed one can leave the stack without its telemetry service
        "engines": [
            {"id": ENGINE_ID, "models": [model], "device": "cpu", "dtype": "float32", "kv_cache_mb": KV_CACHE_MB, "torch_threads": 1,
             "stream_interval_ms": stream_interval_ms}
        ],
    }


class _InProcess:
    def __init__(self, path: Path, model: str):
        import torch

        from services.engine.executor import Engine

        self.engine = Engine(path, device="cpu", dtype=torch.float32, kv_cache_bytes=KV_CACHE_MB * 1024 * 1024, model_id=model)
        self._ids = itertools.count()

    def call(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        from services.engine.types import EngineRequest, SamplingParams

        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        rid = f"bench-{next(self._ids)}"
        self.engine.add_request(EngineRequest(rid, list(prompt), sp))
        ids: list[int] = []
        text = ""
        done = False
        while not done:
            for out in self.engine.step():
                if out.request_id == rid:
                    ids += out.new_token_ids
                    text += out.new_text
                    done = out.finished
        return ids, text


class _Nats:
    """Direct NATS calls to the engine process, on a private event loop (sync facade)."""

    def __init__(self, nats_url: str, namespace: str, model: str):
        from services.router.engine_client import InboxMux
        from talaria.subjects import Subjects

        self.loop = asyncio.new_event_loop()
        self.subjects = Subjects(namespace)
        self.model = model
        self.nc = self.loop.run_until_complete(self._connect(nats_url))
        self.mux = InboxMux(self.nc, self.subjects.inbox_prefix("bench"))  # as the router reads its inboxes

    async def _connect(self, url: str):
        from talaria.natsutil import connect

        return await connect(url, "bench-client")

    async def _call(self, prompt: list[int], max_tokens: int, stream: bool = False) -> tuple[list[int], str]:
        from services.router.engine_client import SCHEMA_VERSION, EngineCall
        from talaria.v1 import engine_pb2 as pb

        req = pb.GenerateRequest(
            schema_version=SCHEMA_VERSION,
            request_id=uuid.uuid4().hex,
            model=self.model,
            sampling=pb.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True),
            token_ids=pb.TokenIds(ids=prompt),
            deadline_unix=time.time() + 60,
            stream=stream,
        )
        call = EngineCall(self.mux, self.subjects, ENGINE_ID, req)
        alive = lambda: True  # noqa: E731 - the timeouts below bound a dead engine
        try:
            await call.start()
            first = await call.wait_accepted(30.0, alive)
            if not first.accepted:
                raise RuntimeError(f"engine refused the call: {first.error}")
            ids: list[int] = []
            text = ""
            async for c in call.chunks(30.0, alive):
                if c.HasField("error"):
                    raise RuntimeError(f"engine error: {c.error}")
                ids += c.token_ids
                text += c.text
            return ids, text
        finally:
            await call.close()

    def call(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        return self.loop.run_until_complete(self._call(prompt, max_tokens))

    def call_stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        return self.loop.run_until_complete(self._call(prompt, max_tokens, stream=True))

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.nc.close())
        finally:
            self.loop.close()


class _Router:
    def __init__(self, api: str, model: str):
        import openai

        self.client = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0, timeout=60)
        self.model = model

    def call(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        r = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=False, extra_body={"ignore_eos": True}
        )
        if r.usage is not None and r.usage.completion_tokens != max_tokens:
            raise RuntimeError(f"router returned {r.usage.completion_tokens} tokens, expected {max_tokens}")
        return [], r.choices[0].text

    def call_stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        text = []
        for ev in self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
        ):
            if ev.choices:
                text.append(ev.choices[0].text or "")
        return [], "".join(text)


class _RawHTTP:
    """The router's ``/v1/completions`` over one keep-alive HTTP/1.1 connection with the standard library:
    a JSON body in, the JSON answer (or each SSE event) out -- the work (b)'s client does, nothing more."""

    def __init__(self, api: str, model: str):
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(api)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.model = model

    def _post(self, prompt: list[int], max_tokens: int, stream: bool):
        import json

        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": stream, "ignore_eos": True}).encode()
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer unused"})
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"router answered {r.status}: {r.read()[:300]!r}")
        return r

    def call(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        import json

        d = json.loads(self._post(prompt, max_tokens, False).read())
        if d["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"router returned {d['usage']['completion_tokens']} tokens, expected {max_tokens}")
        return [], d["choices"][0]["text"]

    def call_stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        import json

        r = self._post(prompt, max_tokens, True)
        text = []
        while line := r.readline():
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                break
            ev = json.loads(line[6:])
            if ev.get("choices"):
                text.append(ev["choices"][0].get("text") or "")
        r.read()  # the rest of the chunked body: the connection is reused
        return [], "".join(text)

    def close(self) -> None:
        self.conn.close()


def over_direct(blocks: dict[str, list[float]], path: str) -> float | None:
    """What ``path`` adds over the direct engine call it pairs with (``BASE_OF``: a streamed router call with a
    streamed direct one), in ms: the median over blocks of its block p50 minus that call's block p50 of the same
    turn (``blocks``: each path's block p50s in seconds, in turn order). None for a path that is not a router
    path. Pure."""
    base = BASE_OF.get(path)
    if base is None:
        return None
    return median([(a - b) * 1e3 for a, b in zip(blocks[path], blocks[base], strict=True)])


def _wait_healthy(api: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            inst = httpx.get(f"{api}/health", timeout=5).json().get("instances", {})
            if inst.get(ENGINE_ID, {}).get("healthy"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"engine {ENGINE_ID} did not report healthy to the router within {timeout:.0f}s")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads; /proc), 0.0 when it is gone or
    /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _stack_pids(stack) -> dict[str, int]:
    """The processes whose CPU per call is reported: the stack's children, its NATS server, this process."""
    pids = {name: c.proc.pid for name, c in stack.children.items()}
    if stack.nats is not None and stack.nats.proc is not None:
        pids["nats-server"] = stack.nats.proc.pid
    pids["bench"] = os.getpid()
    return pids


def _timed(fn, prompt: list[int], max_tokens: int, n: int) -> tuple[list[float], tuple[list[int], str]]:
    lat = []
    out: tuple[list[int], str] = ([], "")
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn(prompt, max_tokens)
        lat.append(time.perf_counter() - t0)
    return lat, out


def run_router_bench(
    models_dir: str | Path | None = None,
    model: str = DEFAULT_MODEL,
    max_tokens: tuple[int, ...] | list[int] = (1, 16),
    calls: int = 30,
    warmup: int = 3,
    repeats: int = 3,
    prompt_len: int = 12,
    seed: int = 0,
    stream_interval_ms: float = 0.0,
    block: int = 10,
    say=print,
) -> dict[str, Any]:
    import torch

    from talaria.config import parse_config
    from talaria.up import LocalStack

    if repeats < 1 or calls < 1 or block < 1:
        raise ValueError("repeats, calls and block must be >= 1")
    mdir = ensure_models(models_dir, [model], say=say)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stack = LocalStack(parse_config(_stack_config(mdir, model, stream_interval_ms)), say=lambda _m: None, quiet=True)
    nats_client = raw = None
    quiet = quiet_loggers("httpx", "httpx2", "openai", "talaria.natsutil")
    quiet.__enter__()
    try:
        say(f"loading {model} in-process (1 torch thread) and starting a stack with one engine (torch_threads: 1) ...")
        inproc = _InProcess(mdir / model, model)
        prompt = _prompt(prompt_len, inproc.engine.vocab_size, seed)
        api = stack.start()
        _wait_healthy(api)
        nats_client = _Nats(stack.nats_url, stack.cfg.namespace, model)
        router = _Router(api, model)
        raw = _RawHTTP(api, model)
        fns = {"in-process": inproc.call, "nats": nats_client.call, "nats-stream": nats_client.call_stream, "router": router.call, "router-stream": router.call_stream,
               "router-raw": raw.call, "router-raw-stream": raw.call_stream}
        pids = _stack_pids(stack)

        rows: list[dict[str, Any]] = []
        sizes = [min(block, calls - i) for i in range(0, calls, block)]
        for mt in max_tokens:
            lat: dict[str, list[list[float]]] = {p: [[] for _ in range(repeats)] for p in PATHS}  # per round, every call
            blocks: dict[str, list[float]] = {p: [] for p in PATHS}  # each block's p50, in the same order for every path
            cpu: dict[str, dict[str, float]] = {p: dict.fromkeys(pids, 0.0) for p in PATHS}  # CPU seconds over every timed call
            outs: dict[str, tuple[list[int], str]] = {}
            for p in PATHS:
                _timed(fns[p], prompt, mt, warmup)
            turn = 0
            for rep in range(repeats):
                for n in sizes:
                    for p in PATHS[turn % len(PATHS):] + PATHS[: turn % len(PATHS)]:
                        c0 = {k: _cpu_s(pid) for k, pid in pids.items()}
                        got, outs[p] = _timed(fns[p], prompt, mt, n)
                        for k, pid in pids.items():
                            cpu[p][k] += _cpu_s(pid) - c0[k]
                        lat[p][rep] += got
                        blocks[p].append(percentile(got, 50))
                    turn += 1
            ref = outs["in-process"]
            agree = {p: outs[p] == ref if p.startswith("nats") else outs[p][1] == ref[1] for p in PATHS[1:]}
            base = median([percentile(x, 50) for x in lat["in-process"]])
            for p in PATHS:
                p50 = median([percentile(x, 50) for x in lat[p]])
                rows.append({
                    "max_tokens": mt,
                    "path": p,
                    "p50_ms": p50 * 1e3,
                    "p95_ms": median([percentile(x, 95) for x in lat[p]]) * 1e3,
                    "mean_ms": median([sum(x) / len(x) for x in lat[p]]) * 1e3,
                    "added_p50_ms": (p50 - base) * 1e3,
                    "ratio_p50": p50 / base,
                    # what the path adds over the direct call of its kind, paired per block (None below the router)
                    "over_direct_p50_ms": over_direct(blocks, p),
                    "output_agrees": agree.get(p, True),
                    "runs_p50_ms": [percentile(x, 50) * 1e3 for x in lat[p]],
                    # a process's work for a call may finish after the call returns (call records, closing): it
                    # lands in the next call's window, so per-call averages hold over many calls
                    "cpu_ms_per_call": {k: v * 1e3 / (calls * repeats) for k, v in cpu[p].items()},
                })
            say(f"  max_tokens {mt}: " + ", ".join(f"{r['path']} p50 {r['p50_ms']:.2f} ms" for r in rows[-len(PATHS):]))
    except Exception:
        time.sleep(0.5)  # let the log pumps catch up with the failure
        for c in stack.children.values():  # the stack runs quiet: show what its processes said
            tail = "\n    ".join(c.log[-15:])
            print(f"[bench] last lines of {c.name}:\n    {tail}", file=sys.stderr)
        raise
    finally:
        if nats_client is not None:
            nats_client.close()
        if raw is not None:
            raw.close()
        stack.stop()
        quiet.__exit__(None, None, None)
        torch.set_num_threads(prev_threads)
    return {
        "bench": "router",
        "model": model,
        "models_dir": str(mdir),
        "prompt_len": prompt_len,
        "calls": calls,
        "block": block,
        "warmup": warmup,
        "repeats": repeats,
        "torch_threads": 1,
        "stream_interval_ms": stream_interval_ms,
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    head = (
        f"router bench: {result['model']} fp32 cpu, 1 torch thread per engine, prompt {result['prompt_len']} tokens, "
        f"{result['calls']} sequential calls per path per round (blocks of {result.get('block', result['calls'])}, paths in turn) after "
        f"{result['warmup']} warm-up, median of {result['repeats']} rounds, "
        f"engine stream_interval_ms {result.get('stream_interval_ms', 0.0):g}"
    )
    t = format_table(
        ["max_tokens", "path", "p50 ms", "p95 ms", "added p50 ms", "p50 / in-process", "output agrees"],
        [[r["max_tokens"], r["path"], r["p50_ms"], r["p95_ms"], r["added_p50_ms"], r["ratio_p50"], "yes" if r["output_agrees"] else "NO"]
         for r in result["rows"]],
    )
    return f"{head}\n\nper-call latency (in-process Engine vs engine process over NATS vs router HTTP API, non-streaming and streaming)\n{t}{_per_token(result)}{_cpu(result)}"


def _cpu(result: dict[str, Any]) -> str:
    """CPU milliseconds per call by process and path (``bench``: this process, the client; for ``in-process``
    also the engine it runs)."""
    rows = [r for r in result["rows"] if r.get("cpu_ms_per_call")]
    if not rows:
        return ""
    procs = list(rows[0]["cpu_ms_per_call"])
    t = format_table(["max_tokens", "path", *procs, "total"],
                     [[r["max_tokens"], r["path"], *(r["cpu_ms_per_call"].get(k, 0.0) for k in procs), sum(r["cpu_ms_per_call"].values())] for r in rows])
    return f"\n\nCPU ms per call by process (/proc; moves with machine load too: compare runs made close together)\n{t}"


def _per_token(result: dict[str, Any]) -> str:
    """What each path adds per call (at the smallest max_tokens) and per further token (the slope of the
    added p50 between the smallest and the largest max_tokens)."""
    mts = sorted({r["max_tokens"] for r in result["rows"]})
    if len(mts) < 2:
        return ""
    lo, hi = mts[0], mts[-1]

    def per_call_and_token(key: str, paths: tuple[str, ...]) -> list[list[Any]]:
        v = {(r["path"], r["max_tokens"]): r[key] for r in result["rows"] if r.get(key) is not None}
        return [[p, v[(p, lo)], (v[(p, hi)] - v[(p, lo)]) / (hi - lo)] for p in paths if (p, lo) in v and (p, hi) in v]

    rows, orows = per_call_and_token("added_p50_ms", PATHS[1:]), per_call_and_token("over_direct_p50_ms", ROUTER_PATHS)
    text = f"\n\nadded cost over in-process: per call (max_tokens {lo}) and per token (slope to max_tokens {hi})\n" + format_table(
        ["path", "added per call ms", "added per token ms"], rows)
    if orows:
        text += ("\n\nwhat the router adds over a direct engine call (nats; streaming over nats-stream), paired per block (raw: a "
                 "minimal HTTP client; the others include the openai client's own work)\n" + format_table(["path", "over direct per call ms", "over direct per token ms"], orows))
    return text


def main(args) -> int:
    result = run_router_bench(
        models_dir=args.models_dir,
        model=args.model or DEFAULT_MODEL,
        max_tokens=args.max_tokens,
        calls=args.calls,
        warmup=args.warmup,
        repeats=args.repeats,
        prompt_len=args.prompt_len,
        seed=args.seed,
        stream_interval_ms=args.stream_interval_ms,
        block=args.block,
    )
    return emit(result, render(result), args.json)
