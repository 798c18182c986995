"""Bad input never gives a 5xx, never resets the connection and never disturbs other calls (issue 18 items
2 and 10, and the generated-bodies part of the campaign)."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import MODEL, Figures, KeepAlive

pytestmark = pytest.mark.slow

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def dumps(body: dict) -> bytes:
    # json.dumps escapes a lone surrogate as \udc80: the router's json.loads gives it back as a lone surrogate
    return json.dumps(body).encode()


def post_generated(conn, figs, path: str, body: dict) -> tuple[int, bytes]:
    """POST one generated body on the kept-alive connection ``conn``, counting the answer in ``figs``: a lost
    connection, or a 5xx other than 503, fails with the figures so far. Returns (status, response body)."""
    try:
        status, _, data = conn.request("POST", path, dumps(body))
    except OSError as e:
        figs.add(None)
        raise AssertionError(f"connection lost on {body!r}: {e}; {figs}") from None
    figs.add(status, data)
    assert status < 500 or status == 503, f"{status} for {body!r}: {data[:300]!r}; {figs}"
    return status, data


# Issue 18 item 2: each passes validation but overflows / cannot be encoded on the wire.
UNENCODABLE = [
    (CHAT, chat_body(top_k=2**32), "top_k"),
    (CHAT, chat_body(top_k=2**70), "top_k"),
    (CHAT, chat_body(seed=2**63), "seed"),
    (CHAT, chat_body(seed=-(2**63) - 1), "seed"),
    (COMPL, {"model": MODEL, "prompt": [1, 2, 2**32], "max_tokens": 2}, "prompt"),
    (COMPL, {"model": MODEL, "prompt": [[5, 2**40]], "max_tokens": 2}, "prompt"),
    (CHAT, chat_body(user="\udc80"), "user"),
    (CHAT, chat_body(session_id="ab\udc80"), "session_id"),
    (CHAT, chat_body(stop="\udc80"), "stop"),
    (CHAT, chat_body(stop=["ok", "\ud800"]), "stop"),
    (COMPL, {"model": MODEL, "prompt": "x\udc80", "max_tokens": 2}, "prompt"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "\udc80"}], "max_tokens": 2}, "messages.0.content"),
    (CHAT, chat_body(model="tiny-llama\udc80"), "model"),
]


@pytest.mark.parametrize("path,body,param", UNENCODABLE, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(UNENCODABLE)])
def test_unencodable_values_are_400_naming_the_field_and_keep_the_connection(shared_stack, path, body, param):
    conn = KeepAlive(shared_stack.api)
    figs = Figures()
    try:
        status, _, data = conn.request("POST", path, dumps(body))
        figs.add(status, data)
        err = json.loads(data)["error"]
        assert status == 400, f"{status} {data[:300]!r}"
        # the param names the field, or an element of it (``stop.1``: the second stop string)
        assert (err["param"] == param or err["param"].startswith(param + ".")) and err["code"] == "invalid_value", data[:300]
        assert param in err["message"], data[:300]
        status2, _, data2 = conn.request("POST", CHAT, dumps(chat_body()))
        figs.add(status2, data2)
        assert status2 == 200, f"{data2[:300]!r}; {figs}"
        assert conn.reused, f"the router closed the keep-alive connection after the bad request; {figs}"
    finally:
        conn.close()


@pytest.mark.parametrize(
    "method,path,status",
    [("GET", "/v1/nope", 404), ("POST", "/nope", 404), ("GET", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405), ("PUT", "/health", 405)],
)
def test_unknown_routes_and_wrong_methods_get_the_openai_error_body(shared_stack, method, path, status):
    """Issue 18 item 10: FastAPI's ``{"detail": ...}`` is replaced by the OpenAI error body."""
    conn = KeepAlive(shared_stack.api)
    try:
        got, headers, data = conn.request(method, path, b"{}" if method in ("POST", "PUT") else None)
        body = json.loads(data)
        assert got == status and "detail" not in body, data
        assert body["error"]["type"] == "not_found_error" if status == 404 else "invalid_request_error"
        assert path in body["error"]["message"]
        if status == 405:
            assert "allow" in {k.lower() for k in headers}
        assert conn.request("GET", "/v1/models")[0] == 200 and conn.reused
    finally:
        conn.close()


def test_deeply_nested_json_is_400(shared_stack):
    conn = KeepAlive(shared_stack.api)
    try:
        status, _, data = conn.request("POST", CHAT, b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and json.loads(data)["error"]["code"] == "invalid_json", data[:200]
        assert conn.request("GET", "/v1/models")[0] == 200 and conn.reused
    finally:
        conn.close()


# ---------------------------------------------------------------------------------- generated bodies
BOUNDARY_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, -(10**30)]
SURROGATES = ["\udc80", "\ud800", "a\udfffb", "\ud83d"]
ints = st.sampled_from(BOUNDARY_INTS) | st.integers()
texts = st.sampled_from(SURROGATES) | st.text(max_size=12)
scalars = ints | texts | st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | st.none()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=6)
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "user", "session_id", "n", "stream", "ignore_eos",
          "logprobs", "stream_options", "max_completion_tokens", "messages", "model", "prompt", "echo", "suffix", "tools",
          # issue 44: vLLM's extensions
          "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "cache_salt", "skip_special_tokens",
          "include_stop_str_in_output", "min_p", "repetition_penalty", "reasoning_effort"]


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    body: dict = chat_body() if chat else {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for f in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        body[f] = draw(values)
    if draw(st.booleans()) and chat:
        body["messages"] = [{"role": draw(st.sampled_from(["user", "system", "tool", "bogus"])), "content": draw(texts | values)}]
    if draw(st.booleans()):  # keep generated calls short: the property is about the edge, not generation
        body["max_tokens"] = draw(st.integers(1, 4))
    body["stream"] = False
    return CHAT if chat else COMPL, body


def test_generated_bodies_never_5xx_keep_the_connection_and_spare_a_running_call(shared_stack):
    """Hypothesis bodies (boundary integers, lone surrogates, wrong types) on one keep-alive connection while
    a long call runs on the same model: no 5xx, no lost answer, the connection stays usable, and the long
    call's tokens equal those of a quiet run (greedy)."""
    import httpx

    long_body = {"model": MODEL, "prompt": "The river runs", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=shared_stack.api, timeout=120) as c:
        quiet = c.post(COMPL, json=long_body).json()["choices"][0]["text"]
    result: dict = {}

    def long_call():
        with httpx.Client(base_url=shared_stack.api, timeout=120) as c:
            result["r"] = c.post(COMPL, json=long_body)

    conn = KeepAlive(shared_stack.api)
    figs = Figures()
    t = threading.Thread(target=long_call)
    t.start()

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(bodies())
    def one(pb):
        path, body = pb
        post_generated(conn, figs, path, body)
        assert conn.reused, f"connection not kept after {body!r}; {figs}"

    try:
        one()
    finally:
        conn.close()
        t.join(120)
    assert figs.s5xx == 0 and figs.lost == 0 and figs.sent >= 100, str(figs)
    r = result["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == quiet, f"the running call was disturbed; {figs}"
