"""Tool-call parsers on a fixed corpus per format: every well-formed call is found (fed whole and in random
chunks), plain text never becomes a call, a malformed call comes back as text."""

from __future__ import annotations

import json
import random

import pytest

from talaria.tool_parsers import (
    ArgumentsDelta, CallHeader, CallStarted, TextDelta, detect_format, make_parser, parse, render_call,
)

ARGS = [
    {},
    {"city": "Paris"},
    {"city": "São Paulo", "unit": "celsius"},
    {"q": "braces { } and [brackets] and \"quotes\"", "n": 3},
    {"nested": {"list": [1, 2.5, None, True], "deep": {"x": "y"}}},
    {"text": "日本語のテキスト 🙂", "empty": ""},
    {"code": "def f(x):\n    return {'a': x}"},
]
NAMES = ["get_weather", "search", "run_python", "lookup_user_v2"]

PLAIN = [
    "The capital of France is Paris.",
    "Here is JSON: {\"a\": 1}",
    "{\"a\": 1, \"b\": [1, 2]}",  # a JSON answer, not a call (no name)
    "{\"name\": 5, \"arguments\": {}}",
    "Use the <tool> tag or tool_call keyword in prose.",
    "Square [TOOL] brackets and [TOOLS] and <|python_tag",
    "def f():\n    return {'name': 'x'}",
    "",
    "   ",
    "< tool_call > spaced out",
    "I will call get_weather with {\"city\": \"Paris\"} later.",
]


def well_formed(fmt: str, calls: list[tuple[str, dict]], prefix: str = "") -> str:
    if fmt == "hermes":
        return prefix + "\n".join(render_call({"function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}) for n, a in calls)
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def corpus(fmt: str) -> list[tuple[str, list[tuple[str, dict]]]]:
    rng = random.Random(7)
    out = []
    for i in range(60):
        k = 1 + (i % 3)
        calls = [(rng.choice(NAMES), rng.choice(ARGS)) for _ in range(k)]
        prefix = "Let me check. " if (fmt == "hermes" and i % 2) else ""
        out.append((well_formed(fmt, calls, prefix), calls))
    return out


def chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def run_stream(fmt: str, pieces: list[str], eager: bool = False):
    p = make_parser(fmt, eager=eager)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    res = p.finish()
    return p, events + p.tail_events(res), res


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_corpus_every_well_formed_call_is_parsed(fmt):
    found = total = 0
    for n, (text, calls) in enumerate(corpus(fmt)):
        for pieces in ([text], chunks(text, n)):
            _, events, res = run_stream(fmt, pieces)
            total += 1
            got = [(c.name, json.loads(c.arguments)) for c in res.tool_calls]
            if got == calls:
                found += 1
            # streamed events reassemble into the same calls, with incremental arguments
            headers = [e for e in events if isinstance(e, CallHeader)]
            args = {}
            for e in events:
                if isinstance(e, ArgumentsDelta):
                    args[e.index] = args.get(e.index, "") + e.text
            assert [h.name for h in headers] == [c.name for c in res.tool_calls]
            assert [args[i] for i in range(len(headers))] == [c.arguments for c in res.tool_calls]
            assert [h.id for h in headers] == [c.id for c in res.tool_calls]
            assert "".join(e.text for e in events if isinstance(e, TextDelta)) == res.content
    assert found == total, f"{fmt}: {found}/{total} well-formed calls parsed"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_plain_text_is_never_a_call(fmt):
    for n, text in enumerate(PLAIN):
        for pieces in ([text], chunks(text, n)):
            _, events, res = run_stream(fmt, pieces)
            assert res.tool_calls == [] and res.content == text, (fmt, text, res)
            assert not [e for e in events if isinstance(e, (CallHeader, ArgumentsDelta))]


@pytest.mark.parametrize(
    "fmt,text",
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}'),  # never closed
        ("llama3_json", '{"name": "f", "parameters": {"a": }'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}'),
        ("mistral", '[TOOL_CALLS]{"name": "f"}'),
    ],
)
def test_malformed_call_comes_back_as_text(fmt, text):
    res = parse(fmt, text)
    assert res.tool_calls == [] and res.content == text


def test_hermes_header_is_known_as_soon_as_it_streams():
    p = make_parser("hermes")
    assert p.feed("Sure. <tool_") == [TextDelta("Sure. ")] and not p.in_call
    ev = p.feed("call>")
    assert CallStarted() in ev and p.in_call


def test_hermes_eager_streams_arguments_before_the_call_closes():
    p = make_parser("hermes", eager=True)
    text = render_call({"function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}})
    events = []
    for ch in text[: text.index("</tool_call>") - 2]:  # stop before the object closes
        events += p.feed(ch)
    header = [e for e in events if isinstance(e, CallHeader)]
    assert [h.name for h in header] == ["get_weather"]
    streamed = "".join(e.text for e in events if isinstance(e, ArgumentsDelta))
    assert len([e for e in events if isinstance(e, ArgumentsDelta)]) > 5
    assert '{"city": "Paris", "unit": "c"}'.startswith(streamed) and len(streamed) >= 20
    for ch in text[text.index("</tool_call>") - 2 :]:
        events += p.feed(ch)
    res = p.finish()
    events += p.tail_events(res)
    assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta)) == res.tool_calls[0].arguments == '{"city": "Paris", "unit": "c"}'
    assert res.tool_calls[0].id == header[0].id


def test_arguments_are_the_exact_generated_text():
    text = '<tool_call>\n{"name": "f", "arguments": {"a":1,  "b" : [ 2 ]}}\n</tool_call>'
    assert parse("hermes", text).tool_calls[0].arguments == '{"a":1,  "b" : [ 2 ]}'


def test_detect_format():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_format("[AVAILABLE_TOOLS][TOOL_CALLS]") == "mistral"
    assert detect_format("<|python_tag|>{{ tools }}") == "llama3_json"
    assert detect_format("<|im_start|>{{ message['content'] }}") == "hermes"  # no tool support: Talaria's fallback
