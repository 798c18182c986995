"""End to end with a kvstore process: engine process checkpoints to it over Mooncake, restores after its
device KV is flushed, reports host/missing states, survives the store being killed and restarted. Each call's
usage (finished chunk and completion hook) says exactly how many prompt tokens came from the host store."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest

from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import engine, stack_config, start_stack

pytestmark = pytest.mark.slow

TEXT = "The agent called the search tool and read the result. " * 12


@pytest.fixture(scope="module")
def stack(models_dir):
    cfg = stack_config(
        models_dir, [engine("e0", "tiny-llama", page_size=16)],
        kvstore={"enabled": True, "capacity_mb": 64, "slab_kb": 32, "retry_after_s": 0.3, "rpc_timeout_s": 1.0},
    )
    s = start_stack(cfg)
    yield s
    s.stop()


def request(text: str, session: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        schema_version=1, request_id=uuid.uuid4().hex, session_id=session, model="tiny-llama", text=text,
        sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )


async def call(nc, subj, text, session) -> tuple[list[int], cpb.Usage]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subj.generate("e0"), request(text, session).SerializeToString(), reply=inbox)
    toks: list[int] = []
    while True:
        c = pb.TokenChunk.FromString((await sub.next_msg(30)).data)
        assert not c.HasField("error"), c.error
        toks += c.token_ids
        if c.finished:
            await sub.unsubscribe()
            return toks, c.usage


async def flush_until_host(nc, subj, session, want=pb.KV_HOST, timeout=10.0) -> pb.InstanceSnapshot:
    """Flush the engine's device caches until the snapshot reports ``session`` in state ``want``."""
    deadline = time.monotonic() + timeout
    while True:
        req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_FLUSH_CACHE)
        rep = pb.ControlReply.FromString((await nc.request(subj.control("e0"), req.SerializeToString(), timeout=5)).data)
        states = {s.session_id: s.state for s in rep.snapshot.sessions}
        if states.get(session) == want:
            return rep.snapshot
        assert time.monotonic() < deadline, f"session {session} state {states.get(session)}, want {want}"
        await asyncio.sleep(0.1)


async def test_restore_after_flush_equals_uninterrupted_and_store_failures(stack):
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    try:
        # uninterrupted: the session's KV stays on the device between the two calls
        hooks = await nc.subscribe(subj.completed())
        await nc.flush()
        a1, _ = await call(nc, subj, TEXT, "A")
        a2, u = await call(nc, subj, TEXT + " next turn", "A")
        assert u.cached_tokens > 0 and u.restored_tokens == 0, u  # a device hit restores nothing

        # forced out of the device, restored from the kvstore
        b1, _ = await call(nc, subj, TEXT, "B")
        snap = await flush_until_host(nc, subj, "B")
        assert snap.profile.restore_per_token >= 0
        b2, u = await call(nc, subj, TEXT + " next turn", "B")
        assert (b1, b2) == (a1, a2) and u.cached_tokens > 0
        # the part of the cached prefix restored from the store (not on the device after the flush)
        assert 0 < u.restored_tokens <= u.cached_tokens, u
        # the completion hook carries the same usage (telemetry's per-call KV hits by source)
        by_rid = {}
        while len(by_rid) < 4:
            h = pb.CompletionHook.FromString((await hooks.next_msg(10)).data)
            by_rid[h.request_id] = h
        assert [(h.session_id, h.usage.restored_tokens) for h in by_rid.values()] == [("A", 0), ("A", 0), ("B", 0), ("B", u.restored_tokens)]
        assert list(by_rid.values())[-1].usage == u
        await hooks.unsubscribe()

        # the store killed: the engine notices, recomputes, outputs identical, nothing hangs
        c1, _ = await call(nc, subj, TEXT, "C")
        await flush_until_host(nc, subj, "C")
        stack.kill("kvstore", signal.SIGKILL)
        t0 = time.monotonic()
        c2, u = await call(nc, subj, TEXT + " next turn", "C")
        assert (c1, c2) == (a1, a2) and time.monotonic() - t0 < 10 and u.restored_tokens == 0
        await flush_until_host(nc, subj, "C", want=pb.KV_MISSING)

        # restarted (empty, same address): checkpoints and restores resume
        stack.start_kvstore()
        deadline = time.monotonic() + 15
        while True:
            await asyncio.sleep(0.4)  # past retry_after_s and gRPC's reconnect backoff
            sid = f"D-{time.monotonic()}"
            d1, _ = await call(nc, subj, TEXT, sid)
            try:
                await flush_until_host(nc, subj, sid, timeout=2)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "the engine never used the restarted store"
        d2, u = await call(nc, subj, TEXT + " next turn", sid)
        assert (d1, d2) == (a1, a2) and 0 < u.restored_tokens <= u.cached_tokens
    finally:
        await nc.close()
