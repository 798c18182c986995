"""Issue 44 item 2: vLLM's request extensions on chat/completions, end to end in the engine (real executor,
tiny synthesized model, CPU) and at the router's edge (each reaches the wire, or is a 400 naming it)."""

from __future__ import annotations

import json

import pytest

from services.engine.executor import Engine
from services.engine.output_processor import StopStringBuffer
from services.engine.types import EngineRequest, SamplingParams
from services.engine.wire import sampling_params
from services.router.errors import APIError
from services.router.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from talaria.hashing import cache_salt, model_salt, tenant_salt
from talaria.tokenizer import Tokenizer, continue_final_message
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture

PAGE = 4
MSG = [{"role": "user", "content": "hi"}]
IM_START = 1  # a special token of the synthesized tokenizer that is not an end-of-sequence token


@pytest.fixture(scope="module")
def llama(synth_models):
    return synth_models["tiny-llama"]


def run(engine: Engine, req: EngineRequest):
    engine.add_request(req)
    text, final = "", None
    while final is None:
        for out in engine.step():
            text += out.new_text
            if out.finished:
                final = out
    engine.check_integrity()
    return text, final


# ------------------------------------------------------------------------------------------ engine


def test_skip_special_tokens_leaves_them_out_of_the_text(llama):
    e = Engine(llama, page_size=PAGE, num_pages=128)
    p = e.tokenizer.encode("tell me something")
    forced = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias=((IM_START, 100.0),))
    kept, out1 = run(e, EngineRequest("k", p, SamplingParams(**forced)))
    skipped, out2 = run(e, EngineRequest("s", p, SamplingParams(**forced, skip_special_tokens=True)))
    assert kept == "<|im_start|>" * 3
    assert skipped == "" and out2.usage.completion_tokens == 3  # the same tokens, decoded without them


def test_include_stop_str_in_output_and_the_matched_stop_is_reported(llama):
    e = Engine(llama, page_size=PAGE, num_pages=128)
    p = e.tokenizer.encode("count")
    free, _ = run(e, EngineRequest("f", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    stop = free[3:5]  # a stop string the greedy output reaches
    assert stop.strip(), free
    cut, o1 = run(e, EngineRequest("c", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,))))
    kept, o2 = run(e, EngineRequest("i", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True)))
    at = free.find(stop)
    assert cut == free[:at] and kept == free[: at + len(stop)]
    assert o1.stop_reason == stop and o2.stop_reason == stop and o1.finish_reason.value == "stop"
    _, o3 = run(e, EngineRequest("n", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    assert o3.stop_reason == ""  # a length finish names no stop string


def test_cache_salt_separates_prefix_sharing_within_a_tenant(llama):
    e = Engine(llama, page_size=PAGE, num_pages=256)
    p = e.tokenizer.encode("system: a shared prompt prefix long enough for several pages " * 2)
    g = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    t1, a = run(e, EngineRequest("a", p, g, tenant="t", cache_salt="alice"))
    t2, b = run(e, EngineRequest("b", p, g, tenant="t", cache_salt="bob"))
    t3, a2 = run(e, EngineRequest("a2", p, g, tenant="t", cache_salt="alice"))
    t4, n = run(e, EngineRequest("n", p, g, tenant="t"))
    assert a.usage.cached_tokens == 0 and b.usage.cached_tokens == 0, "another salt must not hit"
    assert n.usage.cached_tokens == 0, "no salt is a salt of its own"
    assert a2.usage.cached_tokens >= len(p) - PAGE, "the same salt hits"
    assert t1 == t2 == t3 == t4  # salting changes caching, never tokens


def test_cache_salt_chains_are_the_tenants_own():
    s = tenant_salt(model_salt("m"), "t")
    assert cache_salt(s, "") == s
    assert cache_salt(s, "x") != s and cache_salt(s, "x") == cache_salt(s, "x")
    assert cache_salt(tenant_salt(model_salt("m"), "u"), "x") != cache_salt(s, "x")  # the same salt, another tenant


def test_stop_buffer_includes_the_stop_string_and_names_it():
    b = StopStringBuffer(("END", "EN"), include=True)
    assert b.feed("abc E") == ("abc ", False)
    assert b.feed("ND tail") == ("END", True) and b.matched == "END"  # the longer one at the same place
    assert b.text == "abc END"


def test_continue_final_message_cuts_after_the_final_content(llama):
    tok = Tokenizer.from_dir(llama)
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is ("}]
    text = continue_final_message(tok.render_chat_template(msgs, add_generation_prompt=False), msgs)
    assert text.endswith("The answer is (") and "<|im_end|>" not in text.split("The answer is (")[-1]
    with pytest.raises(ValueError):
        continue_final_message("no such text", [{"role": "assistant", "content": "zzz"}])


def test_wire_decoding_of_the_output_options():
    sp = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "skip_special_tokens": True, "include_stop_str_in_output": True}).sampling_proto(4)
    d = sampling_params(sp)
    assert d.skip_special_tokens and d.include_stop_str_in_output
    assert not sampling_params(parse_request(CompletionRequest, {"model": "m", "prompt": "p"}).sampling_proto(4)).skip_special_tokens


# ------------------------------------------------------------------------------------------ router edge


def test_chat_template_options_reach_the_wire():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure:"}]
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": msgs, "chat_template_kwargs": {"enable_thinking": False},
                                                "continue_final_message": True})
    opts = req.template_proto()
    assert json.loads(opts.kwargs_json) == {"enable_thinking": False} and opts.continue_final_message and opts.no_generation_prompt
    plain = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG})
    assert plain.template_proto() is None  # defaults: nothing on the wire
    assert parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "add_generation_prompt": False}).template_proto().no_generation_prompt


def test_cache_salt_makes_the_session_the_salts_own():
    a = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "session_id": "S", "cache_salt": "alice"})
    b = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "session_id": "S", "cache_salt": "bob"})
    plain = parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "session_id": "S"})
    assert len({a.session_key(None), b.session_key(None), plain.session_key(None)}) == 3
    assert a.session_key(None).startswith("S#salt-") and plain.session_key(None) == "S"
    assert parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, "cache_salt": "x"}).session_key(None) == ""  # no session: none made


@pytest.mark.parametrize(
    "cls,extra,param",
    [
        (ChatCompletionRequest, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        (ChatCompletionRequest, {"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs.add_generation_prompt"),
        (ChatCompletionRequest, {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        (ChatCompletionRequest, {"continue_final_message": True}, "continue_final_message"),  # final message is the user's
        (ChatCompletionRequest, {"messages": [{"role": "assistant", "content": "a"}], "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        (ChatCompletionRequest, {"cache_salt": ""}, "cache_salt"),
        (ChatCompletionRequest, {"skip_special_tokens": "yes please"}, "skip_special_tokens"),
        (CompletionRequest, {"chat_template_kwargs": {}}, "chat_template_kwargs"),  # chat only
        (CompletionRequest, {"continue_final_message": True}, "continue_final_message"),
        (ChatCompletionRequest, {"guided_json": {}}, "guided_json"),  # other vLLM extensions stay unknown: 400 naming them
    ],
)
def test_bad_extension_values_are_400_naming_the_field(cls, extra, param):
    base = {"model": "m", "messages": MSG} if cls is ChatCompletionRequest else {"model": "m", "prompt": "p"}
    with pytest.raises(APIError) as ei:
        parse_request(cls, {**base, **extra})
    assert ei.value.status == 400 and ei.value.param == param, (ei.value.param, ei.value.message)
