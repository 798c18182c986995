"""The whole Talaria path on one cold instance: the slot scheduler (rounds, SP) over the cold engine with
its host KV tier on a real kvstore. A session's KV survives a switch to another model (checkpointed, the
switch barrier drains it, restored on return instead of recomputed), the outputs equal those of an
instance that never switched, round summaries go out on `.round`, and the heartbeat carries the
scheduler's overload fields."""

from __future__ import annotations

import pytest

from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import client_for, engine, stack_config, start_stack

pytestmark = pytest.mark.slow

MODELS = ["tiny-llama", "tiny-qwen2"]
SYSTEM = "You are a coding agent working in a repository with many files. " * 6


@pytest.fixture(scope="module")
def stacks(models_dir):
    cold = engine("c0", MODELS[0], pool="cold", models=MODELS, weight_chunk_kb=256, slot_scheduler=True, host_kv=True)
    hot = engine("h0", MODELS[0], host_kv=False)  # the reference: never switches, never leaves the device
    s = start_stack(stack_config(models_dir, [cold], kvstore={"enabled": True}))
    ref = start_stack(stack_config(models_dir, [hot]))
    yield s, ref
    s.stop()
    ref.stop()


def call(client, model, msgs, session):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=msgs, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, extra_headers={"X-Session-ID": session}
    )
    return raw.parse()


async def test_session_kv_survives_a_model_switch(stacks):
    s, ref = stacks
    client, ref_client = client_for(s), client_for(ref)
    nc = await connect(s.nats_url, "test")
    subj = Subjects(s.cfg.namespace)
    rounds = await nc.subscribe(subj.round("c0"))
    beats = await nc.subscribe(subj.heartbeat("c0"))
    await nc.flush()  # the subscriptions reach the server before the (blocking) client calls below
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]
        first = call(client, MODELS[0], msgs, "agent-1")
        # Another model's call: the instance switches away; agent-1's KV leaves the device.
        other = call(client, MODELS[1], [{"role": "user", "content": "hello"}], "agent-2")
        assert other.usage.completion_tokens == 12
        msgs2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "2 failed."}]
        second = call(client, MODELS[0], msgs2, "agent-1")
        # The return is restored from the host store, not recomputed; the router's usage says so
        # (`restored_tokens`: Talaria's extension of OpenAI's prompt_tokens_details).
        d2 = second.usage.prompt_tokens_details
        assert d2.cached_tokens >= first.usage.prompt_tokens - 16
        assert 0 < d2.restored_tokens <= d2.cached_tokens
        assert first.usage.prompt_tokens_details.restored_tokens == 0
        # Same tokens as an instance that never switched.
        ref_first = call(ref_client, MODELS[0], msgs, "r-1")
        ref_second = call(ref_client, MODELS[0], msgs + [{"role": "assistant", "content": ref_first.choices[0].message.content}, {"role": "user", "content": "2 failed."}], "r-1")
        assert first.choices[0].message.content == ref_first.choices[0].message.content
        assert second.choices[0].message.content == ref_second.choices[0].message.content
        # the reference's return is a device hit: cached, nothing restored
        assert ref_second.usage.prompt_tokens_details.cached_tokens > 0 and ref_second.usage.prompt_tokens_details.restored_tokens == 0

        r = pb.RoundSummary.FromString((await rounds.next_msg(30)).data)
        assert r.instance_id == "c0" and r.wall_s == pytest.approx(r.active_s + r.switch_s, abs=1e-6)
        assert r.flags["sp"] and r.flags["host_kv"] and r.bound_s > 0
        snap = pb.InstanceSnapshot.FromString((await beats.next_msg(5)).data)
        assert snap.pool == pb.POOL_COLD and snap.round_remaining_s >= 0
        for _ in range(20):
            if any(x.session_id == "agent-2" and x.state == pb.KV_HOST for x in snap.sessions):
                break
            snap = pb.InstanceSnapshot.FromString((await beats.next_msg(5)).data)
        # agent-2's model is no longer resident: its session is restorable from the host store.
        assert any(x.session_id == "agent-2" and x.model == MODELS[1] and x.state == pb.KV_HOST for x in snap.sessions)
    finally:
        await nc.close()
