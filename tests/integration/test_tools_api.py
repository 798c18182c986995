"""Tool calling, structured output and the OpenAI surface end to end (official openai client, real engine
processes on synthesized models)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.conftest import client_for, engine, stack_config, start_stack

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def stack(models_dir):
    s = start_stack(stack_config(models_dir, [engine("q-a", MODEL)], max_tokens_limit=512))
    yield s
    s.stop()


@pytest.fixture()
def client(stack):
    return client_for(stack)


def ask(client, messages, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def test_tools_are_rendered_into_the_prompt(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = ask(client, msgs)
    with_tools = ask(client, msgs, tools=TOOLS)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_history_with_tool_turns_is_accepted(client):
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    r = ask(client, msgs, tools=TOOLS)
    assert r.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": "str"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as ei:
        ask(client, [{"role": "user", "content": "x"}], **kw)
    assert ei.value.body["param"] == param


def test_tool_message_without_tool_call_id_is_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        ask(client, [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}])
    assert ei.value.body["param"] == "messages.1.tool_call_id"
