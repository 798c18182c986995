"""The kvstore killed under load (the campaign's host-KV case): through the router, sessions whose prefix
was pushed out of the device to the host store give the same greedy tokens after the store is killed
(recomputed) as when it was there (restored); calls running during the kill see no 5xx, lose nothing, and all
end 2xx for a client that retries a retryable clean error (429/503 with Retry-After) as the official SDKs do."""

from __future__ import annotations

import asyncio
import signal
import threading

import httpx
import pytest

from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import engine, stack_config, start_stack
from tests.integration.test_kvstore import flush_until_host
from tests.reliability.conftest import MODEL, Figures

pytestmark = pytest.mark.slow

TEXT = "The agent called the search tool and read the result. " * 12


@pytest.fixture(scope="module")
def kv_stack(rel_models_dir):
    cfg = stack_config(
        rel_models_dir, [engine("e0", MODEL, page_size=16)],
        kvstore={"enabled": True, "capacity_mb": 64, "slab_kb": 32, "retry_after_s": 0.3, "rpc_timeout_s": 1.0},
    )
    s = start_stack(cfg)
    yield s
    s.stop()


def turn(api: str, session: str, text: str) -> tuple[str, dict]:
    r = httpx.post(f"{api}/v1/completions", headers={"X-Session-ID": session}, timeout=60,
                   json={"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]


async def test_kvstore_kill_gives_identical_greedy_outputs(kv_stack):
    api = kv_stack.api
    nc = await connect(kv_stack.nats_url, "rel-kv")
    subj = Subjects(kv_stack.cfg.namespace)
    figs, lock, stop = Figures(), threading.Lock(), threading.Event()

    calls, done = [0], [0]

    def background(w: int) -> None:
        # A client as the official SDKs are: a retryable clean error (429/503 with Retry-After) is retried, twice
        # at most, after the Retry-After it names. Every attempt is in the figures; every call must end 2xx.
        with httpx.Client(timeout=60) as c:
            i = 0
            while not stop.is_set() and i < 40:
                for _attempt in range(3):
                    try:
                        r = c.post(f"{api}/v1/completions", json={"model": MODEL, "prompt": f"bg {w} {i}", "max_tokens": 4}, headers={"X-Session-ID": f"bg-{w}"})
                        status, text, retry = r.status_code, r.text, r.headers.get("retry-after")
                    except httpx.HTTPError:
                        status, text, retry = None, None, None
                    with lock:
                        figs.add(status, text)
                    if status not in (429, 503) or retry is None:
                        break
                    stop.wait(min(2.0, float(retry)))
                with lock:
                    calls[0] += 1
                    done[0] += status == 200
                i += 1

    try:
        a1, _ = await asyncio.to_thread(turn, api, "A", TEXT)
        await flush_until_host(nc, subj, "A")
        a2, ua = await asyncio.to_thread(turn, api, "A", TEXT + " next turn")
        assert ua["prompt_tokens_details"]["restored_tokens"] > 0, ua  # the reference really came from the store
        c1, _ = await asyncio.to_thread(turn, api, "C", TEXT)
        await flush_until_host(nc, subj, "C")
        workers = [threading.Thread(target=background, args=(w,)) for w in range(2)]
        for t in workers:
            t.start()
        kv_stack.kill("kvstore", signal.SIGKILL)
        c2, uc = await asyncio.to_thread(turn, api, "C", TEXT + " next turn")
        stop.set()
        for t in workers:
            await asyncio.to_thread(t.join, 60)
        assert (c1, c2) == (a1, a2), f"outputs differ after the kvstore kill; background {figs}"
        assert uc["prompt_tokens_details"]["restored_tokens"] == 0, uc
        assert figs.s5xx == 0 and figs.lost == 0 and done[0] == calls[0] > 0, f"background during the kill: {calls[0]} calls, {done[0]} ended 2xx; attempts {figs}"
        await flush_until_host(nc, subj, "C", want=pb.KV_MISSING)
    finally:
        stop.set()
        await nc.close()
        kv_stack.start_kvstore()
