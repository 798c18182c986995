"""``python -m bench.prefetch_bench``: what intent prefetch saves on returns that switch models (issue 14 item 3).

One cold-pool engine serving two models (an agent and a user simulator; real switches), the router, NATS.
Sessions alternate agent -> user -> agent ... with a ``--gap`` between a response and the next call (the
harness hand-off). With prefetch on, once the router has seen >= 3 agent -> user transitions it asks the
engine, at the agent call's completion hook, to switch to the user model during the gap
(``CONTROL_OPEN_MODEL``); without it the switch happens when the user call arrives. Reported: TTFT of the
calls that switch models (p50/p95/mean), prefetch on vs off, interleaved repetitions, and the load average.
Numbers on a shared CPU are noise-prone: compare the ratio, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import httpx

from bench import ensure_models
from bench.stats import loadavg
from talaria.config import parse_config
from talaria.up import LocalStack

AGENT, USER = "tiny-llama", "tiny-qwen3"


def stack_cfg(models_dir: str, prefetch: bool) -> dict:
    return {
        "namespace": f"pf{uuid.uuid4().hex[:8]}", "models_dir": models_dir, "synthesize_models": False,
        "kvstore": {"enabled": False},
        "router": {"port": 0, "placement": {"intent_prefetch": prefetch, "lease_store": "memory"}},
        "engines": [{"id": "c0", "pool": "cold", "models": [AGENT, USER], "device": "cpu", "kv_cache_mb": 64,
                     "torch_threads": 1, "heartbeat_period_s": 0.2}],
    }


def run_once(models_dir: str, prefetch: bool, sessions: int, turns: int, gap: float) -> dict:
    stack = LocalStack(parse_config(stack_cfg(models_dir, prefetch)), say=lambda _m: None, quiet=True)
    stack.__enter__()
    try:
        api = stack.api
        with httpx.Client(timeout=60) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not c.get(f"{api}/health").json().get("instances", {}).get("c0", {}).get("healthy"):
                time.sleep(0.1)
            switch_ttft, same_ttft = [], []
            for s in range(sessions):
                sid = f"pf-{s}"
                prev = None
                for t in range(turns):
                    model = AGENT if t % 2 == 0 else USER
                    body = {"model": model, "prompt": f"session {s} turn {t} " * 8, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
                    t0 = time.perf_counter()
                    first = None
                    with c.stream("POST", f"{api}/v1/completions", json=body, headers={"X-Session-ID": sid}) as r:
                        for line in r.iter_lines():
                            if first is None and line.startswith("data:") and '"text"' in line:
                                first = time.perf_counter() - t0
                    if prev is not None and first is not None:
                        (switch_ttft if prev != model else same_ttft).append(first)
                    prev = model
                    time.sleep(gap)
            m = c.get(f"{api}/router/metrics").json()["placement"]["counters"]
        return {"prefetch": prefetch, "switch_ttft": switch_ttft, "prefetches": m.get("prefetches", 0)}
    finally:
        stack.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--gap", type=float, default=0.5, help="seconds between a response and the session's next call")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--models-dir", default=".talaria/bench-models")
    p.add_argument("--json")
    a = p.parse_args()
    models_dir = str(ensure_models(a.models_dir, [AGENT, USER]))
    rows = []
    for r in range(a.repeats):
        for pf in ((True, False) if r % 2 == 0 else (False, True)):
            la0 = loadavg()
            res = run_once(models_dir, pf, a.sessions, a.turns, a.gap)
            res["load"] = [la0, loadavg()]
            rows.append(res)
            x = res["switch_ttft"]
            print(f"rep {r + 1} prefetch={'on ' if pf else 'off'}: switching returns n={len(x)} TTFT p50 {statistics.median(x) * 1e3:.1f} ms "
                  f"mean {statistics.mean(x) * 1e3:.1f} ms max {max(x) * 1e3:.1f} ms; prefetches {res['prefetches']}; load {la0} -> {res['load'][1]}", flush=True)
    for pf in (True, False):
        xs = [v for row in rows if row["prefetch"] == pf for v in row["switch_ttft"]]
        print(f"prefetch {'on ' if pf else 'off'}: pooled switching-return TTFT p50 {statistics.median(xs) * 1e3:.1f} ms, mean {statistics.mean(xs) * 1e3:.1f} ms (n={len(xs)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
