"""Issue 17 fencing, router side: the router places a call on a lease whose engine epoch it still believes
(its snapshot is older than the engine's restart), the engine refuses it (``resume_fenced``), and the
router places the call again without the lease; the client gets its answer. Real nats-server, the real
router app over ASGI; the engine is a scripted NATS responder (it only has to refuse or answer)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from talaria.natsutil import EmbeddedNats, connect
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from talaria.v1 import router_pb2 as rpb

OLD_EPOCH, NEW_EPOCH = 5, 6


@pytest.fixture(scope="module")
def nats_url():
    with EmbeddedNats() as n:
        yield n.url


async def _scripted_engine(nc, subject: str, seen: list[int]):
    """Refuses a call naming another epoch (what ``EngineService._fence`` does), answers any other."""

    async def on_msg(msg) -> None:
        req = pb.GenerateRequest.FromString(msg.data)
        seen.append(req.resume_epoch)
        if req.resume_epoch and req.resume_epoch != NEW_EPOCH:
            err = cpb.Error(code="resume_fenced", message="restarted", http_status=503)
            await nc.publish(msg.reply, pb.TokenChunk(request_id=req.request_id, seq=0, finished=True, finish_reason="error", error=err).SerializeToString())
            return
        usage = cpb.Usage(prompt_tokens=5, completion_tokens=1)
        await nc.publish(msg.reply, pb.TokenChunk(request_id=req.request_id, seq=0, accepted=True, usage=usage, instance_id="e0").SerializeToString())
        await nc.publish(msg.reply, pb.TokenChunk(request_id=req.request_id, seq=1, text="ok", token_ids=[1], finished=True, finish_reason="stop", usage=usage).SerializeToString())

    sub = await nc.subscribe(subject, cb=on_msg)
    await nc.flush()  # the server knows the subscription before the router publishes (else: NATS no responders)
    return sub


async def _lease_call(nats_url: str, namespace: str, epoch: int, state_hook=None) -> tuple:
    """One session call through the real router app with a lease on ``e0`` from engine ``epoch`` (the router's
    snapshot of ``e0`` says that epoch too); ``state_hook(state)`` may alter the router first. Returns (the
    response, the router state, the ``resume_epoch`` of every call the scripted engine saw)."""
    from services.router.app import create_app
    from services.router.service import make_state
    from talaria.config import parse_config

    cfg = parse_config({"namespace": namespace, "router": {"placement": {"lease_store": "memory", "lease_ttl_s": 60}}, "engines": [{"id": "e0", "models": ["m"]}]})
    state = make_state(cfg)
    state.nc = await connect(nats_url, "router-test")
    engine_nc = await connect(nats_url, "engine-test")
    seen: list[int] = []
    sub = await _scripted_engine(engine_nc, state.subjects.generate("e0"), seen)
    if state_hook is not None:
        state_hook(state)
    try:
        now = time.time()
        snap = pb.InstanceSnapshot(instance_id="e0", epoch=epoch, seq=1, heartbeat_period_s=3600, sent_unix=now - 1)
        snap.models.append(pb.ModelState(model="m", loaded=True, active=True, max_context=4096))
        state.gateway.on_snapshot(snap)
        lease = rpb.Lease(
            schema_version=1, lease_id="prev", session_id="s", model="m", instance_id="e0", instance_epoch=epoch,
            prefix=cpb.PrefixHandle(model="m", committed_tokens=10), t_done_unix=now, t_exp_unix=now + 60,
        )
        state.lease_store.install_now(lease)
        app = create_app(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            r = await asyncio.wait_for(http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1}, headers={"X-Session-ID": "s"}), 30)
        return r, state, seen
    finally:
        await sub.unsubscribe()
        await engine_nc.close()
        await state.nc.close()


async def test_a_fenced_lease_call_is_placed_again_without_the_lease(nats_url):
    r, state, seen = await _lease_call(nats_url, "fence", OLD_EPOCH)  # the router's view: the engine before its restart
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "ok"
    assert seen == [OLD_EPOCH, 0]  # the lease call was fenced, the retry carried no lease
    assert state.counters["resume_fenced"] == 1
    assert r.headers["x-talaria-placement"] != "lease"


async def test_a_lease_raced_away_leaves_its_instance_a_candidate(nats_url):
    """A lease the policy honoured but another router replica consumed first (or a newer lease replaced it:
    the revision moved) sends nothing; the call is placed again without the lease, its instance included.
    The instance used to count as tried, so the one engine of the model was excluded and the caller got
    503 ``no_healthy_instance`` (seen in CI with one router racing its own hook's lease update)."""

    async def lost(session_id, model, rev) -> bool:  # another replica consumed it first
        return False

    def lose_every_consume(state) -> None:
        state.lease_store.consume = lost

    r, state, seen = await _lease_call(nats_url, "race", NEW_EPOCH, lose_every_consume)
    assert r.status_code == 200, r.text
    assert seen == [0]  # one forward, without the lease
    assert state.gateway.stats["lease_miss_raced"] == 1
    assert r.headers["x-talaria-placement"] != "lease"
