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


def _pick(tok, bit: int, avoid: set[int]) -> int:
    """A token id at bit ``bit`` of its bitmask word that is neither EOS nor able to start JSON (nor in ``avoid``)."""
    for t in range(bit, tok.vocab_size, 32):
        text = tok.decode([t])
        if t not in tok.eos_token_ids and t not in avoid and text.strip() and text.strip()[0] not in '{["-0123456789tfn':
            return t
    raise AssertionError("no such token")


@pytest.mark.parametrize("bit", [0, 31])  # bit 31 is the int32 word's sign bit
def test_the_grammar_starts_after_the_reasoning(tok, factory, bit):
    """A reasoning gate: the first token may be <think> although the grammar forbids it there; inside the
    reasoning nothing is masked (tokens no JSON could hold come out); after </think> the output is the
    grammar's. Without the gate the same logits cannot open it."""
    grammar = factory.compile("json_schema", json.dumps(SCHEMA))
    think = _pick(tok, bit, set())
    close = _pick(tok, 5, {think})
    free = _pick(tok, 7, {think, close})
    script = [think, free, free, close]  # greedy: each step's favourite token, then random logits
    g = torch.Generator().manual_seed(4)

    def run(params, script):
        s, out = Sampler(), []
        s.add("r", params)
        for step in range(200):
            logits = torch.randn(1, tok.vocab_size, generator=g) * 3
            if step < len(script):
                logits[0, script[step]] = 100.0
            t = s.sample(logits, ["r"], [params])[0]
            if t in tok.eos_token_ids:
                return out
            out.append(t)
        raise AssertionError("the grammar did not end")

    out = run(SamplingParams(temperature=0.0, grammar=grammar, reasoning_gate=(think, close, False)), script)
    assert out[:4] == script
    obj = json.loads(tok.decode(out[4:]))
    assert set(obj) == {"city", "days"}
    opened = run(SamplingParams(temperature=0.0, grammar=grammar, reasoning_gate=(think, close, True)), script[1:])
    assert opened[:3] == script[1:] and json.loads(tok.decode(opened[3:]))  # the prompt opened it: free from the start
    plain = run(SamplingParams(temperature=0.0, grammar=grammar), script)
    assert plain[0] != think and set(json.loads(tok.decode(plain))) == {"city", "days"}


@pytest.mark.parametrize("with_grammar", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_thinking_budget_forces_the_close_marker(tok, factory, with_grammar, temperature):
    """Logits that never favour </think>: after ``budget`` tokens inside the reasoning the sampler emits it
    anyway (greedy or sampled), then the answer is free, or the grammar's."""
    think = _pick(tok, 3, set())
    close = _pick(tok, 5, {think})
    grammar = factory.compile("json_schema", json.dumps(SCHEMA)) if with_grammar else None
    params = SamplingParams(temperature=temperature, seed=2, grammar=grammar, reasoning_gate=(think, close, True, 3))
    s, out, g = Sampler(), [], torch.Generator().manual_seed(8)
    s.add("r", params)
    for _ in range(200):
        logits = torch.randn(1, tok.vocab_size, generator=g) * 3
        logits[0, close] = -50.0
        t = s.sample(logits, ["r"], [params])[0]
        if t in tok.eos_token_ids or (not with_grammar and len(out) == 8):
            break
        out.append(t)
    assert out[3] == close and close not in out[:3], out
    if with_grammar:
        assert set(json.loads(tok.decode(out[4:]))) == {"city", "days"}


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


# ------------------------------------------------------------------ strict JSON strings (issue 43, item 8)
# Every place a schema can put a string: free, length-bounded (xgrammar's loose character rule), an object key
# under propertyNames, array items, additionalProperties values, pattern and format (xgrammar's regex path).
STRING_SCHEMAS = {
    "free": {"type": "string"},
    "maxLength": {"type": "string", "maxLength": 8},
    "minLength": {"type": "string", "minLength": 1},
    "bounded": {"type": "string", "minLength": 2, "maxLength": 6},
    "pattern": {"type": "string", "pattern": "^a.*"},
    "items": {"type": "array", "items": {"type": "string", "maxLength": 5}},
    "additional": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 5}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 4}, "additionalProperties": {"type": "integer"}},
}
WRAP = {  # a document with the string in its place, given the string's JSON text
    "free": lambda s: '{"v": %s}' % s, "maxLength": lambda s: '{"v": %s}' % s, "minLength": lambda s: '{"v": %s}' % s,
    "bounded": lambda s: '{"v": %s}' % s, "pattern": lambda s: '{"v": %s}' % s, "items": lambda s: '{"v": [%s]}' % s,
    "additional": lambda s: '{"v": {"k": %s}}' % s, "propertyNames": lambda s: '{"v": {%s: 1}}' % s,
}


