"""Reasoning end to end: a synthesized reasoning model (thinking chat template that opens ``<think>`` in the
prompt; greedy output scripted to ``reasoning</think>answer``, ``talaria models synth --scripted``) through
the whole stack with the official clients: ``reasoning_content`` then content in chat (stream and not),
a reasoning item in ``/v1/responses``, a ``thinking`` block in ``/v1/messages``; ``reasoning_effort`` /
``reasoning.effort`` / ``thinking`` through the template's ``enable_thinking`` switch; a model that does not
reason answers 400 naming the field."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from talaria.models.synth import SCRIPT_CONTENT, SCRIPT_REASONING, synthesize_scripted
from talaria.tokenizer import Tokenizer
from tests.integration.conftest import client_for, engine, stack_config, start_stack

THINK, PLAIN, RAW = "tiny-think", "tiny-qwen2", "tiny-think-raw"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(synth_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("think-models")
    synthesize_scripted(out, tokenizer_json=(synth_models[PLAIN] / "tokenizer.json").read_text())
    (out / PLAIN).symlink_to(synth_models[PLAIN])
    (out / RAW).symlink_to(out / THINK)  # the same checkpoint, configured not to be parsed for reasoning
    engines = [engine("think-0", THINK), engine("plain-0", PLAIN), engine("raw-0", RAW, reasoning_parsers={RAW: "none"})]
    s = start_stack(stack_config(out, engines, max_tokens_limit=2048))
    s.think_dir = out / THINK
    s.reasoning_tokens = len(Tokenizer.from_dir(out / THINK).encode(SCRIPT_REASONING, add_special_tokens=False)) + 1  # and </think>
    yield s
    s.stop()


@pytest.fixture()
def client(stack) -> openai.OpenAI:
    return client_for(stack)


def test_chat_returns_reasoning_then_content(client, stack):
    r = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=60, temperature=0)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (SCRIPT_REASONING, SCRIPT_CONTENT, "stop")
    assert r.usage.completion_tokens_details.reasoning_tokens == stack.reasoning_tokens < r.usage.completion_tokens  # the engine's count by id


def test_chat_stream_yields_reasoning_content_first_then_content(client, stack):
    kinds, reasoning, content, usage = [], "", "", None
    for ch in client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=60, temperature=0, stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            r = getattr(c.delta, "reasoning_content", None)
            if r:
                kinds.append("reasoning")
                reasoning += r
            if c.delta.content:
                kinds.append("content")
                content += c.delta.content
    assert (reasoning, content) == (SCRIPT_REASONING, SCRIPT_CONTENT)
    # every reasoning delta before the first content delta. How many deltas of each arrive depends on how many
    # engine steps a lagging publisher folds into one chunk (services/engine/streaming.py), so it is not asserted
    # here; splitting a stream at every point is tested on the parser (tests/unit/test_reasoning_parsers.py)
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "reasoning" in kinds and "content" in kinds
    assert usage.completion_tokens_details.reasoning_tokens == stack.reasoning_tokens


@pytest.mark.parametrize("extra", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_switched_off_answers_without_reasoning(client, extra):
    r = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=60, temperature=0, extra_body=extra)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (None, SCRIPT_CONTENT)
    on = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=60, temperature=0, reasoning_effort="high")
    assert on.choices[0].message.reasoning_content == SCRIPT_REASONING


def test_responses_reasoning_item_stream_and_not(client):
    r = client.responses.create(model=THINK, input="hi", instructions="Be brief.", max_output_tokens=60, temperature=0, reasoning={"effort": "low"})
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == SCRIPT_REASONING and r.output_text == SCRIPT_CONTENT
    assert r.usage.output_tokens_details.reasoning_tokens > 0 and r.output[0].content[0].text == SCRIPT_REASONING
    events = list(client.responses.create(model=THINK, input="hi", instructions="Be brief.", max_output_tokens=60, temperature=0, stream=True))
    types = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == SCRIPT_REASONING
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert events[-1].response.output_text == SCRIPT_CONTENT
    off = client.responses.create(model=THINK, input="hi", max_output_tokens=60, temperature=0, reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"] and off.output_text == SCRIPT_CONTENT


def test_messages_thinking_blocks_stream_and_not(stack):
    c = anthropic.Anthropic(base_url=stack.api, api_key="unused", max_retries=0, timeout=60)
    args = {"model": THINK, "max_tokens": 2048, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "extra_body": {"temperature": 0}}
    m = c.messages.create(**args, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [("thinking", SCRIPT_REASONING), ("text", SCRIPT_CONTENT)]
    assert m.stop_reason == "end_turn"
    with c.messages.stream(**args, thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert deltas == sorted(deltas, key=lambda t: t == "text_delta") and deltas[0] == "thinking_delta"
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == SCRIPT_REASONING
    off = c.messages.create(**args, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in off.content] == [("text", SCRIPT_CONTENT)]


ANSWER = {"type": "object", "properties": {"reply": {"type": "string", "enum": ["hello"]}}, "required": ["reply"], "additionalProperties": False}
GREET = [{"type": "function", "function": {"name": "greet", "parameters": ANSWER}}]


def test_structured_output_starts_after_the_reasoning(client, stack):
    """A JSON response_format or a forced tool call governs the answer, not the reasoning before it: the
    scripted reasoning comes back whole, then the grammar's output; reasoning switched off, the grammar
    starts at the first token."""
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=80, temperature=0, response_format=rf)
    m = r.choices[0].message
    assert (m.reasoning_content, json.loads(m.content), r.choices[0].finish_reason) == (SCRIPT_REASONING, {"reply": "hello"}, "stop")
    assert r.usage.completion_tokens_details.reasoning_tokens == stack.reasoning_tokens
    reasoning, content = "", ""
    for ch in client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=80, temperature=0, response_format=rf, stream=True):
        for c in ch.choices:
            assert not (content and getattr(c.delta, "reasoning_content", None))  # reasoning first
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, json.loads(content)) == (SCRIPT_REASONING, {"reply": "hello"})
    off = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=80, temperature=0, response_format=rf, reasoning_effort="none")
    assert (getattr(off.choices[0].message, "reasoning_content", None), json.loads(off.choices[0].message.content)) == (None, {"reply": "hello"})
    t = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=200, temperature=0, tools=GREET, tool_choice="required")
    m = t.choices[0].message
    assert m.reasoning_content == SCRIPT_REASONING and t.choices[0].finish_reason == "tool_calls", (m, t.usage)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("greet", {"reply": "hello"})]
    resp = client.responses.create(model=THINK, input="hi", instructions="Be brief.", max_output_tokens=80, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}})
    assert [i.type for i in resp.output] == ["reasoning", "message"] and resp.output[0].content[0].text == SCRIPT_REASONING
    assert json.loads(resp.output_text) == {"reply": "hello"}
    c = anthropic.Anthropic(base_url=stack.api, api_key="unused", max_retries=0, timeout=60)
    msg = c.messages.create(model=THINK, max_tokens=2048, system="Be brief.", messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 0},
                            thinking={"type": "enabled", "budget_tokens": 1024}, tools=[{"name": "greet", "input_schema": ANSWER}],
                            tool_choice={"type": "tool", "name": "greet"})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "input", None)) for b in msg.content] == [("thinking", SCRIPT_REASONING), ("tool_use", {"reply": "hello"})]


def test_a_thinking_budget_ends_the_reasoning(client, stack):
    """``thinking_token_budget`` (Messages: ``thinking.budget_tokens``): the scripted reasoning is cut after that
    many tokens by a forced ``</think>``; a budget the model does not reach changes nothing; a model that cannot
    enforce one answers 400 naming the field."""
    script = Tokenizer.from_dir(stack.think_dir).encode(SCRIPT_REASONING, add_special_tokens=False)
    cut = Tokenizer.from_dir(stack.think_dir).decode(script[:3])
    r = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=60, temperature=0, extra_body={"thinking_token_budget": 3})
    assert r.choices[0].message.reasoning_content == cut and r.usage.completion_tokens_details.reasoning_tokens == 4  # and </think>
    roomy = client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=60, temperature=0, extra_body={"thinking_token_budget": 500})
    assert (roomy.choices[0].message.reasoning_content, roomy.choices[0].message.content) == (SCRIPT_REASONING, SCRIPT_CONTENT)
    c = anthropic.Anthropic(base_url=stack.api, api_key="unused", max_retries=0, timeout=60)
    m = c.messages.create(model=THINK, max_tokens=60, messages=[{"role": "user", "content": "hi"}], system="Be brief.", extra_body={"temperature": 0},
                          thinking={"type": "enabled", "budget_tokens": 3})
    assert m.content[0].type == "thinking" and m.content[0].thinking == cut
    for model in (PLAIN, RAW):  # no reasoning parser (RAW: configured off)
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, extra_body={"thinking_token_budget": 3})
        assert ei.value.body["param"] == "thinking_token_budget", ei.value.body
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=THINK, messages=MSGS, max_tokens=4, extra_body={"thinking_token_budget": 0})
    assert ei.value.body["param"] == "thinking_token_budget"


def test_a_model_without_reasoning_is_a_400_naming_each_protocols_field(client, stack):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=PLAIN, messages=MSGS, max_tokens=4, reasoning_effort="low")
    assert ei.value.body["param"] == "reasoning_effort" and "reasoning" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=PLAIN, input="hi", max_output_tokens=4, reasoning={"effort": "low"})
    assert ei.value.body["param"] == "reasoning.effort"
    c = anthropic.Anthropic(base_url=stack.api, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as ei:
        c.messages.create(model=PLAIN, max_tokens=2048, messages=[{"role": "user", "content": "hi"}], thinking={"type": "enabled", "budget_tokens": 1024})
    assert ei.value.body["error"]["message"].startswith("thinking")
    # asking a model that does not reason not to reason needs nothing: served
    r = client.chat.completions.create(model=PLAIN, messages=MSGS, max_tokens=4, reasoning_effort="none")
    assert r.choices[0].message.reasoning_content is None if hasattr(r.choices[0].message, "reasoning_content") else True


def test_the_reasoning_parser_is_per_model_configuration(client):
    """``engines[].reasoning_parsers: {model: none}``: the same checkpoint's output comes back as it was generated,
    and ``reasoning_effort`` is refused (nothing would parse the reasoning it asks for)."""
    r = client.chat.completions.create(model=RAW, messages=MSGS, max_tokens=60, temperature=0)
    assert r.choices[0].message.content == f"{SCRIPT_REASONING}</think>{SCRIPT_CONTENT}"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=RAW, messages=MSGS, max_tokens=4, reasoning_effort="low")
    assert ei.value.body["param"] == "reasoning_effort"
