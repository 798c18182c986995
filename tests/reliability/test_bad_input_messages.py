"""Issue 44: hostile bodies on the Anthropic endpoints (``/v1/messages``, ``/v1/messages/count_tokens``) and
vLLM's chat extensions: a 4xx in the endpoint's own error shape naming the field, never a 5xx, the keep-alive
connection kept, the next good call served."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import MODEL, Figures, KeepAlive
from tests.reliability.test_bad_input import dumps, post_generated, values

pytestmark = pytest.mark.slow

MSGS, COUNT, CHAT = "/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def mbody(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **kw}


HOSTILE = [
    (MSGS, mbody(max_tokens=2**70), "max_tokens"),
    (MSGS, mbody(max_tokens="2"), "max_tokens"),
    (MSGS, mbody(top_k=2**32), "top_k"),
    (MSGS, mbody(temperature=float("inf")), "temperature"),
    (MSGS, mbody(system="\udc80"), "system"),
    (MSGS, mbody(system=[{"type": "text", "text": 5}]), "system.0"),
    (MSGS, mbody(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": [1]}}]}]), "messages.0.content.0.cache_control.ttl"),
    (MSGS, mbody(messages=[{"role": "user", "content": [None]}]), "messages.0.content.0.type"),
    (MSGS, mbody(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]}]), "messages.0.content.0"),
    (MSGS, mbody(messages="hi"), "messages"),
    (MSGS, mbody(tools={"name": "f"}), "tools"),
    (MSGS, mbody(tools=[{"name": "bad name!", "input_schema": {"type": "object"}}]), "tools.0.name"),
    (MSGS, mbody(tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": "yes"}), "tool_choice.disable_parallel_tool_use"),
    (MSGS, mbody(tool_choice={"type": "any"}), "tool_choice"),  # any without tools
    (MSGS, mbody(metadata={"user_id": 7}), "metadata.user_id"),
    (MSGS, mbody(stream="yes"), "stream"),
    (MSGS, mbody(stop_sequences="END"), "stop_sequences"),
    (MSGS, mbody(output_config={"effort": "high"}), "output_config"),
    (COUNT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, "max_tokens"),  # not a count_tokens field
    (COUNT, {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    (COUNT, {"model": MODEL}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs.tools"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": 5}, "cache_salt"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "continue_final_message": True}, "continue_final_message"),
]


@pytest.mark.parametrize("path,body,field", HOSTILE, ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{i}" for i, (p, _, f) in enumerate(HOSTILE)])
def test_hostile_bodies_are_4xx_naming_the_field_and_keep_the_connection(shared_stack, path, body, field):
    conn = KeepAlive(shared_stack.api)
    figs = Figures()
    try:
        status, _, data = conn.request("POST", path, dumps(body))
        figs.add(status, data)
        assert status == 400, f"{status} {data[:300]!r}"
        err = json.loads(data)
        if path == CHAT:
            assert err["error"]["param"] == field, data[:300]
        else:  # Anthropic's shape: the message names the field
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", data[:300]
            assert field in err["error"]["message"], data[:300]
        status2, _, data2 = conn.request("POST", MSGS, dumps(mbody()))
        figs.add(status2, data2)
        assert status2 == 200 and json.loads(data2)["type"] == "message", f"{data2[:300]!r}; {figs}"
        assert conn.reused, f"the router closed the keep-alive connection after the bad request; {figs}"
    finally:
        conn.close()


ANTHROPIC_FIELDS = ["model", "max_tokens", "messages", "system", "metadata", "stop_sequences", "temperature", "top_p", "top_k",
                    "tools", "tool_choice", "cache_control", "thinking", "service_tier", "stream"]
blocks = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"])},
                               optional={"text": values, "id": values, "name": values, "input": values, "tool_use_id": values,
                                         "content": values, "is_error": values, "cache_control": values})


@st.composite
def anthropic_bodies(draw):
    path = draw(st.sampled_from([MSGS, MSGS, COUNT]))
    body: dict = mbody() if path == MSGS else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for f in draw(st.lists(st.sampled_from(ANTHROPIC_FIELDS), min_size=1, max_size=3, unique=True)):
        body[f] = draw(values)
    if draw(st.booleans()):
        role = draw(st.sampled_from(["user", "assistant", "system"]))
        body["messages"] = [{"role": role, "content": draw(st.lists(blocks, min_size=1, max_size=3) | values)}]
    if path == MSGS:
        body["max_tokens"] = draw(st.integers(1, 3)) if draw(st.booleans()) else body.get("max_tokens")
        body["stream"] = False
    return path, body


def test_generated_anthropic_bodies_never_5xx_and_keep_the_connection(shared_stack):
    conn = KeepAlive(shared_stack.api)
    figs = Figures()

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(anthropic_bodies())
    def one(pb):
        path, body = pb
        status, data = post_generated(conn, figs, path, body)
        if status >= 400:
            err = json.loads(data)
            assert err.get("type") == "error" and isinstance(err["error"].get("message"), str), f"not Anthropic's error shape: {data[:300]!r}"
        assert conn.reused, f"connection not kept after {body!r}; {figs}"

    try:
        one()
    finally:
        conn.close()
    assert figs.s5xx == 0 and figs.lost == 0 and figs.sent >= 90, str(figs)
