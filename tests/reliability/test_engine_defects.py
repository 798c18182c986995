"""Engine-side defects of issue 18 kept in the campaign: one sequence's failure ends only that sequence (item
1), and engines stop the calls of a requester that is gone (item 3, engine half). Their unit regression tests
are in tests/unit/test_sequence_isolation.py and tests/integration/test_engine_service_inproc.py."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.integration.conftest import health, wait_until
from tests.reliability.conftest import MODEL, ExtraRouter, Figures, engines_idle

pytestmark = pytest.mark.slow


def test_one_bad_sampling_request_fails_only_itself(shared_stack):
    """Issue 18 item 1: ``temperature: 1e-45`` beside 8 running streams must not end those streams."""
    engines_idle(shared_stack, ["rel-a", "rel-b"])
    figs, lock, results = Figures(), threading.Lock(), []

    def stream(i: int) -> None:
        # long enough that all 8 are still running together when the bad request arrives, however fast the
        # engines are (at 300 tokens an idle machine finished some before the 8th started)
        body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 1200, "ignore_eos": True, "stream": True, "temperature": 0}
        errs = []
        with httpx.Client(timeout=120) as c, c.stream("POST", f"{shared_stack.api}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and "error" in (event := json.loads(line[6:])):
                    errs.append(event)  # an error event (a generated token may be the word "error": not that)
        with lock:
            results.append(errs)
            figs.add(503 if errs else 200, json.dumps(errs[0]) if errs else "")

    ts = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    wait_until(lambda: sum(health(shared_stack)["instances"][e]["running"] for e in ("rel-a", "rel-b")) >= 8, timeout=60)
    bad = httpx.post(f"{shared_stack.api}/v1/chat/completions", timeout=60,
                     json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 1e-45})
    for t in ts:
        t.join(120)
    assert figs.ok == 8, f"unrelated streams failed: {figs}; the tiny temperature got {bad.status_code}"
    assert bad.status_code in (200, 400), f"the tiny temperature got {bad.status_code}: {bad.text[:200]}; streams {figs}"


async def test_engines_stop_the_calls_of_a_dead_router(shared_stack, tmp_path):
    """Issue 18 item 3 (engine half): a router SIGKILLed with calls in flight; the engines must stop them
    (their requester is gone: completion hooks say ``abort``) rather than run on to max_tokens."""
    import asyncio

    from talaria.natsutil import connect
    from talaria.subjects import Subjects
    from talaria.v1 import engine_pb2 as pb

    engines_idle(shared_stack, ["rel-a", "rel-b"])
    r = ExtraRouter(shared_stack, "router-doomed", tmp_path)
    nc = await connect(shared_stack.nats_url, "rel-orphans")
    hooks = await nc.subscribe(Subjects(shared_stack.cfg.namespace).completed())
    sessions = [f"orphan-{time.monotonic_ns()}-{i}" for i in range(4)]
    try:
        def call(s: str) -> None:
            try:
                httpx.post(f"{r.api}/v1/completions", timeout=120, headers={"X-Session-ID": s},
                           json={"model": MODEL, "prompt": "orphan", "max_tokens": 2000, "ignore_eos": True})
            except httpx.HTTPError:
                pass

        for s in sessions:
            threading.Thread(target=call, args=(s,), daemon=True).start()
        running = lambda: sum(health(shared_stack)["instances"][e]["running"] for e in ("rel-a", "rel-b"))  # noqa: E731
        await asyncio.to_thread(wait_until, lambda: running() >= 4, 60)
        shared_stack.kill("router-doomed", signal.SIGKILL)
        reasons: dict[str, str] = {}
        while len(reasons) < len(sessions):
            h = pb.CompletionHook.FromString((await hooks.next_msg(120)).data)
            if h.session_id in sessions:
                reasons[h.session_id] = h.finish_reason
        aborted = sum(v == "abort" for v in reasons.values())
        assert aborted == len(sessions), f"sent={len(sessions)} aborted={aborted} ran_to_end={len(sessions) - aborted}: {reasons}"
    finally:
        await nc.close()
        r.stop()
        engines_idle(shared_stack, ["rel-a", "rel-b"], timeout=120)  # leave the shared stack idle either way
