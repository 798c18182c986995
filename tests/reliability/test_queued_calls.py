"""A call the engine accepted and holds in its queue is alive (issue 18 item 14): with a router silence
timeout of 1 s and an engine that runs one call at a time, calls queued behind a long one for seconds
finish normally (streaming and not); the engine's keepalive chunks, not tokens, carry them through."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.integration.conftest import engine, health, stack_config, start_stack
from tests.reliability.conftest import MODEL, Figures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single_slot_stack(rel_models_dir):
    cfg = stack_config(rel_models_dir, [engine("q-a", MODEL, max_num_seqs=1)], max_tokens_limit=2048, idle_chunk_timeout_s=1.0)
    s = start_stack(cfg)
    yield s
    s.stop()


def _stream(api: str, body: dict) -> tuple[int, str, list[dict]]:
    events = []
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{api}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return r.status_code, "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def test_calls_queued_longer_than_the_silence_timeout_complete(single_slot_stack):
    api = single_slot_stack.api
    figs = Figures()
    out: dict = {}

    def long_call():  # holds the only slot for 1024 decode steps (seconds, however fast the machine)
        with httpx.Client(timeout=300) as c:
            out["long"] = c.post(f"{api}/v1/completions", json={"model": MODEL, "prompt": "long", "max_tokens": 1024, "ignore_eos": True})

    t = threading.Thread(target=long_call)
    t.start()
    from tests.integration.conftest import wait_until

    wait_until(lambda: health(single_slot_stack)["instances"]["q-a"]["running"] == 1, timeout=60)
    body = {"model": MODEL, "prompt": "short", "max_tokens": 4, "temperature": 0}
    res: dict = {}
    ts = [
        threading.Thread(target=lambda: res.__setitem__("stream", _stream(api, body))),
        threading.Thread(target=lambda: res.__setitem__("plain", httpx.post(f"{api}/v1/completions", json=body, timeout=300))),
    ]
    for x in ts:
        x.start()
    for x in ts:
        x.join(300)
    t.join(300)
    status, text, events = res["stream"]
    errors = [e for e in events if "error" in e]
    figs.add(status if not errors else 503, json.dumps(errors[0]) if errors else "")
    plain = res["plain"]
    figs.add(plain.status_code, plain.text)
    figs.add(out["long"].status_code, out["long"].text)
    assert not errors and status == 200 and events[-1]["choices"][0]["finish_reason"] == "length", f"stream cut off: {errors}; {figs}"
    assert plain.status_code == 200, f"{plain.status_code} {plain.text[:200]}; {figs}"
    assert figs.ok == 3, str(figs)
    assert out["long"].json()["usage"]["completion_tokens"] == 1024, str(figs)
