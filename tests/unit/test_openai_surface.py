"""Every parameter of the ``openai`` package's request types is honoured or rejected with a 400 naming it
(issue 18 item 6), and values the wire cannot carry are 400 naming the field (issue 18 item 2).

The parameter lists come from the installed ``openai`` package, so a field added by a newer client fails
this test until it is classified here."""

from __future__ import annotations

import typing

import pytest
from openai.types import completion_create_params as cparams
from openai.types.chat import completion_create_params as ccparams

from services.router.errors import APIError
from services.router.fanout import _sub_bodies, wants_fanout
from services.router.openai_format import chat_output
from services.router.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from talaria.v1 import engine_pb2 as pb

MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _params(mod) -> set[str]:
    return set(typing.get_type_hints(mod.CompletionCreateParamsBase)) | set(typing.get_type_hints(mod.CompletionCreateParamsStreaming))


def _wire(req, header=None) -> dict:
    """What reaches the engine or the router's response shaping for a parsed request."""
    mt = req.effective_max_tokens() or 16
    sp = req.sampling_proto(mt)
    out = {"sampling": sp, "session": req.session_key(header), "stream": req.stream, "model": req.model,
           "include_usage": bool(req.stream_options and req.stream_options.include_usage)}
    if isinstance(req, ChatCompletionRequest):
        out["messages"] = req.messages_proto()
        out["tools_json"] = req.tools_json()
        out["output"] = chat_output(req, pb.TokenChunk(tool_format="hermes"))
        out["template"] = req.template_proto()
    else:
        out["prompt"] = req.prompt
    return out


# field -> (a representative non-default value, check on the wire or None if it must be rejected)
CHAT: dict[str, tuple[object, object]] = {
    "model": ("m2", lambda w: w["model"] == "m2"),
    "messages": ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], lambda w: [m.content for m in w["messages"].messages] == ["s", "q"]),
    "max_tokens": (7, lambda w: w["sampling"].max_tokens == 7),
    "max_completion_tokens": (9, lambda w: w["sampling"].max_tokens == 9),
    "temperature": (0.25, lambda w: abs(w["sampling"].temperature - 0.25) < 1e-6),
    "top_p": (0.5, lambda w: abs(w["sampling"].top_p - 0.5) < 1e-6),
    "seed": (-5, lambda w: w["sampling"].has_seed and w["sampling"].seed == -5),
    "stop": (["END"], lambda w: list(w["sampling"].stop) == ["END"]),
    "stream": (True, lambda w: w["stream"] is True),
    "stream_options": ({"include_usage": True}, lambda w: w["include_usage"]),
    "user": ("u1", lambda w: w["session"] == "u1"),
    "prompt_cache_key": ("k1", lambda w: w["session"] == "k1"),
    "safety_identifier": ("s1", lambda w: w["session"] == "s1"),
    "service_tier": ("default", lambda w: True),  # the one tier there is
    "n": (2, None),
    "frequency_penalty": (0.5, lambda w: abs(w["sampling"].frequency_penalty - 0.5) < 1e-6),
    "presence_penalty": (-0.5, lambda w: abs(w["sampling"].presence_penalty + 0.5) < 1e-6),
    "logit_bias": ({"5": 10}, lambda w: dict(w["sampling"].logit_bias) == {5: 10.0}),
    "logprobs": (True, lambda w: w["sampling"].logprobs),
    "top_logprobs": (2, None),  # without logprobs: true (checked with it below)
    "response_format": ({"type": "json_object"}, lambda w: w["sampling"].constraint.kind == "json_object"),
    "tools": (TOOLS, lambda w: '"name": "f"' in w["tools_json"] and w["output"].parser is not None),
    "tool_choice": ("required", lambda w: w["sampling"].constraint.kind == "tool_call" and w["output"].parser.eager),
    "parallel_tool_calls": (False, lambda w: w["output"].parallel is False),
    "functions": ([{"name": "f"}], None),
    "function_call": ("auto", None),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "modalities": (["text", "audio"], None),
    "prediction": ({"type": "content", "content": "x"}, None),
    "metadata": ({"a": "b"}, None),
    "store": (True, None),
    "reasoning_effort": ("high", lambda w: w["template"].reasoning_effort == "high"),  # the engine: 400 unless the model has a switch
    "verbosity": ("low", None),
    "web_search_options": ({}, None),
    "prompt_cache_retention": ("24h", None),
    "prompt_cache_options": ({}, None),
    "moderation": ({"model": "x"}, None),
}

