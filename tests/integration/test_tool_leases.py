"""Tool-aware leases end to end (issue 14 items 1-3): a real engine process parses its own streamed tool call,
publishes a ToolIntent at the header and the tool's name in the completion hook; the router installs the lease
early, sizes it for the tool, learns the return gap per (model, tool) from the session's next call, and tells
the engine how long the session is expected away (RetentionHint)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import client_for, engine, stack_config, start_stack, wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False}}}]


def metrics(stack) -> dict:
    return httpx.get(f"{stack.api}/router/metrics", timeout=5).json()["placement"]


def test_tool_call_intent_early_lease_and_learned_gap(models_dir):
    stack = start_stack(stack_config(models_dir, [engine("q-a", MODEL)], max_tokens_limit=512, placement={"lease_policy": "adaptive", "lease_arithmetic": False}))  # plumbing, not the arithmetic
    try:
        client = client_for(stack)
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        for turn in range(3):
            r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=120,
                                               temperature=0, extra_body={"session_id": "tool-lease-1"})
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            call = choice.message.tool_calls[0]
            msgs += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
            wait_until(lambda: metrics(stack)["counters"].get("hooks", 0) >= turn + 1)
        m = wait_until(lambda: (x := metrics(stack))["counters"].get("intents", 0) >= 3 and x)
        assert m["lease_policy"] == "adaptive"
        assert m["counters"].get("leases_early", 0) >= 1  # installed at the header, before the hook
        assert m["leases_installed"] >= 3
        # two returns after get_weather were observed (turns 2 and 3): the (model, tool) key learned them
        assert m["return_gaps"][f"{MODEL}|get_weather"]["n"] == 2
        assert m["lease_hits"] >= 1
    finally:
        stack.stop()
