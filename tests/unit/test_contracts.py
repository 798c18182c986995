"""Wire contracts: generated code is current, messages round-trip, subjects are well formed."""

from __future__ import annotations

import pytest

from talaria.protogen import generate
from talaria.subjects import Subjects
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb


def test_generated_code_is_up_to_date():
    assert generate(check=True) == 0


def test_generate_request_round_trip():
    req = pb.GenerateRequest(
        schema_version=1,
        request_id="r1",
        session_id="s1",
        model="m",
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
        sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, max_tokens=7, stop=["\n"], has_seed=True, seed=3),
        prefix=cpb.PrefixHandle(model="m", committed_tokens=40, page_size=16, full_pages=2),
        trace_context={"traceparent": "00-abc-def-01"},
    )
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("prompt") == "messages"


def test_snapshot_and_hook_round_trip():
    snap = pb.InstanceSnapshot(schema_version=1, instance_id="e0", epoch=5, seq=9, models=[pb.ModelState(model="m", loaded=True, max_context=2048)])
    snap.sessions.append(pb.SessionState(session_id="s", model="m", committed_tokens=33, state=pb.KV_DEVICE))
    assert pb.InstanceSnapshot.FromString(snap.SerializeToString()) == snap
    hook = pb.CompletionHook(schema_version=1, session_id="s", usage=cpb.Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=1))
    assert pb.CompletionHook.FromString(hook.SerializeToString()) == hook


def test_subjects_are_namespaced_and_validated():
    s = Subjects("ns1")
    assert s.generate("engine-0") == "ns1.engine.engine-0.generate"
    assert s.heartbeat("e") == "ns1.engine.e.heartbeat"
    assert s.all_heartbeats() == "ns1.engine.*.heartbeat"
    assert s.completed() == "ns1.hook.completed"
    assert Subjects.instance_of(s.control("e7")) == "e7"
    for bad in ("a.b", "a b", "*", ">", ""):
        with pytest.raises(ValueError):
            s.generate(bad)
    with pytest.raises(ValueError):
        Subjects("bad.ns")
