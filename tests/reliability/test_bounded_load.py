"""A bounded load, round after round, leaves every process's resident memory flat (the campaign's leak
check): streaming and non-streaming calls, sessions, abandoned streams and bad requests, through the
router of the shared stack; RSS of the router and both engines is read from /proc after each round."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.reliability.conftest import MODEL, Figures, engines_idle

pytestmark = pytest.mark.slow

ROUNDS, WORKERS, CALLS = 5, 4, 8  # 32 calls a round
SLACK_MB = 40.0  # allocator noise on a loaded machine; a leak of a few kB per call over 128 calls is not the target, a growing cache is


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _work(api: str, w: int, r: int, figs: Figures, lock: threading.Lock) -> None:
    with httpx.Client(base_url=api, timeout=120) as c:
        for i in range(CALLS):
            kind = (w + i) % 4
            body = {"model": MODEL, "prompt": f"round {r} worker {w} call {i}", "max_tokens": 6, "user": f"load-{w}-{i % 3}"}
            try:
                if kind == 0:
                    resp = c.post("/v1/completions", json={**body, "top_k": 2**40})  # rejected at the edge
                    status, text = resp.status_code, resp.text
                elif kind == 1:
                    with c.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 200, "ignore_eos": True}) as s:
                        status, text = s.status_code, ""
                        for _ in s.iter_lines():
                            break  # abandoned after the first line
                else:
                    resp = c.post("/v1/completions", json={**body, "stream": kind == 3})
                    status, text = resp.status_code, resp.text if kind == 2 else ""
            except httpx.HTTPError:
                status, text = None, None
            with lock:
                if kind == 3 and status == 200:
                    figs.add(200)
                else:
                    figs.add(status, text)


def test_rss_stays_flat_across_rounds(shared_stack):
    pids = {name: shared_stack.children[name].proc.pid for name in (shared_stack.cfg.router.id, "rel-a", "rel-b")}
    series: dict[str, list[float]] = {n: [] for n in pids}
    figs, lock = Figures(), threading.Lock()
    for r in range(ROUNDS):
        ts = [threading.Thread(target=_work, args=(shared_stack.api, w, r, figs, lock)) for w in range(WORKERS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        engines_idle(shared_stack, ["rel-a", "rel-b"])
        for n, pid in pids.items():
            series[n].append(rss_mb(pid))
    table = {n: [round(x, 1) for x in v] for n, v in series.items()}
    assert figs.s5xx == 0 and figs.lost == 0 and figs.sent == ROUNDS * WORKERS * CALLS, f"{figs}; rss MB {table}"
    for n, v in series.items():  # round 1 warms caches; after it, flat
        assert max(v[1:]) - v[1] < SLACK_MB, f"{n} RSS grew: {table} MB; {figs}"
