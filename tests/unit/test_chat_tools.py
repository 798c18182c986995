"""Tools in the chat template (native and fallback) and the router's shaping of tool-call output."""

from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from talaria.tokenizer import Tokenizer
from services.router.openai_format import ChatOutput
from talaria.models.synth import CHATML_TEMPLATE
from talaria.tool_parsers import render_call

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

# A tools-aware template in the Hermes style, written for this test.
NATIVE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tok(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(BPE()), chat_template=template, eos_token="<|im_end|>")


def history(assistant_content=None):
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": assistant_content, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]


def test_fallback_renders_tools_and_tool_turns_for_a_template_without_tool_support():
    t = tok(CHATML_TEMPLATE)
    assert not t.supports_tools and t.tool_format == "hermes"
    text = t.render_chat_template(history(), tools=TOOLS)
    assert "<tools>" in text and json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert render_call(CALL) in text
    assert "<tool_response>\n18C\n</tool_response>" in text


def test_tool_turn_is_a_prefix_extension_of_what_the_model_generated():
    """Prompt of turn 1 + the generated call + EOS is a prefix of turn 2's prompt (fallback and native)."""
    for template in (CHATML_TEMPLATE, NATIVE):
        t = tok(template)
        first = t.render_chat_template(history()[:1], tools=TOOLS)
        generated = "Let me look. " + render_call(CALL) + "<|im_end|>"
        second = t.render_chat_template(history("Let me look. "), tools=TOOLS)
        assert second.startswith(first + generated), (template[:20], first + generated, second)


def test_native_template_gets_tools_and_calls():
    t = tok(NATIVE)
    assert t.supports_tools
    text = t.render_chat_template(history(), tools=TOOLS)
    assert "TOOLS:get_weather;" in text and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_without_tools_rendering_is_unchanged():
    t = tok(CHATML_TEMPLATE)
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render_chat_template(msgs) == t.render_chat_template(msgs, tools=None) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_output_streams_tool_call_deltas_and_reports_tool_calls():
    out = ChatOutput("hermes", eager=True)
    text = "Sure. " + render_call(CALL)
    deltas = []
    for i in range(0, len(text), 3):
        deltas += out.feed(text[i : i + 3])
    more, reason = out.finish("stop")
    deltas += more
    assert reason == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    tc = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert tc[0]["function"]["name"] == "get_weather" and tc[0]["id"].startswith("call_") and tc[0]["type"] == "function"
    assert len(tc) > 3 and "".join(x["function"]["arguments"] for x in tc) == '{"city": "Paris"}'
    assert out.message()["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_invalid_claimed_call_is_text_with_finish_stop():
    out = ChatOutput("hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    deltas = out.feed(text)
    more, reason = out.finish("stop")
    assert reason == "stop" and "".join(d.get("content", "") for d in deltas + more) == text
    assert out.message() == {"role": "assistant", "content": text}


def test_parallel_false_keeps_the_first_call():
    out = ChatOutput("hermes", parallel=False)
    out.feed(render_call(CALL) + "\n" + render_call({**CALL, "id": "x"}))
    out.finish("stop")
    assert len(out.message()["tool_calls"]) == 1


def test_align_to_previous_keeps_generated_ids(synth_models):
    """A session's generated ids are kept even when they are not the canonical tokenization of their text."""
    from talaria.tokenizer import align_to_previous

    t = Tokenizer.from_dir(synth_models["tiny-qwen2"])
    prompt = t.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    word = "information"
    odd = [i for ch in word for i in t.encode(ch, add_special_tokens=False)]  # one token per letter
    assert odd != t.encode(word, add_special_tokens=False)
    previous = prompt + odd
    text = t.decode(previous) + "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
    ids = align_to_previous(t, previous, text)
    assert ids[: len(previous)] == previous and t.decode(ids) == text
    assert align_to_previous(t, previous, "something else") == t.encode("something else", add_special_tokens=False)
    assert align_to_previous(t, None, text) == t.encode(text, add_special_tokens=False)


def test_session_tokens_are_bounded_and_per_model():
    from talaria.tokenizer import SessionTokens

    st = SessionTokens(capacity=2)
    st.put("a", "m1", [1, 2])
    st.put("a", "m2", [3])
    st.put("b", "m1", [4])
    assert st.get("a", "m1") is None and st.get("a", "m2") == [3] and st.get("b", "m1") == [4]
    assert st.get("", "m1") is None
