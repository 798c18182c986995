"""Responses API translation (pure): request -> chat body, chat output -> response / stream events."""

from __future__ import annotations

import pytest

from services.router.errors import APIError
from services.router.responses_api import StreamTranslator, conversation, from_chat, responses_param, to_chat

TOOL = {"type": "function", "name": "get_weather", "description": "w", "parameters": {"type": "object", "properties": {}}, "strict": True}


def test_agents_sdk_shaped_request_translates():
    body = {
        "model": "m", "instructions": "Be brief.", "tools": [TOOL], "tool_choice": "auto", "stream": False, "include": [],
        "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ],
        "max_output_tokens": 50, "parallel_tool_calls": False, "text": {"format": {"type": "json_schema", "name": "X", "schema": {"type": "object"}, "strict": True}},
    }
    chat = to_chat(body)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][2] == {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert chat["tools"][0]["function"]["name"] == "get_weather" and chat["max_tokens"] == 50 and chat["parallel_tool_calls"] is False
    assert chat["response_format"]["json_schema"]["name"] == "X"


@pytest.mark.parametrize(
    "extra,param",
    [({"conversation": "conv_1"}, "conversation"), ({"background": True}, "background"), ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
     ({"bogus": 1}, "bogus"), ({"input": [{"type": "image"}]}, "input.0.type"), ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
     ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"), ({"reasoning": {"effort": "low", "x": 1}}, "reasoning.x"), ({"reasoning": "high"}, "reasoning")],
)
def test_unsupported_responses_fields_are_400(extra, param):
    with pytest.raises(APIError) as ei:
        to_chat({"model": "m", "input": "hi", **extra})
    assert ei.value.status == 400 and ei.value.param == param


def test_from_chat_text_and_calls():
    chat = {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": "Let me see.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 8}}}
    r = from_chat({"model": "m"}, chat)
    assert [o["type"] for o in r["output"]] == ["message", "function_call"]
    assert r["output"][1]["call_id"] == "call_1" and r["output"][1]["arguments"] == "{\"a\": 1}"
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == 8 and r["status"] == "completed"


def test_stream_translator_event_sequence():
    tr = StreamTranslator({"model": "m"})
    evs = tr.start()
    evs += tr.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    evs += tr.feed({"choices": [{"delta": {"content": "Hi"}}]})
    evs += tr.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]})
    evs += tr.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]})
    evs += tr.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    evs += tr.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    evs += tr.finish()
    types = [e["type"] for e in evs]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = evs[-1]["response"]
    assert final["output"][1]["arguments"] == "{}" and final["usage"]["total_tokens"] == 5


def test_a_stored_conversation_continues_as_history_and_keeps_its_session():
    """Issue 44: ``previous_response_id`` -> the stored conversation goes after the (new) instructions."""
    body = {"model": "m", "instructions": "Be brief.", "input": "Weather?", "tools": [TOOL]}
    chat = to_chat(body)
    resp = from_chat(body, {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}}], "usage": {}}, rid="resp_" + "a" * 32)
    conv = conversation(body, chat, resp)
    assert conv == [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Looking.", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    nxt = {"model": "m", "instructions": "New rules.", "previous_response_id": resp["id"], "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}
    c2 = to_chat(nxt, history=conv, session="S")
    assert [m["role"] for m in c2["messages"]] == ["system", "user", "assistant", "tool"] and c2["messages"][0]["content"] == "New rules."
    assert c2["session_id"] == "S" and resp["id"] == "resp_" + "a" * 32


async def _memory_store_bounds():
    from services.router.responses_store import MemoryResponses

    now = [0.0]
    st = MemoryResponses(ttl_s=10.0, max_entries=2, max_response_bytes=200, clock=lambda: now[0])
    rid = lambda i: "resp_" + f"{i:032x}"  # noqa: E731
    assert await st.put("t", rid(1), {"x": 1}) and await st.put("t", rid(2), {"x": 2})
    assert await st.get("u", rid(1)) is None  # another tenant's id is absent
    assert await st.get("t", rid(1)) == {"x": 1}  # read: now the most recently used
    assert await st.put("t", rid(3), {"x": 3}) and len(st) == 2
    assert await st.get("t", rid(2)) is None and await st.get("t", rid(1)) == {"x": 1}  # the least recently used went
    assert not await st.put("t", rid(4), {"x": "y" * 300})  # over the record cap: not stored
    now[0] = 10.0
    assert await st.get("t", rid(1)) is None and await st.get("t", rid(3)) is None  # expired
    assert await st.put("t", rid(5), {}) and await st.delete("t", rid(5)) and not await st.delete("t", rid(5))


def test_memory_response_store_is_bounded_tenant_scoped_and_expires():
    import asyncio

    asyncio.run(_memory_store_bounds())


def test_reasoning_effort_and_reasoning_items():
    chat = to_chat({"model": "m", "input": [{"type": "reasoning", "id": "rs_1", "summary": []}, {"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "T"}]}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "more"}],
                    "reasoning": {"effort": "low", "summary": "auto"}})
    assert chat["reasoning_effort"] == "low" and chat["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A", "reasoning_content": "T"}, {"role": "user", "content": "more"}]
    assert "reasoning_effort" not in to_chat({"model": "m", "input": "hi", "reasoning": {}})
    assert responses_param("reasoning_effort") == "reasoning.effort" and responses_param("messages") == "messages"
    out = from_chat({"model": "m"}, {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "A", "reasoning_content": "R"}}],
                                     "usage": {"completion_tokens": 5, "completion_tokens_details": {"reasoning_tokens": 3}}})
    assert [i["type"] for i in out["output"]] == ["reasoning", "message"] and out["output"][0]["content"][0]["text"] == "R"
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    st = StreamTranslator({"model": "m"})
    ev = st.start()
    for d in ({"reasoning_content": "R1"}, {"reasoning_content": "R2"}, {"content": "A"}):
        ev += st.feed({"choices": [{"delta": d, "finish_reason": None}]})
    ev += st.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]}) + st.finish()
    types = [e["type"] for e in ev]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert [e["delta"] for e in ev if e["type"] == "response.reasoning_text.delta"] == ["R1", "R2"]
    done = ev[-1]["response"]["output"]
    assert [i["type"] for i in done] == ["reasoning", "message"] and done[0]["content"][0]["text"] == "R1R2"


def test_a_stored_conversation_keeps_the_turns_reasoning():
    resp = from_chat({"model": "m"}, {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": "A", "reasoning_content": "R",
                     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}], "usage": {}})
    chat = to_chat({"model": "m", "input": "q"})
    assert conversation({"model": "m", "input": "q"}, chat, resp)[1:] == [
        {"role": "assistant", "content": "A", "reasoning_content": "R", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
