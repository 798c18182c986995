"""Tool calling, structured output and the OpenAI surface end to end (official openai client, real engine
processes on synthesized models)."""

from __future__ import annotations

import json
from typing import Annotated

import openai
from pydantic import Field
import pytest

from tests.integration.conftest import client_for, engine, stack_config, start_stack

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False}}}]


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
        ({"response_format": {"type": "nonsense"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}}, "response_format"),
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


def test_tool_choice_required_loop_reuses_the_session_prefix(client):
    """call -> tool result -> next call: the call is valid JSON for the schema, and the next call's cached
    prefix covers the previous prompt plus the generated call."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(client, msgs, tools=TOOLS, tool_choice="required", max_tokens=120, extra_body={"session_id": "tools-1"})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    msgs += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    second = ask(client, msgs, tools=TOOLS, extra_body={"session_id": "tools-1"})
    covered = first.usage.prompt_tokens + first.usage.completion_tokens
    page = 16
    assert second.usage.prompt_tokens_details.cached_tokens >= (covered // page) * page - page, (first.usage, second.usage)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_named_tool_choice_streams_incremental_arguments(client):
    stream = ask(client, [{"role": "user", "content": "Paris?"}], tools=TOOLS, max_tokens=120, stream=True,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas, reasons = [], []
    for ev in stream:
        for c in ev.choices:
            if c.delta.tool_calls:
                deltas += c.delta.tool_calls
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    # the rest are argument fragments of the same call. How many there are depends on how many engine steps
    # were queued when the reader took them (a lagging reader gets them merged, services/engine/streaming.py;
    # a loaded machine made this 1), so the count is not asserted: that arguments stream before the call
    # closes is pinned without timing by tests/unit/test_tool_parsers.py (hermes eager streaming)
    assert all(not d.id and not d.function.name and d.index == 0 for d in deltas[1:])
    args = "".join(d.function.arguments or "" for d in deltas)
    assert set(json.loads(args)) == {"city"}


def test_parse_with_pydantic_response_format(client):
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=10)
        celsius: int

    r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], response_format=Weather, max_tokens=80, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather), r


def test_json_object_response_format(client):
    r = ask(client, [{"role": "user", "content": "JSON please"}], response_format={"type": "json_object"}, max_tokens=60)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_model_by_id_tokenize_detokenize(client, stack):
    import httpx

    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.post(f"{stack.api}/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] > 0
    assert httpx.post(f"{stack.api}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": "hello world"}
    msgs = [{"role": "user", "content": "hi"}]
    chat_ids = httpx.post(f"{stack.api}/tokenize", json={"model": MODEL, "messages": msgs}).json()
    assert chat_ids["count"] == ask(client, msgs, max_tokens=1).usage.prompt_tokens
    bad = httpx.post(f"{stack.api}/detokenize", json={"model": MODEL, "tokens": [1 << 40]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_responses_api_text_tools_and_stream(client):
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0)
    assert r.output[0].type == "message" and r.usage.output_tokens == 6 and r.status == "incomplete"
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"], "strict": True}]
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    follow = [{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"}]
    r2 = client.responses.create(model=MODEL, input=follow, tools=tools, max_output_tokens=4, temperature=0)
    assert r2.usage.input_tokens > r.usage.input_tokens
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output[0].content[0].text


def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(stack):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"18C and sunny in {city}"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{stack.api}/v1", api_key="unused", max_retries=0))
    # a random-weight model never chooses to stop talking: the tool's result is the agent's answer here (the real
    # model's test lets the model answer after the tool)
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model, tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120, temperature=0))
    result = agents.Runner.run_sync(agent, "Weather in Paris?", run_config=agents.RunConfig(tracing_disabled=True), max_turns=4)
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert result.final_output == f"18C and sunny in {calls[0]}"


def test_logit_bias_and_penalties_reach_the_engine(client, stack):
    import httpx

    tid = httpx.post(f"{stack.api}/tokenize", json={"model": MODEL, "prompt": "Paris", "add_special_tokens": False}).json()["tokens"][0]
    forced = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logit_bias={str(tid): 100})
    want = httpx.post(f"{stack.api}/detokenize", json={"model": MODEL, "tokens": [tid] * 3}).json()["prompt"]
    assert forced.choices[0].text == want
    banned = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logit_bias={str(tid): -100},
                                       presence_penalty=0.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2, "min_p": 0.05})
    ids = httpx.post(f"{stack.api}/tokenize", json={"model": MODEL, "prompt": banned.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    assert tid not in ids
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"4000000": 1})
    assert ei.value.body["param"] == "logit_bias"


def test_n_choices_stream_and_not(client):
    msgs = [{"role": "user", "content": "Say something."}]
    r = ask(client, msgs, n=3, temperature=1.0, seed=5, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == 18
    again = ask(client, msgs, n=3, temperature=1.0, seed=5, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    texts = {0: "", 1: "", 2: ""}
    usage = None
    for ev in ask(client, msgs, n=3, temperature=1.0, seed=5, max_tokens=6, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        for c in ev.choices:
            texts[c.index] += c.delta.content or ""
        usage = ev.usage or usage
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    assert usage.completion_tokens == 18
    c = client.completions.create(model=MODEL, prompt="abc", n=2, max_tokens=4, temperature=0)
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].text == c.choices[1].text


def test_logprobs_chat_and_completions(client):
    import math

    r = ask(client, [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3, max_tokens=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-4  # greedy: the sampled token is the most likely
        assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-4)
    streamed = []
    for ev in ask(client, [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3, max_tokens=5, stream=True, extra_body={"ignore_eos": True}):
        for c in ev.choices:
            if c.logprobs and c.logprobs.content:
                streamed += c.logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    c = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) <= 2 and lp.text_offset[0] == 0 and "".join(lp.tokens) == c.choices[0].text
    e = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith("abc")
