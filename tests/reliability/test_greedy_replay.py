"""Greedy replays across a host-KV restore (the fault campaign's check): a batch of greedy calls sent together,
the engine's device caches dropped so every session is only in the kvstore, and the same calls sent together
again -- their prefixes now restored from the store, their steps batched differently -- give the same text.

The engine runs the deterministic mode (``engines[].deterministic``) in bf16, the ``auto`` dtype of the
campaign's CPU, on a random-weight model whose near-tie logits flip on one rounding difference. Without the
mode the same replay differed in 19 of 96 calls in the campaign, and here (tiny-qwen2, 12 calls) in several."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import engine, stack_config, start_stack
from tests.unit.kernel_fixtures import require_extension

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
SYSTEM = "You are a coding agent. Read the file, run the tests, report what failed and why. " * 4
CALLS = [(f"s{i}", SYSTEM + f"Task {i}: the test suite of package {i} fails in {i + 1} places; explain.") for i in range(12)]


@pytest.fixture(scope="module")
def replay_stack(rel_models_dir):
    require_extension()  # the mode needs the paged kernel: a build failure fails here, not as a config error later
    cfg = stack_config(
        rel_models_dir,
        [engine("e0", MODEL, page_size=16, dtype="bfloat16", deterministic=True, torch_threads=2, max_num_seqs=16,
                host_kv_restore="always")],
        kvstore={"enabled": True, "capacity_mb": 64, "slab_kb": 32},
    )
    s = start_stack(cfg)
    yield s
    s.stop()


def _send_all(api: str) -> dict[str, tuple[str, dict]]:
    """Every call at once (8 in flight), greedy; session id -> (text, usage)."""
    def one(call):
        sid, prompt = call
        r = httpx.post(f"{api}/v1/completions", headers={"X-Session-ID": sid}, timeout=120,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return sid, (r.json()["choices"][0]["text"], r.json()["usage"])

    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(one, CALLS))


async def _flush_until_all_on_host(nc, subj, sessions, timeout: float = 20.0) -> None:
    """Drop the engine's device caches until the snapshot reports every session in the host store only."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_FLUSH_CACHE)
        rep = pb.ControlReply.FromString((await nc.request(subj.control("e0"), req.SerializeToString(), timeout=5)).data)
        states = {s.session_id: s.state for s in rep.snapshot.sessions}
        if all(states.get(s) == pb.KV_HOST for s in sessions):
            return
        assert asyncio.get_running_loop().time() < deadline, f"sessions not all on the host: {states}"
        await asyncio.sleep(0.1)


async def test_greedy_replay_after_host_kv_restore_is_identical(replay_stack):
    nc = await connect(replay_stack.nats_url, "rel-replay")
    subj = Subjects(replay_stack.cfg.namespace)
    try:
        first = await asyncio.to_thread(_send_all, replay_stack.api)
        await _flush_until_all_on_host(nc, subj, [sid for sid, _ in CALLS])
        second = await asyncio.to_thread(_send_all, replay_stack.api)
    finally:
        await nc.close()
    # every session's own pages are only in the store after the flush, and the engine restores whatever the
    # store holds (host_kv_restore: always; auto would let the cost model recompute a short tail instead)
    not_restored = {sid: u["prompt_tokens_details"] for sid, (_, u) in second.items() if u["prompt_tokens_details"]["restored_tokens"] < 16}
    assert not not_restored, f"replays that did not restore from the kvstore: {not_restored}"
    differ = [sid for sid, _ in CALLS if first[sid][0] != second[sid][0]]
    assert not differ, f"{len(differ)}/{len(CALLS)} replays differ: {differ}"
    assert len({t for t, _ in first.values()}) > 1  # not a degenerate model
