"""Anthropic Messages translation (pure, issue 44): request -> chat body, chat output -> message / events.

The field list comes from the installed ``anthropic`` package, so a field added by a newer SDK fails
``test_every_sdk_body_field_is_classified`` until it is classified here."""

from __future__ import annotations

import typing

import pytest
from anthropic.types import message_create_params as mparams

from services.router.anthropic_api import _FIELDS, _NOOP, StreamTranslator, from_chat, stop_of, to_chat, usage
from services.router.errors import APIError

TOOL = {"name": "get_weather", "description": "w", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
SDK_HEADER_ARGS = {"user_profile_id", "workspace_id"}  # the SDK sends these as headers, not body fields


def body(**kw) -> dict:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_every_sdk_body_field_is_classified():
    sdk = set(typing.get_type_hints(mparams.MessageCreateParamsBase)) | {"stream"}
    assert sdk - SDK_HEADER_ARGS <= _FIELDS | set(_NOOP), sorted(sdk - SDK_HEADER_ARGS - _FIELDS - set(_NOOP))


def test_agent_loop_request_translates():
    b = body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ],
        metadata={"user_id": "u-42"}, extra_body_field_is_not_here=None,
    )
    del b["extra_body_field_is_not_here"]
    tr = to_chat(b)
    c = tr.chat
    assert c["messages"][0] == {"role": "system", "content": "Be brief."}
    assert c["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert c["messages"][2]["content"] == "Let me look."
    assert c["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert c["messages"][4] == {"role": "user", "content": "And tomorrow?"}
    assert c["tools"][0]["function"]["parameters"] == TOOL["input_schema"] and c["tool_choice"] == "required"
    assert c["parallel_tool_calls"] is False and c["stop"] == ["END"] and c["max_tokens"] == 16
    assert c["session_id"] == "u-42" and c["cache_control"] == {"type": "ephemeral", "ttl": 3600.0}
    assert tr.anthropic_param("messages.3.content") == "messages.2.content.0" and tr.anthropic_param("stop") == "stop_sequences"
    assert tr.anthropic_param("tools.0.function.parameters") == "tools.0.input_schema"


def test_session_of_last_resort_is_the_system_and_first_user_turn():
    a = to_chat(body(system="S"))
    later = to_chat(body(system="S", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]))
    other = to_chat(body(system="T"))
    assert a.chat["session_id"] == later.chat["session_id"] != other.chat["session_id"]
    assert a.chat["session_id"].startswith("anthropic-")


def test_tool_choice_variants_and_prefill():
    assert to_chat(body(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"})).chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert to_chat(body(tools=[TOOL], tool_choice={"type": "none"})).chat["tool_choice"] == "none"
    assert to_chat(body(tools=[TOOL], tool_choice={"type": "auto"})).chat["tool_choice"] == "auto"
    pre = to_chat(body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]))
    assert pre.chat["continue_final_message"] is True


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.2}, "temperature"),
        ({"thinking": {"type": "adaptive"}}, "thinking.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}, "max_tokens": 100}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 2000}, "thinking.budget_tokens"),
        ({"thinking": {"type": "disabled", "budget_tokens": 2000}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": "x"}, "max_tokens": 4000}, "thinking.display"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"bogus": 1}, "bogus"),
        ({"metadata": {"user_id": "u", "x": 1}}, "metadata.x"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{**TOOL, "defer_loading": True}]}, "tools.0.defer_loading"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"system": [{"type": "image"}]}, "system.0"),
        ({"cache_control": {"type": "persistent"}}, "cache_control"),
        ({"cache_control": {"type": "ephemeral", "ttl": "forever"}}, "cache_control.ttl"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content.0.tool_use_id"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "messages.1.content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages.0.name"),
    ],
)
def test_refused_fields_are_400_naming_the_anthropic_field(extra, param):
    with pytest.raises(APIError) as ei:
        to_chat(body(**extra))
    e = ei.value
    assert e.status == 400 and e.param == param, (e.param, e.message)
    assert param in e.anthropic_body()["error"]["message"] and e.anthropic_body()["type"] == "error"


def test_from_chat_text_tool_use_and_usage():
    chat = {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": "Let me see.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 8}}}
    m = from_chat("m", chat)
    assert [b["type"] for b in m["content"]] == ["text", "tool_use"] and m["content"][1]["input"] == {"a": 1}
    assert m["stop_reason"] == "tool_use" and m["usage"] == {"input_tokens": 2, "output_tokens": 5, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 0}
    assert stop_of("stop", "END") == ("stop_sequence", "END") and stop_of("stop", None) == ("end_turn", None) and stop_of("length", None)[0] == "max_tokens"
    assert usage(None)["input_tokens"] == 0


def test_stream_translator_event_sequence():
    tr = StreamTranslator("m")
    evs = tr.start()
    evs += tr.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    evs += tr.feed({"choices": [{"delta": {"content": "Hi"}}]})
    evs += tr.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]})
    evs += tr.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]}}]})
    evs += tr.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}}]})
    evs += tr.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    evs += tr.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    evs += tr.finish()
    assert [e["type"] for e in evs] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]
    assert evs[1]["content_block"] == {"type": "text", "text": ""} and evs[4]["content_block"]["type"] == "tool_use"
    assert [e["index"] for e in evs if "index" in e] == [0, 0, 0, 1, 1, 1, 1]
    assert "".join(e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta") == "{\"a\": 1}"
    assert evs[-2]["delta"]["stop_reason"] == "tool_use" and evs[-2]["usage"]["output_tokens"] == 2


def test_thinking_becomes_reasoning_effort_and_comes_back_as_thinking_blocks():
    on = to_chat(body(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048)).chat
    off = to_chat(body(thinking={"type": "disabled"})).chat
    assert on["reasoning_effort"] == "medium" and off["reasoning_effort"] == "none"
    assert on["thinking_token_budget"] == 1024 and "thinking_token_budget" not in off  # the engine enforces it
    assert to_chat(body()).chat.get("reasoning_effort") is None
    tr = to_chat(body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "A"}]},
        {"role": "user", "content": "more"}]))
    assert [(m.get("content"), m.get("reasoning_content")) for m in tr.chat["messages"]] == [("q", None), ("A", "hmm"), ("more", None)]  # to the template
    assert tr.anthropic_param("reasoning_effort") == "thinking"
    chat = {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "Hi", "reasoning_content": "think"}}], "usage": {}}
    assert [b["type"] for b in from_chat("m", chat)["content"]] == ["thinking", "text"]
    st = StreamTranslator("m")
    events = st.start()
    for d in ({"reasoning_content": "a"}, {"reasoning_content": "b"}, {"content": "Hi"}):
        events += st.feed({"choices": [{"delta": d, "finish_reason": None}]})
    events += st.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]}) + st.finish()
    kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type")) for e in events]
    assert kinds[1:6] == [("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"), ("content_block_delta", "thinking_delta"),
                          ("content_block_stop", None), ("content_block_start", "text")]
