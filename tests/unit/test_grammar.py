"""Constrained decoding in the batched sampler: constrained rows always produce grammar-valid output,
unconstrained rows in the same batch are untouched; bad schemas are GrammarErrors naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from services.engine.grammar import GrammarError, GrammarFactory
from services.engine.sampling import Sampler
from talaria.tokenizer import Tokenizer
from services.engine.types import SamplingParams
from talaria.tool_parsers import parse

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def tok(synth_models):
    return Tokenizer.from_dir(synth_models["tiny-qwen2"])


@pytest.fixture(scope="module")
def factory(tok):
    return GrammarFactory(tok, tok.vocab_size, list(tok.eos_token_ids))


def decode_loop(tok, sampler, params: list[SamplingParams], steps: int = 120, seed: int = 0) -> list[list[int]]:
    """Random logits (a stand-in for a model) through the sampler until every constrained row ends."""
    g = torch.Generator().manual_seed(seed)
    rids = [f"r{i}" for i in range(len(params))]
    for rid, p in zip(rids, params):
        sampler.add(rid, p)
    outs: list[list[int]] = [[] for _ in params]
    done = [False] * len(params)
    for _ in range(steps):
        live = [i for i in range(len(params)) if not done[i]]
        if not live:
            break
        logits = torch.randn(len(live), tok.vocab_size, generator=g) * 3
        toks = sampler.sample(logits, [rids[i] for i in live], [params[i] for i in live])
        for i, t in zip(live, toks):
            if t in tok.eos_token_ids:
                done[i] = True
            else:
                outs[i].append(t)
    return outs


def test_json_schema_rows_are_valid_and_free_rows_untouched(tok, factory):
    grammar = factory.compile("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=50)
    constrained = SamplingParams(temperature=1.0, seed=1, grammar=grammar)
    mixed = decode_loop(tok, Sampler(), [free, constrained, SamplingParams(temperature=0.0, grammar=grammar)], steps=200)
    for out in mixed[1:]:
        obj = json.loads(tok.decode(out))
        assert set(obj) == {"city", "days"} and 1 <= obj["days"] <= 7 and len(obj["city"]) <= 12


def test_unconstrained_row_sees_identical_logits(tok, factory):
    """The mask touches only constrained rows: a free row samples exactly as in a batch without grammars."""
    grammar = factory.compile("json_object")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, tok.vocab_size, generator=g)
    free = SamplingParams(temperature=0.0)
    s1, s2 = Sampler(), Sampler()
    s2.add("c", SamplingParams(temperature=0.0, grammar=grammar))
    a = s1.sample(logits.clone(), ["f", "x"], [free, free])
    b = s2.sample(logits.clone(), ["f", "c"], [free, SamplingParams(temperature=0.0, grammar=grammar)])
    assert a[0] == b[0]
    assert tok.decode([b[1]]).lstrip().startswith("{")


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "noop"])
def test_tool_call_grammar_gives_a_parseable_call(tok, factory, choice, fmt):
    grammar = factory.compile("tool_call", tools=TOOLS, tool_choice=choice, tool_format=fmt)
    out = decode_loop(tok, Sampler(), [SamplingParams(temperature=1.0, seed=9, grammar=grammar)], steps=300)[0]
    res = parse(fmt, tok.decode(out))
    assert len(res.tool_calls) == 1, tok.decode(out)
    call = res.tool_calls[0]
    assert call.name in ({"get_weather", "noop"} if choice == "required" else {"noop"})
    json.loads(call.arguments)


def test_tiny_temperature_is_greedy_not_nan():
    s = Sampler()
    logits = torch.randn(2, 50)
    toks = s.sample(logits, ["a", "b"], [SamplingParams(temperature=1e-45), SamplingParams(temperature=1e-30)])
    assert toks == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize(
    "kind,schema",
    [("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}'), ("json_schema", "not json"), ("json_schema", "{" + '"a":1,' * 20000 + '"b":1}')],
)
def test_bad_schema_is_a_grammar_error_naming_response_format(factory, kind, schema):
    with pytest.raises(GrammarError) as ei:
        factory.compile(kind, schema)
    assert ei.value.param == "response_format"


def test_slow_compile_is_a_bounded_grammar_error(tok, monkeypatch):
    """A grammar that does not compile within the bound is a 400-style error, not a hang."""
    import services.engine.grammar as gm

    fac = GrammarFactory(tok, tok.vocab_size, list(tok.eos_token_ids))
    fac.compile("json_object")  # compiler built (tokenizer info) before the bound is tightened
    monkeypatch.setattr(gm, "COMPILE_TIMEOUT_S", 1e-9)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{3,9}[0-9]+$"} for i in range(300)}}
    with pytest.raises(GrammarError) as ei:
        fac.compile("json_schema", json.dumps(wide))
    assert ei.value.param == "response_format" and "did not compile" in str(ei.value)