COMPLETION: dict[str, tuple[object, object]] = {
    "model": ("m2", lambda w: w["model"] == "m2"),
    "prompt": ([1, 2, 3], lambda w: w["prompt"] == [1, 2, 3]),
    "max_tokens": (7, lambda w: w["sampling"].max_tokens == 7),
    "temperature": (0.25, lambda w: abs(w["sampling"].temperature - 0.25) < 1e-6),
    "top_p": (0.5, lambda w: abs(w["sampling"].top_p - 0.5) < 1e-6),
    "seed": (3, lambda w: w["sampling"].seed == 3),
    "stop": ("END", lambda w: list(w["sampling"].stop) == ["END"]),
    "stream": (True, lambda w: w["stream"] is True),
    "stream_options": ({"include_usage": True}, lambda w: w["include_usage"]),
    "user": ("u1", lambda w: w["session"] == "u1"),
    "n": (2, None),
    "best_of": (2, None),
    "echo": (True, lambda w: w["prompt"] == "hi"),
    "suffix": ("tail", None),
    "frequency_penalty": (0.5, lambda w: abs(w["sampling"].frequency_penalty - 0.5) < 1e-6),
    "presence_penalty": (0.5, lambda w: abs(w["sampling"].presence_penalty - 0.5) < 1e-6),
    "logit_bias": ({"5": -100}, lambda w: dict(w["sampling"].logit_bias) == {5: -100.0}),
    "logprobs": (2, lambda w: w["sampling"].logprobs and w["sampling"].top_logprobs == 2),
}


def test_top_logprobs_with_logprobs_reaches_the_wire():
    sp = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 3}).sampling_proto(4)
    assert sp.logprobs and sp.top_logprobs == 3


def _check(cls, base: dict, table: dict, name: str) -> None:
    value, check = table[name]
    body = {**base, name: value}
    if name == "n":  # n > 1 is n calls of the handler with n = 1 and seeds seed + i
        subs = _sub_bodies({**body, "seed": 10})
        assert wants_fanout(body) and [s["seed"] for s in subs] == [10, 11] and all(s["n"] == 1 for s in subs)
        [parse_request(cls, s) for s in subs]
        return
    if name in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = TOOLS
    if check is None:
        with pytest.raises(APIError) as ei:
            parse_request(cls, body)
        assert ei.value.status == 400 and ei.value.param == name, (name, ei.value.status, ei.value.param, ei.value.message)
        assert ei.value.body()["error"]["type"] == "invalid_request_error"
    else:
        w = _wire(parse_request(cls, body))
        assert check(w), (name, w)


def test_every_chat_parameter_is_classified():
    assert _params(ccparams) == set(CHAT), "classify new/removed openai chat parameters in CHAT"


def test_every_completion_parameter_is_classified():
    assert _params(cparams) == set(COMPLETION), "classify new/removed openai completion parameters in COMPLETION"


@pytest.mark.parametrize("name", sorted(CHAT))
def test_chat_parameter_honoured_or_400(name):
    _check(ChatCompletionRequest, {"model": "m", "messages": MSG}, CHAT, name)


@pytest.mark.parametrize("name", sorted(COMPLETION))
def test_completion_parameter_honoured_or_400(name):
    _check(CompletionRequest, {"model": "m", "prompt": "hi"}, COMPLETION, name)


@pytest.mark.parametrize("cls,base", [(ChatCompletionRequest, {"model": "m", "messages": MSG}), (CompletionRequest, {"model": "m", "prompt": "p"})])
def test_unknown_field_is_400_naming_it(cls, base):
    with pytest.raises(APIError) as ei:
        parse_request(cls, {**base, "temprature": 0.5})
    assert (ei.value.status, ei.value.param, ei.value.code) == (400, "temprature", "unknown_parameter")


def test_extensions_reach_the_wire():
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "min_p": 0.1, "repetition_penalty": 1.3, "stop_token_ids": [7, 9]})
    sp = req.sampling_proto(4)
    assert abs(sp.min_p - 0.1) < 1e-6 and abs(sp.repetition_penalty - 1.3) < 1e-6 and list(sp.stop_token_ids) == [7, 9]


@pytest.mark.parametrize(
    "field,value",
    [("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {str(1 << 32): 1}), ("stop_token_ids", [1 << 32]), ("min_p", 1.5),
     ("top_k", 1 << 32), ("top_k", -1), ("seed", 1 << 63), ("seed", -(1 << 63) - 1), ("max_tokens", 1 << 32), ("tools", "str")],
)
def test_values_the_wire_cannot_carry_are_400(field, value):
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, field: value})
    assert ei.value.status == 400 and ei.value.param == field


def test_wire_bounds_are_inclusive():
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "top_k": (1 << 32) - 1, "seed": -(1 << 63)})
    sp = req.sampling_proto(4)
    assert sp.top_k == (1 << 32) - 1 and sp.seed == -(1 << 63)
    sp.SerializeToString()


def test_token_id_over_uint32_is_400():
    with pytest.raises(APIError) as ei:
        parse_request(CompletionRequest, {"model": "m", "prompt": [1, 1 << 32]})
    assert ei.value.status == 400 and ei.value.param == "prompt"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "m", "messages": MSG, "user": "a\udc80"}, "user"),
        ({"model": "m", "messages": MSG, "session_id": "\ud800"}, "session_id"),
        ({"model": "m", "messages": MSG, "stop": ["ok", "\udc80"]}, "stop.1"),
        ({"model": "m", "messages": [{"role": "user", "content": "x\udfff"}]}, "messages.0.content"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, body)
    assert ei.value.status == 400 and ei.value.param == param


def test_non_text_content_part_is_400():
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(APIError) as ei:
        req.messages_proto()
    assert ei.value.status == 400 and ei.value.param == "messages.0.content"
