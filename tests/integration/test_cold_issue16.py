"""The issue-16 switches end to end: a cold-pool engine process configured with ``token_deadlines``,
``unified_residency`` and ``partial_layers`` serves every catalog model through the router (official openai
client), reports per-token deadline attainment in its heartbeat and round summaries, and its switch records
still account for every weight byte (streamed bytes count as host bytes)."""

from __future__ import annotations

import pytest

from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import client_for, engine, stack_config, start_stack

pytestmark = pytest.mark.slow

MODELS = ["tiny-llama", "tiny-qwen2"]


@pytest.fixture(scope="module")
def stack(models_dir):
    cold = engine("c16", MODELS[0], pool="cold", models=MODELS, weight_chunk_kb=256, token_deadlines=True,
                  unified_residency=True, partial_layers=True, slot_ttft_s=5.0, slot_tpot_s=1.0)
    s = start_stack(stack_config(models_dir, [cold]))
    yield s
    s.stop()


async def test_all_three_switches_serve_and_report(stack):
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    switches = await nc.subscribe(subj.switch("c16"))
    rounds = await nc.subscribe(subj.round("c16"))
    beats = await nc.subscribe(subj.heartbeat("c16"))
    await nc.flush()  # the subscriptions are in place before the calls
    try:
        client = client_for(stack)
        for model in (MODELS[1], MODELS[0], MODELS[1]):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
            assert r.usage.completion_tokens >= 1
        rec = pb.SwitchRecord.FromString((await switches.next_msg(20)).data)
        assert rec.staged_bytes + rec.host_bytes == rec.weight_bytes
        summ = pb.RoundSummary.FromString((await rounds.next_msg(20)).data)
        assert summ.cold_scheduler == "token_deadlines" and summ.HasField("token_deadlines")
        for _ in range(50):
            snap = pb.InstanceSnapshot.FromString((await beats.next_msg(5)).data)
            if snap.cold_scheduler == "token_deadlines" and snap.rounds >= 1:
                break
        assert snap.cold_scheduler == "token_deadlines" and 0.0 <= snap.deadline_attainment <= 1.0
    finally:
        await nc.close()


SYSTEM = "You are a coding agent working in a repository with many files. " * 6


@pytest.fixture(scope="module")
def kv_stack(models_dir):
    cold = engine("c17", MODELS[0], pool="cold", models=MODELS, weight_chunk_kb=256, host_kv=True, partial_layers=True)
    s = start_stack(stack_config(models_dir, [cold], kvstore={"enabled": True}))
    yield s
    s.stop()


async def test_host_kv_restores_go_through_the_transfer_scheduler(kv_stack):
    """partial_layers: a returning session's KV restore is a KV-class transfer on the same channel as the
    streamed layer groups (κ-floor), and the restore still serves the return."""
    s = kv_stack
    client = client_for(s)
    nc = await connect(s.nats_url, "test")
    beats = await nc.subscribe(Subjects(s.cfg.namespace).heartbeat("c17"))
    await nc.flush()

    def call(model, msgs, session):
        return client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True}, extra_headers={"X-Session-ID": session})

    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]
        first = call(MODELS[0], msgs, "agent-1")
        call(MODELS[1], [{"role": "user", "content": "hello"}], "agent-2")  # switch away: agent-1's KV leaves
        msgs2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "2 failed."}]
        second = call(MODELS[0], msgs2, "agent-1")
        assert second.usage.prompt_tokens_details.restored_tokens > 0
        for _ in range(50):
            snap = pb.InstanceSnapshot.FromString((await beats.next_msg(5)).data)
            if snap.transfer_kv_bytes > 0:
                break
        assert snap.transfer_kv_bytes > 0 and snap.transfer_stream_bytes + snap.transfer_kv_bytes > 0
    finally:
        await nc.close()
