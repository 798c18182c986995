"""Requests too large to serve (issue 47 defect 1). A 4.8 MB prompt (under the router's 8 MiB body limit, over
NATS's 1 MiB ``max_payload``) was answered 503 ``engine_unavailable`` and took both instances offline: the
router counted the publish NATS refused for its size as a dead engine, and the next ordinary calls got 503
``no_healthy_instance``. Now a prompt that can never fit the context is a 413 before anything is sent, a
request too large for the bus is a 413 naming the limit, and neither touches an instance's health: every
ordinary call after them succeeds."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import health
from tests.reliability.conftest import MODEL, Figures, KeepAlive

pytestmark = pytest.mark.slow

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
HUGE = "hello world " * 400_000  # 4.8 MB of text, ~1.2 M tokens


def _ordinary_calls(conn: KeepAlive, figs: Figures, n: int) -> None:
    for i in range(n):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"ordinary call {i}"}], "max_tokens": 4}
        status, _, data = conn.request("POST", CHAT, json.dumps(body).encode())
        figs.add(status, data)


def _error(status: int, data: bytes) -> dict:
    try:
        return json.loads(data)["error"]
    except Exception:  # noqa: BLE001
        raise AssertionError(f"no OpenAI error body: {status} {data[:300]!r}") from None


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": HUGE}], "max_tokens": 8}, "messages"),
    (COMPL, {"model": MODEL, "prompt": HUGE, "max_tokens": 8}, "prompt"),
], ids=["chat", "completions"])
def test_a_prompt_that_can_never_fit_is_413_before_it_is_sent_and_disturbs_no_one(shared_stack, path, body, param):
    conn = KeepAlive(shared_stack.api)
    figs, after = Figures(), Figures()
    before = health(shared_stack)
    try:
        status, _, data = conn.request("POST", path, json.dumps(body).encode())
        figs.add(status, data)
        _ordinary_calls(conn, after, 6)
        now = health(shared_stack)
        assert after.ok == 6, f"oversized: {status} {data[:200]!r}; ordinary calls after it: {after}; instances: {now['instances']}"
        err = _error(status, data)
        assert status == 413 and err["code"] == "context_length_exceeded" and err["param"] == param, f"{status} {data[:400]!r}"
        assert "context limit" in err["message"], err
        assert all(v["state"] == "ok" for v in now["instances"].values()), now["instances"]
        # nothing was sent: no engine was asked (a publish refused or an engine that failed to accept counts here)
        for k in ("engine_unavailable", "too_large_for_bus", "bus_unavailable"):
            assert now["counters"].get(k, 0) == before["counters"].get(k, 0), (k, now["counters"])
    finally:
        conn.close()


def test_a_request_too_large_for_the_bus_is_413_naming_the_limit_and_disturbs_no_one(shared_stack):
    """A long history of assistant turns (which the early context check does not count: a template may drop
    part of them) makes a 1.5 MB wire message: over NATS's 1 MiB ``max_payload``, it cannot be sent to any
    instance. A 413 naming the limit, and no instance is marked suspect."""
    conn = KeepAlive(shared_stack.api)
    figs, after = Figures(), Figures()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 1_500_000}, {"role": "user", "content": "and?"}]
    try:
        status, _, data = conn.request("POST", CHAT, json.dumps({"model": MODEL, "messages": msgs, "max_tokens": 4}).encode())
        figs.add(status, data)
        _ordinary_calls(conn, after, 6)
        now = health(shared_stack)
        assert after.ok == 6, f"oversized: {status} {data[:200]!r}; ordinary calls after it: {after}; instances: {now['instances']}"
        err = _error(status, data)
        assert status == 413 and err["code"] == "request_too_large", f"{status} {data[:400]!r}"
        assert "max_payload" in err["message"] and "1048576" in err["message"], err
        assert all(v["state"] == "ok" for v in now["instances"].values()), now["instances"]
    finally:
        conn.close()
