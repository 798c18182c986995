"""Engines frozen and killed mid-stream (issue 18 item 9 / issue 12 item 4, router part, and the campaign's
engine-kill case). Own stack: it breaks engines. A frozen engine is *slow*: its in-flight stream completes,
the router marks it suspect meanwhile and logs it. A killed engine is *dead*: NATS no-responders says so
within seconds, its stream ends with a clean ``engine_unavailable`` event, new calls go elsewhere."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.integration.conftest import engine, health, stack_config, start_stack, wait_until
from tests.reliability.conftest import MODEL, Figures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fault_stack(rel_models_dir):
    cfg = stack_config(rel_models_dir, [engine("f-a", MODEL), engine("f-b", MODEL)], max_tokens_limit=2048, heartbeat_miss_limit_s=2.0)
    s = start_stack(cfg)
    yield s
    s.stop()


class Stream:
    """One SSE call read on a thread: events, whether it ended with [DONE], the error events."""

    def __init__(self, api: str, body: dict):
        self.events: list[dict] = []
        self.done = False
        self.status = 0
        self.instance = ""
        self.started = threading.Event()
        self.t = threading.Thread(target=self._run, args=(api, body), daemon=True)
        self.t.start()

    def _run(self, api, body) -> None:
        with httpx.Client(timeout=120) as c, c.stream("POST", f"{api}/v1/completions", json={**body, "stream": True}) as r:
            self.status, self.instance = r.status_code, r.headers.get("x-talaria-instance", "")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    if len(self.events) >= 3:
                        self.started.set()
        self.started.set()

    @property
    def errors(self) -> list[dict]:
        return [e for e in self.events if "error" in e]


def test_a_frozen_engine_is_suspect_and_its_stream_survives(fault_stack):
    before = health(fault_stack)["counters"].get("instance_suspect", 0)
    s = Stream(fault_stack.api, {"model": MODEL, "prompt": "freeze", "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    assert s.started.wait(60)
    fault_stack.kill(s.instance, signal.SIGSTOP)
    try:
        # suspect in /health, and the state change recorded by the router's sweep (it runs every 0.25 s:
        # without waiting for it, a quick thaw could undo the state before it is counted)
        wait_until(lambda: (h := health(fault_stack))["instances"][s.instance]["state"] == "suspect"
                   and h["counters"].get("instance_suspect", 0) > before, timeout=30, every=0.2)
        r = httpx.post(f"{fault_stack.api}/v1/completions", json={"model": MODEL, "prompt": "meanwhile", "max_tokens": 2}, timeout=60)
        other = r.headers.get("x-talaria-instance")
    finally:
        fault_stack.kill(s.instance, signal.SIGCONT)
    s.t.join(120)
    figs = Figures()
    figs.add(s.status if not s.errors else 503, json.dumps(s.errors[0]) if s.errors else "")
    figs.add(r.status_code, r.text)
    assert not s.errors and s.done, f"the frozen engine's stream was cut: {s.errors}; {figs}"
    assert s.events[-1]["choices"][0]["finish_reason"] == "length", str(figs)
    assert r.status_code == 200 and other != s.instance, f"new call went to {other}; {figs}"
    assert health(fault_stack)["counters"].get("instance_suspect", 0) > before, str(figs)
    wait_until(lambda: health(fault_stack)["instances"][s.instance]["state"] == "ok", timeout=30)


def test_an_engine_killed_mid_stream_is_dead_and_its_stream_ends_cleanly(fault_stack):
    s = Stream(fault_stack.api, {"model": MODEL, "prompt": "kill", "max_tokens": 2000, "ignore_eos": True})
    assert s.started.wait(60)
    victim = s.instance
    t0 = time.monotonic()
    fault_stack.kill(victim, signal.SIGKILL)
    s.t.join(60)
    took = time.monotonic() - t0
    figs = Figures()
    figs.add(503 if s.errors else s.status, json.dumps(s.errors[0]) if s.errors else "")
    try:
        assert s.done and s.errors and s.errors[0]["error"]["code"] == "engine_unavailable", f"{s.events[-2:]}; {figs}"
        assert took < 30, f"stream ended {took:.1f}s after the kill; {figs}"
        assert health(fault_stack)["instances"][victim]["state"] == "dead", str(figs)
        for i in range(3):
            r = httpx.post(f"{fault_stack.api}/v1/completions", json={"model": MODEL, "prompt": f"after {i}", "max_tokens": 2}, timeout=60)
            figs.add(r.status_code, r.text)
        assert figs.ok == 3 and figs.clean == 1 and figs.s5xx == 0, f"after the kill: {figs}"
    finally:
        fault_stack.start_engine(victim)
    wait_until(lambda: health(fault_stack)["instances"][victim]["state"] == "ok", timeout=60)