def accepts(grammar, doc: str | bytes) -> bool:
    """Whether ``grammar`` accepts the whole document (UTF-8 bytes, so invalid sequences can be offered)."""
    from xgrammar.testing import _get_matcher_from_grammar

    m = _get_matcher_from_grammar(grammar)
    return m.accept_string(doc.encode() if isinstance(doc, str) else doc) and m.is_terminated()


SURROGATE = b"\xed\xa8\x9b"  # U+DA1B in UTF-8 form: not a character; decodes to three U+FFFD


@pytest.mark.parametrize("where", sorted(STRING_SCHEMAS))
def test_strings_refuse_raw_control_characters_and_take_escapes(where):
    """The compiled grammar accepts a string with an escaped TAB/newline/quote and refuses the same string
    with a raw control character (which a strict ``json.loads`` rejects) or a surrogate, wherever the schema
    puts it."""
    import xgrammar as xgr

    from services.engine.grammar import strict_json_grammar

    g = strict_json_grammar(xgr, {"type": "object", "properties": {"v": STRING_SCHEMAS[where]}, "required": ["v"]})
    wrap = WRAP[where]
    assert accepts(g, wrap('"abc"')) and accepts(g, wrap('"a\u00e9c"'))
    for raw in ("\t", "\n", "\r", "\x00", "\x01", "\x1f"):
        assert not accepts(g, wrap(f'"a{raw}c"')), (where, raw)
    if where != "pattern":  # the pattern decides itself which characters a string may hold
        assert not accepts(g, wrap('"a%sc"').encode().replace(b"%s", SURROGATE)), where
        for esc in ("\\t", "\\n", '\\"', "\\\\", "\\u0009"):
            doc = wrap(f'"a{esc}c"')
            assert accepts(g, doc), (where, esc)
            json.loads(doc)


def test_length_bounds_count_an_escape_as_one_character():
    """minLength/maxLength count characters of the decoded string, as JSON Schema does."""
    import xgrammar as xgr

    from services.engine.grammar import strict_json_grammar

    g = strict_json_grammar(xgr, {"type": "object", "properties": {"v": {"type": "string", "maxLength": 2}}, "required": ["v"]})
    assert accepts(g, '{"v": "\\t\\n"}') and not accepts(g, '{"v": "\\t\\nx"}')


STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6}, "maxItems": 3},
        "notes": {"type": "object", "propertyNames": {"maxLength": 5}, "additionalProperties": {"type": "string", "maxLength": 6}, "maxProperties": 2},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "tags", "notes", "days"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_random_weight_models_give_strict_json_over_many_seeds(synth_models, name):
    """A real engine serving a random-weight model samples 48 json_schema answers at temperature 1.5 (one
    seed each, one batch): every finished answer passes a strict ``json.loads`` and matches the schema. The
    random weights put mass on control-character tokens, which the loose length-bounded rule let through."""
    from services.engine.executor import Engine
    from services.engine.types import EngineRequest, FinishReason

    engine = Engine(synth_models[name], page_size=16, num_pages=512, max_num_seqs=48)
    grammar = GrammarFactory(engine.tokenizer, engine.vocab_size, list(engine.eos_token_ids)).compile("json_schema", json.dumps(STRICT_SCHEMA))
    prompt = engine.tokenizer.encode("Answer in JSON: where and for how long?")
    texts, reasons = {}, {}
    for seed in range(48):
        rid = f"s{seed}"
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=1.5, seed=seed, max_tokens=160, grammar=grammar)))
        texts[rid] = ""
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    finished = [rid for rid, r in reasons.items() if r == FinishReason.STOP]
    assert len(finished) >= 40, reasons
    for rid in finished:
        obj = json.loads(texts[rid])  # strict: a raw control character in a string raises
        assert set(obj) == {"city", "tags", "notes", "days"} and 1 <= obj["days"] <= 7, texts[rid]
        assert len(obj["city"]) <= 12 and all(1 <= len(t) <= 6 for t in obj["tags"]), texts[rid]
