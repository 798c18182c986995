"""The ``<think>`` reasoning parser: whole outputs and every split of them into stream deltas."""

import pytest

from talaria.reasoning_parsers import (ContentDelta, ReasoningDelta, ReasoningGate, detect_format, effort_kwargs, make_parser,
                                       marker_ids, prompt_closes_reasoning, prompt_opens_reasoning, split)

CASES = [
    # (output, prompt opens <think>, reasoning, content)
    ("<think>Let me add.</think>\n\nIt is 4.", False, "Let me add.", "It is 4."),
    ("\n<think>x</think>y", False, "x", "y"),
    ("Just an answer.", False, "", "Just an answer."),
    ("Let me see.</think>Answer", True, "Let me see.", "Answer"),
    ("<think>\nrepeated open</think>A", True, "\nrepeated open", "A"),
    ("never closed, cut by max_tokens", True, "never closed, cut by max_tokens", ""),
    ("<think>never closed", False, "never closed", ""),
    ("a < b </think> then <think> stays text", True, "a < b ", "then <think> stays text"),
    ("", True, "", ""),
    ("<thin", False, "", "<thin"),
    ("r</thi", True, "r</thi", ""),
    ("2 < 3", False, "", "2 < 3"),
]


@pytest.mark.parametrize("text,opens,reasoning,content", CASES)
def test_whole_output(text, opens, reasoning, content):
    assert split("think", text, opens) == (reasoning, content)


@pytest.mark.parametrize("text,opens,reasoning,content", CASES)
def test_every_two_way_split_streams_the_same(text, opens, reasoning, content):
    for cut in range(len(text) + 1):
        p = make_parser("think", opens)
        events = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == reasoning, cut
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == content, cut
        kinds = [type(e) for e in events if e.text]
        assert kinds == sorted(kinds, key=lambda k: k is ContentDelta), "reasoning always comes before content"


def test_one_character_at_a_time_releases_reasoning_before_the_close_arrives():
    p = make_parser("think", prompt_opens=True)
    out = []
    for ch in "abc</think>de":
        out += p.feed(ch)
        if ch == "c":
            assert p.reasoning == "abc" and p.in_reasoning  # released before the delimiter is seen
    out += p.finish()
    assert [type(e) for e in out] == [ReasoningDelta] * 3 + [ContentDelta] * 2


def test_detection_prompt_and_switches():
    assert detect_format("{{ '<think>' }}") == "think" and detect_format("plain {{ x }}") == ""
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", "think")
    assert not prompt_opens_reasoning("<think>\n\n</think>\n\n", "think")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", "think")
    # a template that switched reasoning off closes it in the generation prompt: the output is all answer
    assert prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", "think")
    assert not prompt_closes_reasoning("<|im_start|>assistant\n<think>\n", "think")
    assert not prompt_closes_reasoning("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", "think")  # an earlier turn's
    assert not prompt_closes_reasoning("<think></think>", "")
    assert effort_kwargs("{% if enable_thinking is false %}", "none") == {"enable_thinking": False}
    assert effort_kwargs("{% if enable_thinking is false %}", "low") == {"enable_thinking": True}
    assert effort_kwargs("Reasoning: {{ reasoning_effort }}", "high") == {"reasoning_effort": "high"}
    assert effort_kwargs("<think>{{ x }}", "high") is None
    with pytest.raises(ValueError):
        make_parser("nope")


def test_an_assistant_turns_reasoning_content_reaches_the_template():
    from services.router.errors import APIError
    from services.router.schemas import ChatCompletionRequest, parse_request
    from talaria.tokenizer import chat_message_dict

    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}, {"role": "user", "content": "q2"}]})
    assert [chat_message_dict(m).get("reasoning_content") for m in req.messages_proto().messages] == [None, "R", None]
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "q", "reasoning_content": "R"}]})
    assert ei.value.param == "messages.0.reasoning_content"


