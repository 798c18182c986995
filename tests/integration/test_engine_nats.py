"""The engine's NATS contract, exercised directly (no router): accept/stream/finish, completion hook,
heartbeats, cancel, control, and the queue bound (429)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from talaria.natsutil import connect
from talaria.subjects import PROBE_HEADER, Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import engine, stack_config, start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(models_dir):
    cfg = stack_config(models_dir, [engine("e0", "tiny-llama"), engine("tight", "tiny-qwen3", max_queue=1, max_num_seqs=1)])
    s = start_stack(cfg)
    yield s
    s.stop()


def request(model="tiny-llama", text="hello there", max_tokens=8, session="", **sp) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        schema_version=1,
        request_id=uuid.uuid4().hex,
        session_id=session,
        model=model,
        text=text,
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, **sp),
    )


async def collect(nc, subject, req, until_finished=True, timeout=30):
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, req.SerializeToString(), reply=inbox)
    chunks = []
    while True:
        msg = await sub.next_msg(timeout)
        if msg.headers and PROBE_HEADER in msg.headers:
            continue  # the engine checking that we still listen (calls older than its probe period)
        c = pb.TokenChunk.FromString(msg.data)
        chunks.append(c)
        if c.finished or c.HasField("error") or not until_finished:
            break
    await sub.unsubscribe()
    return chunks


async def test_stream_hook_and_heartbeat(stack):
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    hooks = await nc.subscribe(subj.completed())
    beats = await nc.subscribe(subj.heartbeat("e0"))
    try:
        req = request(session="s-hook", max_tokens=8, ignore_eos=True)
        chunks = await collect(nc, subj.generate("e0"), req)
        assert chunks[0].accepted and chunks[0].usage.prompt_tokens > 0
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        last = chunks[-1]
        assert last.finished and last.finish_reason == "length" and last.usage.completion_tokens == 8
        assert sum(len(c.token_ids) for c in chunks) == 8
        hook = pb.CompletionHook.FromString((await hooks.next_msg(10)).data)
        assert hook.request_id == req.request_id and hook.session_id == "s-hook" and hook.instance_id == "e0"
        assert hook.prefix.committed_tokens >= chunks[0].usage.prompt_tokens
        for _ in range(10):  # snapshots are taken after steps; the session shows up within a few beats
            snap = pb.InstanceSnapshot.FromString((await beats.next_msg(5)).data)
            assert snap.instance_id == "e0" and snap.models[0].model == "tiny-llama" and snap.models[0].max_context > 0
            mine = [s for s in snap.sessions if s.session_id == "s-hook"]
            if mine:
                break
        assert mine and mine[0].committed_tokens == hook.prefix.committed_tokens and mine[0].state == pb.KV_DEVICE
    finally:
        await nc.close()


async def test_cancel_stops_a_long_call(stack):
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    try:
        req = request(max_tokens=1000, ignore_eos=True)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subj.generate("e0"), req.SerializeToString(), reply=inbox)
        assert pb.TokenChunk.FromString((await sub.next_msg(10)).data).accepted
        await sub.next_msg(10)  # a token chunk
        await nc.publish(subj.cancel("e0"), pb.CancelRequest(schema_version=1, request_id=req.request_id).SerializeToString())
        tokens = 0
        while True:
            c = pb.TokenChunk.FromString((await sub.next_msg(10)).data)
            tokens += len(c.token_ids)
            if c.finished:
                break
        assert c.finish_reason == "abort" and tokens < 900
    finally:
        await nc.close()


async def test_errors_wrong_model_bad_schema_and_control(stack):
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    try:
        (c,) = await collect(nc, subj.generate("e0"), request(model="tiny-qwen2"))
        assert c.error.http_status == 404 and c.error.code == "model_not_found"
        newer = request()
        newer.schema_version = 99
        (c,) = await collect(nc, subj.generate("e0"), newer)
        assert c.error.code == "unsupported_schema"
        (c,) = await collect(nc, subj.generate("e0"), request(text="x " * 10000, max_tokens=4))
        assert c.error.http_status == 413 and c.error.code == "context_length_exceeded"
        rep = pb.ControlReply.FromString((await nc.request(subj.control("e0"), pb.ControlRequest(schema_version=1, op=pb.CONTROL_DRAIN).SerializeToString(), timeout=5)).data)
        assert rep.ok and rep.snapshot.draining
        (c,) = await collect(nc, subj.generate("e0"), request())
        assert c.error.http_status == 503 and c.error.code == "draining"
        rep = pb.ControlReply.FromString((await nc.request(subj.control("e0"), pb.ControlRequest(schema_version=1, op=pb.CONTROL_RESUME).SerializeToString(), timeout=5)).data)
        assert rep.ok and not rep.snapshot.draining
        chunks = await collect(nc, subj.generate("e0"), request())
        assert chunks[-1].finished and not chunks[-1].HasField("error")
    finally:
        await nc.close()


async def test_queue_bound_answers_429(stack):
    """max_num_seqs=1, max_queue=1: two calls fit (one running, one waiting), the third is refused."""
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    try:
        long = [request(model="tiny-qwen3", max_tokens=300, ignore_eos=True) for _ in range(2)]
        firsts = await asyncio.gather(*(collect(nc, subj.generate("tight"), r, until_finished=False) for r in long))
        assert all(f[0].accepted for f in firsts)
        (c,) = await collect(nc, subj.generate("tight"), request(model="tiny-qwen3"))
        assert c.error.http_status == 429 and c.error.code == "overloaded"
        for r in long:
            await nc.publish(subj.cancel("tight"), pb.CancelRequest(schema_version=1, request_id=r.request_id).SerializeToString())
    finally:
        await nc.close()
