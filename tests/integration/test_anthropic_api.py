"""Issue 44: the Anthropic Messages API end to end with the official ``anthropic`` SDK (sync, async,
streaming, a two-tool loop) and vLLM's chat extensions through the router, against real engine processes on
a synthesized model. The stack has an API key, which the SDK sends as ``x-api-key``."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest

from services.router.auth import key_hash
from tests.integration.conftest import client_for, engine, stack_config, start_stack

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
KEY = "sk-issue44-anthropic-test-key"
GREEDY = {"temperature": 0}  # the SDK (2.x) no longer has sampling arguments; the API still takes them
SYSTEM = "You are a careful agent. Use the tools when asked. " * 12  # several KV pages: the return's cached prefix
TOOLS = [
    {"name": "get_weather", "description": "Current weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False}},
    {"name": "get_time", "description": "Local time of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False}},
]


@pytest.fixture(scope="module")
def stack(models_dir):
    keys = [{"sha256": key_hash(KEY), "tenant": "acme"}]
    s = start_stack(stack_config(models_dir, [engine("a-0", MODEL)], max_tokens_limit=512, auth={"api_keys": keys}))
    yield s
    s.stop()


@pytest.fixture()
def client(stack):
    return anthropic.Anthropic(base_url=stack.api, api_key=KEY, max_retries=0, timeout=60)


def test_sync_text_message_with_system_blocks_and_usage(client):
    m = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=[{"type": "text", "text": "Be brief."}],
                               messages=[{"role": "user", "content": "Say hi"}], metadata={"user_id": "sync-1"})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content and m.content[0].type == "text"
    assert m.usage.output_tokens >= 1 and m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens == 0


def test_two_tool_loop_and_the_sessions_second_turn_reads_the_cache(client):
    """Turn 1 must call get_weather, turn 2 (the tool result back) must call get_time, turn 3 answers: the
    loop an agent runs. Every turn after the first reads the session's cached prefix."""
    msgs = [{"role": "user", "content": "Weather and time in Paris?"}]
    used = []
    for i, name in enumerate(("get_weather", "get_time")):
        m = client.messages.create(model=MODEL, max_tokens=120, extra_body=GREEDY, system=SYSTEM, tools=TOOLS, messages=msgs,
                                   tool_choice={"type": "tool", "name": name, "disable_parallel_tool_use": True},
                                   metadata={"user_id": "loop-1"})
        assert m.stop_reason == "tool_use", m
        (call,) = [b for b in m.content if b.type == "tool_use"]
        assert call.name == name and isinstance(call.input, dict) and isinstance(call.input.get("city"), str)
        if i > 0:
            assert m.usage.cache_read_input_tokens > 0, m.usage  # the session's second turn hit its KV
        used.append(call.name)
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C" if i == 0 else "14:00"}]}]
    final = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=SYSTEM, tools=TOOLS, messages=msgs,
                                   tool_choice={"type": "none"}, metadata={"user_id": "loop-1"})
    assert used == ["get_weather", "get_time"]
    assert final.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in final.content)
    assert final.usage.cache_read_input_tokens > 0 and final.usage.input_tokens >= 0


def test_streaming_tool_use_gives_anthropics_event_sequence(client):
    with client.messages.stream(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as s:
        types = [ev.type for ev in s if ev.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop")]
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in types and "content_block_stop" in types
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert isinstance(final.content[-1].input, dict) and final.content[-1].name in ("get_weather", "get_time")
    assert final.usage.output_tokens >= 1 and final.usage.input_tokens > 0


def test_raw_stream_has_input_json_deltas(stack):
    body = {"model": MODEL, "max_tokens": 120, "temperature": 0, "stream": True, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"},
            "messages": [{"role": "user", "content": "Time?"}]}
    with httpx.stream("POST", f"{stack.api}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    evs = [json.loads(ln[6:]) for ln in lines]
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    assert deltas and all(d["type"] == "input_json_delta" for d in deltas)
    assert isinstance(json.loads("".join(d["partial_json"] for d in deltas)), dict)
    assert evs[-2]["delta"]["stop_reason"] == "tool_use" and evs[-1] == {"type": "message_stop"}


def test_async_client_and_stop_sequences(stack):
    async def go():
        c = anthropic.AsyncAnthropic(base_url=stack.api, api_key=KEY, max_retries=0, timeout=60)
        free = await c.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=[{"role": "user", "content": "Count"}])
        text = free.content[0].text
        stop = text[2:4]
        stopped = await c.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=[{"role": "user", "content": "Count"}], stop_sequences=[stop])
        await c.close()
        return text, stop, stopped

    text, stop, stopped = asyncio.run(go())
    assert stop.strip(), text
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.find(stop)] if text.find(stop) > 0 else not stopped.content


