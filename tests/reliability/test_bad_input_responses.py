"""Hostile input on the stored-Responses endpoints (``store``, ``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}``) and the reasoning fields of every protocol (chat ``reasoning_effort``, Responses
``reasoning``, Messages ``thinking``) against a model that does not reason: a 4xx naming the field (OpenAI's
``param``; Anthropic's message), never a 5xx, the keep-alive connection kept, the next good call served."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import MODEL, Figures, KeepAlive
from tests.reliability.test_bad_input import dumps, post_generated, texts, values

pytestmark = pytest.mark.slow

RESP, CHAT, MSGS = "/v1/responses", "/v1/chat/completions", "/v1/messages"


def rbody(**kw) -> dict:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 2, **kw}


def cbody(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def mbody(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **kw}


HOSTILE = [
    (RESP, rbody(store="yes"), 400, "store"),
    (RESP, rbody(previous_response_id=5), 400, "previous_response_id"),
    (RESP, rbody(previous_response_id="resp_" + "0" * 32), 404, "previous_response_id"),
    (RESP, rbody(previous_response_id="../etc/passwd"), 404, "previous_response_id"),
    (RESP, rbody(previous_response_id="\udc80"), 400, "previous_response_id"),
    (RESP, rbody(reasoning="high"), 400, "reasoning"),
    (RESP, rbody(reasoning={"effort": "extreme"}), 400, "reasoning.effort"),
    (RESP, rbody(reasoning={"effort": ["low"]}), 400, "reasoning.effort"),
    (RESP, rbody(reasoning={"summary": "detailed"}), 400, "reasoning.summary"),
    (RESP, rbody(reasoning={"effort": "low", "budget": 5}), 400, "reasoning.budget"),
    (RESP, rbody(reasoning={"effort": "low"}), 400, "reasoning.effort"),  # the model does not reason: the engine's 400
    (CHAT, cbody(reasoning_effort="extreme"), 400, "reasoning_effort"),
    (CHAT, cbody(reasoning_effort=3), 400, "reasoning_effort"),
    (CHAT, cbody(reasoning_effort="high"), 400, "reasoning_effort"),  # the engine's 400
    (CHAT, cbody(reasoning_effort="low", stream=True), 400, "reasoning_effort"),
    (MSGS, mbody(thinking={"type": "enabled"}), 400, "thinking.budget_tokens"),
    (MSGS, mbody(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1500), 400, "thinking"),  # the engine's 400
    (MSGS, mbody(thinking="on"), 400, "thinking.type"),
    (MSGS, mbody(thinking={"type": "disabled", "budget_tokens": 1024}), 400, "thinking.budget_tokens"),
]


@pytest.mark.parametrize("path,body,status,field", HOSTILE, ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{i}" for i, (p, _, _, f) in enumerate(HOSTILE)])
def test_hostile_bodies_are_4xx_naming_the_field_and_keep_the_connection(shared_stack, path, body, status, field):
    conn = KeepAlive(shared_stack.api)
    figs = Figures()
    try:
        got, _, data = conn.request("POST", path, dumps(body))
        figs.add(got, data)
        assert got == status, f"{got} {data[:300]!r}"
        err = json.loads(data)
        if path == MSGS:
            assert err["type"] == "error" and err["error"]["message"].startswith(field), data[:300]
        else:
            assert err["error"]["param"] == field, data[:300]
        ok, _, data2 = conn.request("POST", RESP, dumps(rbody(store=True)))
        figs.add(ok, data2)
        assert ok == 200 and json.loads(data2)["object"] == "response", f"{data2[:300]!r}; {figs}"
        assert conn.reused, f"the router closed the keep-alive connection after the bad request; {figs}"
    finally:
        conn.close()


reasoning = st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"]) | values,
                                                "summary": st.sampled_from(["auto", "concise", "detailed"]) | values, "generate_summary": values})
RESPONSES_FIELDS = ["model", "input", "instructions", "store", "previous_response_id", "reasoning", "tools", "tool_choice", "text",
                    "max_output_tokens", "temperature", "top_p", "include", "metadata", "truncation", "background", "parallel_tool_calls"]


@st.composite
def responses_bodies(draw):
    body = rbody(store=draw(st.booleans()))
    for f in draw(st.lists(st.sampled_from(RESPONSES_FIELDS), min_size=1, max_size=3, unique=True)):
        body[f] = draw(reasoning) if f == "reasoning" and draw(st.booleans()) else draw(values)
    if draw(st.booleans()):
        body["input"] = draw(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["message", "reasoning", "function_call", "function_call_output"])},
                                                            optional={"role": values, "content": values, "summary": values, "call_id": values,
                                                                      "name": values, "arguments": values, "output": values}), min_size=1, max_size=3))
    body["stream"] = False
    body["max_output_tokens"] = 2
    return body


def test_generated_responses_bodies_never_5xx_and_name_the_field(shared_stack):
    """Generated bodies mixing the store, chain and reasoning fields: never a 5xx; a 400 names a field."""
    conn = KeepAlive(shared_stack.api)
    figs = Figures()

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(responses_bodies())
    def one(body):
        status, data = post_generated(conn, figs, RESP, body)
        if status == 400:
            err = json.loads(data)["error"]
            assert isinstance(err.get("message"), str) and err.get("param"), f"a 400 naming no field: {data[:300]!r} for {body!r}"
        assert conn.reused, f"connection not kept after {body!r}; {figs}"

    try:
        one()
    finally:
        conn.close()
    assert figs.s5xx == 0 and figs.lost == 0 and figs.sent >= 90, str(figs)


def test_generated_response_ids_on_get_and_delete_never_5xx(shared_stack):
    """Any id on ``GET`` / ``DELETE /v1/responses/{id}``: a 404 naming ``response_id`` (or a routing 404/405),
    never a 5xx; a stored response is found by its id and gone after ``DELETE``."""
    conn = KeepAlive(shared_stack.api)
    figs = Figures()

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(st.sampled_from(["GET", "DELETE"]), texts.filter(bool) | st.just("resp_" + "f" * 32))
    def one(method, rid):
        path = RESP + "/" + urllib.parse.quote(rid.encode("utf-8", "surrogatepass"), safe="")
        status, _, data = conn.request(method, path)
        figs.add(status, data)
        assert status < 500, f"{status} for {method} {path}: {data[:300]!r}"
        assert status in (404, 405), f"{status} for {method} {path}: {data[:300]!r}"

    try:
        one()
        status, _, data = conn.request("POST", RESP, dumps(rbody(store=True)))
        rid = json.loads(data)["id"]
        assert conn.request("GET", f"{RESP}/{rid}")[0] == 200
        assert conn.request("DELETE", f"{RESP}/{rid}")[0] == 200
        status, _, data = conn.request("GET", f"{RESP}/{rid}")
        assert status == 404 and json.loads(data)["error"]["param"] == "response_id", data[:300]
        assert conn.reused
    finally:
        conn.close()
    assert figs.s5xx == 0 and figs.sent >= 60, str(figs)