def test_chat_output_splits_reasoning_before_tool_parsing_and_not_under_a_grammar():
    from services.router.openai_format import chat_output
    from services.router.schemas import ChatCompletionRequest, parse_request
    from talaria.v1 import engine_pb2 as pb

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    accepted = pb.TokenChunk(tool_format="hermes", reasoning_format="think", reasoning_open=True)
    auto = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": tools})
    out = chat_output(auto, accepted)
    deltas = out.feed("maybe <tool_call> here</think>", 5) + out.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', 9)
    deltas += out.finish("stop")[0]
    assert out.reasoning == "maybe <tool_call> here" and [c["function"]["name"] for c in out.calls] == ["f"]
    assert "reasoning_content" in deltas[0] and out.reasoning_tokens == 5 and out.message()["reasoning_content"] == out.reasoning
    forced = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": tools, "tool_choice": "required"})
    out = chat_output(forced, accepted)
    out.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', 9)
    out.finish("stop")
    assert out.reasoner is None and [c["function"]["name"] for c in out.calls] == ["f"]
    # the engine starts the grammar after the reasoning: the output is parsed for it, then for the forced call
    gated = pb.TokenChunk(tool_format="hermes", reasoning_format="think", reasoning_open=True, constraint_after_reasoning=True)
    out = chat_output(forced, gated)
    out.feed('weigh it</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', 12)
    out.finish("stop")
    assert out.reasoning == "weigh it" and [c["function"]["name"] for c in out.calls] == ["f"]


@pytest.mark.parametrize("ids,opens,answer", [
    ([100, 7, 8, 101, 9, 10], False, [9, 10]),  # a leading <think> (100) opens the reasoning, </think> (101) ends it
    ([9, 100, 101], False, [9, 100, 101]),  # no <think> first: all answer, later markers included
    ([7, 101, 9], True, [9]),  # the prompt opened it
    ([7, 8], True, []),  # never closed: no answer
])
def test_reasoning_gate_hands_the_grammar_only_the_answer(ids, opens, answer):
    g = ReasoningGate(100, 101, opens)
    assert g.constrained is (not opens)  # the first token is masked unless the prompt opened the reasoning
    assert [t for t in ids if g.feed(t)] == answer
    assert marker_ids("think", {"<think>": 100, "</think>": 101}.get) == (100, 101)
    assert marker_ids("think", {"<think>": 100}.get) is None and marker_ids("", {}.get) is None


def test_reasoning_gate_budget_counts_the_tokens_inside_and_then_must_close():
    g = ReasoningGate(100, 101, False, budget=2)
    closes = []
    for t in (100, 7, 8):  # <think>, then two tokens inside: the budget is spent
        closes.append(g.must_close)
        g.feed(t)
    assert closes == [False, False, False] and g.must_close and g.spent == 2
    assert not g.feed(101) and g.state == "answer" and not g.must_close
    early = ReasoningGate(100, 101, True, budget=5)
    early.feed(7)
    early.feed(101)  # closed by the model before the budget: nothing forced
    assert early.state == "answer" and not early.must_close and not ReasoningGate(100, 101, True).must_close


@pytest.mark.parametrize("ids,opens,count", [
    ([7, 8, 101, 9], True, 3),  # reasoning 7, 8 then </think> (101), then the answer
    ([100, 7, 101, 9, 101], False, 3),  # a leading <think> (100) opens it; a later </think> is the answer's
    ([7, 8, 9], False, 0),  # no <think> at the start: no reasoning
    ([7, 8], True, 2),  # never closed
])
def test_token_counter(ids, opens, count):
    from talaria.reasoning_parsers import token_counter

    vocab = {"<think>": 100, "</think>": 101}
    c = token_counter("think", vocab.get, opens)
    c.feed(ids[:1])
    c.feed(ids[1:])
    assert c.count == count
    assert token_counter("think", {}.get, opens) is None and token_counter("", vocab.get, opens) is None
