"""A cold-pool engine (two catalog models, one active at a time) as a process under LocalStack: served
through the router, switching on demand, open/close over `.control`, switch records on `.switch` and in
the heartbeat."""

from __future__ import annotations

import pytest

from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import client_for, engine, stack_config, start_stack
from tests.integration.test_engine_nats import collect, request

pytestmark = pytest.mark.slow

MODELS = ["tiny-llama", "tiny-qwen2"]


@pytest.fixture(scope="module")
def stack(models_dir):
    cold = engine("c0", MODELS[0], pool="cold", models=MODELS, weight_chunk_kb=256)
    s = start_stack(stack_config(models_dir, [cold]))
    yield s
    s.stop()


def test_router_serves_every_catalog_model(stack):
    client = client_for(stack)
    assert {m.id for m in client.models.list().data} >= set(MODELS)
    for model in (MODELS[1], MODELS[0], MODELS[1]):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1


async def test_control_open_close_and_switch_records(stack):
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    switches = await nc.subscribe(subj.switch("c0"))
    beats = await nc.subscribe(subj.heartbeat("c0"))

    async def control(op, model):
        msg = await nc.request(subj.control("c0"), pb.ControlRequest(schema_version=1, op=op, model=model).SerializeToString(), timeout=30)
        return pb.ControlReply.FromString(msg.data)

    try:
        snap = pb.InstanceSnapshot.FromString((await beats.next_msg(5)).data)
        active = next(m.model for m in snap.models if m.active)
        other = next(m for m in MODELS if m != active)
        assert snap.pool == pb.POOL_COLD and {m.model for m in snap.models if m.loaded} == set(MODELS)
        rep = await control(pb.CONTROL_OPEN_MODEL, other)  # make `other` the resident model
        assert rep.ok
        rec = pb.SwitchRecord.FromString((await switches.next_msg(20)).data)
        assert (rec.from_model, rec.to_model, rec.instance_id) == (active, other, "c0")
        assert rec.path in ("full_staged", "partial", "host_only") and rec.staged_bytes + rec.host_bytes == rec.weight_bytes
        assert rec.total_seconds >= rec.open_weights_seconds > 0
        for _ in range(20):
            snap = pb.InstanceSnapshot.FromString((await beats.next_msg(5)).data)
            if any(m.active and m.model == other for m in snap.models):
                break
        assert any(m.active and m.model == other for m in snap.models)
        assert snap.num_switches >= 1 and snap.switches[-1].to_model == other
        rep = await control(pb.CONTROL_CLOSE_MODEL, "no-such-model")
        assert not rep.ok and rep.error.http_status == 404
        rep = await control(pb.CONTROL_CLOSE_MODEL, active)
        assert rep.ok and [m.model for m in rep.snapshot.models] == [other]
        (c,) = await collect(nc, subj.generate("c0"), request(model=active))
        assert c.error.http_status == 404
        rep = await control(pb.CONTROL_OPEN_MODEL, active)
        assert rep.ok and {m.model for m in rep.snapshot.models if m.loaded} == set(MODELS)
        chunks = await collect(nc, subj.generate("c0"), request(model=active, max_tokens=4))
        assert chunks[-1].finished and not chunks[-1].HasField("error")
    finally:
        await nc.close()
