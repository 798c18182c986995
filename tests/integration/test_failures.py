"""A dead or frozen engine: bounded, clean errors, rerouting, and recovery (own stack: it breaks engines)."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from tests.integration.conftest import client_for, engine, health, stack_config, start_stack, wait_until

pytestmark = pytest.mark.slow

LLAMA, QWEN = "tiny-llama", "tiny-qwen2"


@pytest.fixture(scope="module")
def stack(models_dir):
    cfg = stack_config(models_dir, [engine("llama-a", LLAMA), engine("llama-b", LLAMA), engine("qwen-a", QWEN)], accept_timeout_s=3)
    s = start_stack(cfg)
    yield s
    s.stop()


def test_frozen_only_engine_gives_503_in_bounded_time_then_recovers(stack):
    client = client_for(stack)
    stack.kill("qwen-a", signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as ei:
            client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert ei.value.status_code == 503
        assert time.monotonic() - t0 < 10
        assert ei.value.response.headers.get("retry-after")
    finally:
        stack.kill("qwen-a", signal.SIGCONT)
    wait_until(lambda: health(stack)["instances"]["qwen-a"]["healthy"], timeout=10)
    r = client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.usage.completion_tokens >= 1


def test_session_is_rerouted_when_its_engine_dies(stack):
    client = client_for(stack)
    raw = client.chat.completions.with_raw_response.create(
        model=LLAMA, messages=[{"role": "user", "content": "first call"}], max_tokens=4, extra_headers={"X-Session-ID": "s-reroute"}
    )
    home = raw.headers["x-talaria-instance"]
    other = "llama-b" if home == "llama-a" else "llama-a"
    stack.kill(home, signal.SIGKILL)
    wait_until(lambda: not health(stack)["instances"][home]["healthy"], timeout=5)
    raw2 = client.chat.completions.with_raw_response.create(
        model=LLAMA, messages=[{"role": "user", "content": "second call"}], max_tokens=4, extra_headers={"X-Session-ID": "s-reroute"}
    )
    assert raw2.headers["x-talaria-instance"] == other
    assert raw2.parse().usage.completion_tokens >= 1
    stack.start_engine(home)
    wait_until(lambda: health(stack)["instances"][home]["healthy"], timeout=30)


def test_engine_killed_mid_stream_ends_stream_with_error(stack):
    with httpx.stream(
        "POST",
        f"{stack.api}/v1/chat/completions",
        json={"model": LLAMA, "messages": [{"role": "user", "content": "go"}], "max_tokens": 500, "ignore_eos": True, "stream": True},
        headers={"X-Session-ID": "s-midstream"},
        timeout=30,
    ) as resp:
        inst = resp.headers["x-talaria-instance"]
        lines = resp.iter_lines()
        for _ in range(4):
            next(lines)
        t0 = time.monotonic()
        stack.kill(inst, signal.SIGKILL)
        rest = list(lines)
        assert time.monotonic() - t0 < 10
    payload = "\n".join(rest)
    assert '"code":"engine_unavailable"' in payload.replace(" ", "")
    assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
    stack.start_engine(inst)
    wait_until(lambda: health(stack)["instances"][inst]["healthy"], timeout=30)
