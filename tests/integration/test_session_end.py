"""Issue 14 item 4 end to end (official openai client, real router + engine + kvstore processes): per-call hints
and their Dynamo aliases are accepted or refused with a 400 naming the field; a session ended by
``X-Session-End: true`` or ``DELETE /v1/sessions/{id}`` loses its lease, its device entry and its kvstore pages;
a tenant ends only its own sessions; an end during a call takes effect after that call; ending twice is fine."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import httpx
import openai
import pytest

from services.router.auth import key_hash
from talaria.config import load_config
from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import engine, stack_config, start_stack, wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
KEY_A, KEY_B = "sk-a-" + uuid.uuid4().hex, "sk-b-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def stack(models_dir):
    keys = [{"sha256": key_hash(KEY_A), "tenant": "team-a"}, {"sha256": key_hash(KEY_B), "tenant": "team-b"}]
    cfg = stack_config(
        models_dir, [engine("e0", MODEL, page_size=16)],
        kvstore={"enabled": True, "capacity_mb": 32, "slab_kb": 32, "retry_after_s": 0.3, "rpc_timeout_s": 2.0},
        auth={"api_keys": keys}, placement={"lease_ttl_s": 60.0},
    )
    s = start_stack(cfg)
    yield s
    s.stop()


def client(stack, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.api}/v1", api_key=key, max_retries=0, timeout=60)


def chat(stack, session: str, content: str, key: str = KEY_A, headers: dict | None = None, **kw):
    kw.setdefault("max_tokens", 4)
    return client(stack, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0,
        extra_headers={"X-Session-ID": session, **(headers or {})}, **kw,
    )


def delete(stack, session: str, key: str = KEY_A) -> dict:
    r = httpx.delete(f"{stack.api}/v1/sessions/{session}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def leases_live(stack, api: str | None = None) -> int:
    return httpx.get(f"{api or stack.api}/router/metrics", timeout=5).json()["placement"]["leases_live"]


def engine_sessions(stack) -> dict[str, int]:
    """Session id -> KV state in e0's snapshot (asked over NATS with a no-op control request)."""

    async def ask():
        nc = await connect(stack.nats_url, "test")
        try:
            req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_RESUME)
            rep = pb.ControlReply.FromString((await nc.request(Subjects(stack.cfg.namespace).control("e0"), req.SerializeToString(), timeout=5)).data)
            return {s.session_id: s.state for s in rep.snapshot.sessions}
        finally:
            await nc.drain()

    return asyncio.run(ask())