def test_prefill_continues_the_assistant_message(stack, client, models_dir):
    """A final assistant message is continued (vLLM's continue_final_message): the prompt ends inside it."""
    from talaria.tokenizer import Tokenizer, continue_final_message

    msgs = [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Once upon a"}]
    m = client.messages.create(model=MODEL, max_tokens=5, extra_body=GREEDY, messages=msgs)
    tok = Tokenizer.from_dir(models_dir / MODEL)
    rendered = tok.render_chat_template(msgs, add_generation_prompt=False)
    cut = continue_final_message(rendered, msgs)
    assert cut.endswith("Once upon a") and len(cut) < len(rendered)  # the template's end-of-turn is left out
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(tok.encode(cut, add_special_tokens=False))
    assert client.messages.count_tokens(model=MODEL, messages=msgs).input_tokens == len(tok.encode(cut, add_special_tokens=False))
    # the same prompt through the chat path's extension gives the same greedy continuation
    chat = client_for(stack).with_options(api_key=KEY).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, temperature=0, extra_body={"continue_final_message": True})
    assert m.content[0].text == chat.choices[0].message.content


def test_count_tokens(client):
    n = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "hi"}])
    with_tools = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS, messages=[{"role": "user", "content": "hi"}])
    m = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, system=SYSTEM, messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert with_tools.input_tokens > n.input_tokens + 20


@pytest.mark.parametrize(
    "kw,field,exc",
    [
        ({"max_tokens": 0}, "max_tokens", anthropic.BadRequestError),
        ({"extra_body": {"temperature": 1.5}}, "temperature", anthropic.BadRequestError),
        ({"thinking": {"type": "enabled", "budget_tokens": 200}, "max_tokens": 400}, "thinking", anthropic.BadRequestError),  # no reasoning parser: the engine's 400
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type", anthropic.BadRequestError),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice", anthropic.BadRequestError),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "messages.0.content.0.type", anthropic.BadRequestError),
        ({"model": "no-such-model"}, "model", anthropic.NotFoundError),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", anthropic.BadRequestError),
    ],
)
def test_bad_requests_get_anthropics_error_shape_naming_the_field(client, kw, field, exc):
    args = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **kw}
    with pytest.raises(exc) as ei:
        client.messages.create(**args)
    body = ei.value.body
    assert body["type"] == "error" and field in body["error"]["message"], body
    assert body["error"]["type"] == ("not_found_error" if exc is anthropic.NotFoundError else "invalid_request_error")


def test_a_wrong_key_is_anthropics_authentication_error(stack):
    c = anthropic.Anthropic(base_url=stack.api, api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["error"]["type"] == "authentication_error"


def test_vllm_extensions_through_the_router(stack):
    """Issue 44 item 2 on the real stack (the openai client with the stack's key as a bearer token)."""
    c = client_for(stack).with_options(api_key=KEY)
    msgs = [{"role": "user", "content": "Count"}]
    free = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0).choices[0].message.content
    stop = free[2:4]
    inc = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True, "skip_special_tokens": True, "top_k": 5, "min_p": 0.01,
                                                "repetition_penalty": 1.0, "cache_salt": "s1", "chat_template_kwargs": {"custom_flag": True}})
    ch = inc.choices[0]
    assert ch.finish_reason == "stop" and ch.model_extra.get("stop_reason") == stop and ch.message.content == free[: free.find(stop) + len(stop)]
    with pytest.raises(Exception) as ei:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"chat_template_kwargs": {"messages": []}})
    assert ei.value.body["param"] == "chat_template_kwargs.messages"
