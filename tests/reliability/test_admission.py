"""Admission is a prediction, not a verdict (issue 18 items 4 and 5): an idle engine takes a call its
prediction calls slow, and a prompt over the context is 413, never 429. A second router on the shared
stack runs with an admission budget so small that every prediction fails it."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import MODEL, ExtraRouter, Figures, KeepAlive, engines_idle

pytestmark = pytest.mark.slow


@pytest.fixture()
def strict_router(shared_stack, tmp_path):
    engines_idle(shared_stack, ["rel-a", "rel-b"])
    r = ExtraRouter(shared_stack, "router-strict", tmp_path, placement={"admission_budget_s": 1e-6, "overload": "reject"})
    yield r
    r.stop()


def test_idle_engines_take_calls_predicted_over_budget(strict_router):
    """Before: 429 overloaded with Retry-After for every call. Now: served, with the risk reported."""
    conn = KeepAlive(strict_router.api)
    figs = Figures()
    risks = 0
    try:
        for i in range(4):
            body = b'{"model": "%s", "prompt": "call %d", "max_tokens": 3, "temperature": 0}' % (MODEL.encode(), i)
            status, headers, data = conn.request("POST", "/v1/completions", body)
            figs.add(status, data)
            risks += "x-talaria-deadline-risk" in {k.lower() for k in headers}
            assert status == 200, f"{status} {data[:200]!r}; {figs}"
            assert headers.get("x-talaria-placement") == "start-now", f"{headers}; {figs}"
    finally:
        conn.close()
    assert figs.ok == 4 and risks == 4, f"{figs}; deadline-risk headers {risks}"
    m = strict_router.health()["placement"]
    assert m["admitted_start_now"] >= 4 and m["deadline_risk"] >= 4 and m["overload_rejected"] == 0, m


def test_a_prompt_over_the_context_is_413_never_429(strict_router):
    conn = KeepAlive(strict_router.api)
    figs = Figures()
    try:
        cases = [
            b'{"model": "%s", "prompt": "%s", "max_tokens": 4}' % (MODEL.encode(), b"hello world " * 30000),
            b'{"model": "%s", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 4}' % (MODEL.encode(), b"hello world " * 30000),
            b'{"model": "%s", "prompt": [%s], "max_tokens": 4}' % (MODEL.encode(), b",".join([b"7"] * 5000)),
        ]
        for body in cases:
            status, headers, data = conn.request("POST", "/v1/" + ("chat/completions" if b"messages" in body else "completions"), body)
            figs.add(status, data)
            assert status == 413 and b"context_length_exceeded" in data, f"{status} {data[:200]!r}; {figs}"
            assert "retry-after" not in {k.lower() for k in headers}, f"{headers}; {figs}"
    finally:
        conn.close()
    assert figs.clean == 3, str(figs)