def test_hints_and_dynamo_aliases_accepted_bad_ones_400(stack):
    ok = chat(stack, "h1", "hello", extra_body={
        "priority": 3, "expected_output_tokens": 4, "expected_tool_s": 1.5, "cache_ttl_s": 30,
    })
    assert ok.parse().choices[0].finish_reason in ("stop", "length")
    dyn = chat(stack, "h2", "hello", extra_body={
        "nvext": {"agent_hints": {"priority": 3, "osl": 4, "latency_sensitivity": 1.2}, "cache_control": {"type": "ephemeral", "ttl": "5m"}},
    })
    assert dyn.parse().usage.completion_tokens >= 1
    for body, param in (
        ({"priority": "urgent"}, "priority"),
        ({"expected_output_tokens": 0}, "expected_output_tokens"),
        ({"nvext": {"agent_hints": {"osl": -1}}}, "nvext.agent_hints.osl"),
        ({"nvext": {"greed_sampling": True}}, "nvext.greed_sampling"),
        ({"nvext": {"agent_hints": {"speculative_prefill": True}}}, "nvext.agent_hints.speculative_prefill"),
        ({"cache_control": {"type": "ephemeral", "ttl": "forever"}}, "cache_control.ttl"),
        ({"priority": 1, "nvext": {"agent_hints": {"priority": 2}}}, "nvext.agent_hints.priority"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            chat(stack, "h3", "hello", extra_body=body)
        assert e.value.body["param"] == param, (body, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        chat(stack, "h3", "hello", headers={"X-Session-End": "perhaps"})
    assert e.value.body["param"] == "X-Session-End"


def test_session_end_header_drops_lease_device_entry_and_store_pages(stack):
    text = "The agent ran the test suite and read the failures one by one. " * 6
    chat(stack, "end-h", text)
    scoped = "team-a|end-h"
    wait_until(lambda: engine_sessions(stack).get(scoped) == pb.KV_DEVICE)
    assert wait_until(lambda: leases_live(stack) >= 1)
    before = leases_live(stack)
    r = chat(stack, "end-h", text + " Then it fixed them.", headers={"X-Session-End": "true"})
    assert r.parse().usage.prompt_tokens_details.cached_tokens > 0  # the session's KV served its last call
    wait_until(lambda: scoped not in engine_sessions(stack))  # neither on the device nor in the host store
    assert leases_live(stack) == before - 1  # the hook said session_ended: no lease was installed, the old one went
    # the store holds nothing of it (both calls' branches: the second prompt diverges from the first call's
    # committed tokens inside the chat template): after the device caches are flushed, nothing is restored
    flush = pb.ControlRequest(schema_version=1, op=pb.CONTROL_FLUSH_CACHE)

    async def flush_all():
        nc = await connect(stack.nats_url, "test")
        await nc.request(Subjects(stack.cfg.namespace).control("e0"), flush.SerializeToString(), timeout=5)
        await nc.drain()

    asyncio.run(flush_all())
    again = httpx.post(f"{stack.api}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}", "X-Session-ID": "end-h2"}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": text + " Then it fixed them."}], "max_tokens": 2, "temperature": 0,
    }).json()
    assert again["usage"]["prompt_tokens_details"]["restored_tokens"] == 0, again["usage"]


def test_delete_is_tenant_scoped_idempotent_and_waits_for_the_call_in_flight(stack):
    text = "The planner asked the coder to refactor the parser module. " * 6
    chat(stack, "shared-name", text)
    scoped = "team-a|shared-name"
    wait_until(lambda: engine_sessions(stack).get(scoped) == pb.KV_DEVICE)
    other = delete(stack, "shared-name", key=KEY_B)  # team-b's "shared-name" is another session
    assert other["deleted"] and other["broadcast"]  # b's router knows no such session: asked every instance
    assert engine_sessions(stack).get(scoped) == pb.KV_DEVICE  # a's session untouched
    mine = delete(stack, "shared-name")
    assert mine["instances"] == ["e0"] and not mine["broadcast"]
    wait_until(lambda: scoped not in engine_sessions(stack))
    assert delete(stack, "shared-name")["deleted"]  # again: nothing left, still fine

    # ended while a call streams: the call finishes untouched, then the session goes
    stream = client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=120, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-ID": "in-flight"}, extra_body={"ignore_eos": True},
    )
    chunks, started = [], threading.Event()

    def read():
        for c in stream:
            chunks.append(c)
            started.set()

    t = threading.Thread(target=read)
    t.start()
    assert started.wait(30)
    assert delete(stack, "in-flight")["deleted"]
    t.join(60)
    # tokens from usage, not from counting events: a lagging reader gets several tokens per event (issue 20 §5)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 120  # not cut short
    wait_until(lambda: "team-a|in-flight" not in engine_sessions(stack))


def test_delete_on_another_replica_drops_the_shared_lease(stack, tmp_path):
    """Leases live in the JetStream bucket shared by router replicas (tau 60 s here, so nothing expires): a
    DELETE on a replica that never placed the session finds it through its lease mirror, ends it on the engine
    that holds it, and the lease disappears for every replica."""
    data = load_config(stack.cfg_path).model_dump(mode="json")
    data["router"]["id"] = "router-1"
    path = tmp_path / "router-1.json"
    path.write_text(json.dumps(data))
    r1 = stack._spawn("router-1", ["-m", "services.router", "--config", str(path)], "listening on")
    assert r1.ready.wait(60), "second router did not start"
    api1 = r1.ready_line.rsplit(" ", 1)[-1]
    try:
        text = "The coder opened the file and asked the linter what was wrong with it. " * 5
        before = leases_live(stack)
        chat(stack, "replicated", text)
        wait_until(lambda: leases_live(stack, api1) >= before + 1)  # mirrored from the bucket
        r = httpx.delete(f"{api1}/v1/sessions/replicated", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30).json()
        assert r["instances"] == ["e0"] and not r["broadcast"]  # known to router-1 through the mirrored lease
        wait_until(lambda: leases_live(stack) == before and leases_live(stack, api1) == before, timeout=10)
        wait_until(lambda: "team-a|replicated" not in engine_sessions(stack))
    finally:
        stack.children.pop("router-1").terminate()
        r1.proc.wait(30)
