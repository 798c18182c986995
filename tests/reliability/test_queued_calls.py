"""A call the engine accepted and holds in its queue is alive (issue 18 item 14). One engine slot, a router
silence timeout of 3 s: three long streams occupy the slot and the queue, two short calls (streaming and
not) queue behind them. The test holds them there for twice the timeout (a deliberate dwell, measured on
the wall clock), then abandons the long streams; every call that was queued must end normally. Only the
engine's keepalive chunks can carry a queued call through the dwell."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.integration.conftest import engine, health, stack_config, start_stack, wait_until
from tests.reliability.conftest import MODEL, Figures

pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def single_slot_stack(rel_models_dir):
    cfg = stack_config(rel_models_dir, [engine("q-a", MODEL, max_num_seqs=1)], max_tokens_limit=4000, idle_chunk_timeout_s=TIMEOUT_S)
    s = start_stack(cfg)
    yield s
    s.stop()


class Call(threading.Thread):
    """One call on its own thread; ``stop`` abandons a stream (the client goes away)."""

    def __init__(self, api: str, body: dict):
        super().__init__(daemon=True)
        self.api, self.body = api, body
        self.status, self.events, self.text, self.errors = 0, [], "", []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=300) as c:
            if not self.body.get("stream"):
                r = c.post(f"{self.api}/v1/completions", json=self.body)
                self.status, self.text = r.status_code, r.text
                return
            with c.stream("POST", f"{self.api}/v1/completions", json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        e = json.loads(line[6:])
                        (self.errors if "error" in e else self.events).append(e)
                    if self.stop.is_set():
                        return


def test_calls_queued_longer_than_the_silence_timeout_complete(single_slot_stack):
    st, api = single_slot_stack, single_slot_stack.api
    state = lambda: health(st)["instances"]["q-a"]  # noqa: E731
    longs = [Call(api, {"model": MODEL, "prompt": f"long {i}", "max_tokens": 3900, "ignore_eos": True, "stream": True}) for i in range(3)]
    for c in longs:
        c.start()
    wait_until(lambda: state()["running"] + state()["waiting"] >= 3, timeout=60)
    short = {"model": MODEL, "prompt": "short", "max_tokens": 4, "temperature": 0}
    queued = [Call(api, {**short, "stream": True}), Call(api, short)]
    for c in queued:
        c.start()
    wait_until(lambda: state()["waiting"] >= 4, timeout=60)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2 * TIMEOUT_S:  # the dwell: queued for twice the router's silence timeout
        time.sleep(0.2)
    held = state()["waiting"]
    long_errors = [e for c in longs for e in c.errors]
    for c in longs:
        c.stop.set()
    for c in queued:
        c.join(120)
    figs = Figures()
    s, p = queued
    figs.add(503 if s.errors else s.status, json.dumps(s.errors[0]) if s.errors else "")
    figs.add(p.status, p.text)
    assert held >= 2, f"the short calls were not queued through the dwell (waiting={held}); {figs}"
    assert not long_errors, f"a long call was cut while running or queued: {long_errors[:1]}; {figs}"
    assert not s.errors and s.status == 200 and s.events[-1]["choices"][0]["finish_reason"] == "length", f"queued stream cut off: {s.errors}; {figs}"
    assert p.status == 200, f"queued call: {p.status} {p.text[:200]}; {figs}"
    assert figs.ok == 2, str(figs)
