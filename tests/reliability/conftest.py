"""The reliability suite (issue 18 "keep the campaign"): faults and bad input against a real local stack
(nats-server, engine processes, router process, the official ``openai`` client and raw HTTP/1.1 keep-alive
connections). Each test states its figures (sent / ok / clean error / lost / 5xx) in its assertion messages.

Layout: ``shared_stack`` (session scope, two ``tiny-llama`` engines) serves the tests that leave the stack
as they found it (bad input, disconnects, bounded load); a test that kills or restarts a part builds its
own stack. Nothing here depends on the machine being fast: waits are bounded polls with generous limits.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse
from dataclasses import dataclass, field

import httpx
import pytest

from tests.integration.conftest import engine, health, stack_config, start_stack, wait_until

MODEL = "tiny-llama"
REPORT: list["Figures"] = []  # every Figures of the session, for the table (TALARIA_RELIABILITY_REPORT=path)


def pytest_sessionfinish(session, exitstatus) -> None:
    """With ``TALARIA_RELIABILITY_REPORT=path``: write the figures of every test as a Markdown table."""
    from tests.reliability import conftest as tests_view  # the module the tests import (may differ from this plugin's)

    path = os.environ.get("TALARIA_RELIABILITY_REPORT")
    if not path or not tests_view.REPORT:
        return
    rows = ["| test | sent | ok | clean error | lost | 5xx |", "|---|---|---|---|---|---|"]
    for f in tests_view.REPORT:
        if f.sent:
            rows.append(f"| {f.test} | {f.sent} | {f.ok} | {f.clean} | {f.lost} | {f.s5xx} |")
    with open(path, "w") as out:
        out.write("\n".join(rows) + "\n")


@dataclass
class Figures:
    """Outcome counts of one test: ``ok`` 2xx, ``clean`` an OpenAI error body with a 4xx or a retryable
    503/429, ``lost`` no answer (connection reset / timeout), ``5xx`` a 500 (or a 5xx without an error body)."""

    sent: int = 0
    ok: int = 0
    clean: int = 0
    lost: int = 0
    s5xx: int = 0
    notes: list[str] = field(default_factory=list)
    clean_notes: list[str] = field(default_factory=list)  # the first clean errors (a test that wants none says which)
    test: str = field(default_factory=lambda: os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0])

    def __post_init__(self) -> None:
        REPORT.append(self)

    def add(self, status: int | None, body: bytes | str | None = None) -> None:
        self.sent += 1
        if status is None:
            self.lost += 1
        elif 200 <= status < 300:
            self.ok += 1
        elif status >= 500 and not (status == 503 and _is_error_body(body)):
            self.s5xx += 1
            self.notes.append(f"{status}: {str(body)[:200]}")
        elif _is_error_body(body):
            self.clean += 1
            if len(self.clean_notes) < 3:
                self.clean_notes.append(f"{status}: {str(body)[:200]}")
        else:
            self.s5xx += 1  # an error without the OpenAI body counts as a defect
            self.notes.append(f"{status} without an error body: {str(body)[:200]}")

    def __str__(self) -> str:
        s = f"sent={self.sent} ok={self.ok} clean_error={self.clean} lost={self.lost} 5xx={self.s5xx}"
        s += f" first defects: {self.notes[:3]}" if self.notes else ""
        return s + (f" first clean errors: {self.clean_notes}" if self.clean_notes else "")


def _is_error_body(body) -> bool:
    try:
        e = json.loads(body)["error"]
        return isinstance(e, dict) and isinstance(e.get("message"), str) and "type" in e
    except Exception:  # noqa: BLE001
        return False


class KeepAlive:
    """One HTTP/1.1 connection to the router, reused for every request; ``reused`` stays True only while the
    server kept the connection open (a reset or a silent reconnect flips it)."""

    def __init__(self, base_url: str, timeout: float = 60.0):
        u = urllib.parse.urlparse(base_url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        self.conn.connect()
        self.sock = self.conn.sock
        self.reused = True

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
        h = {"Content-Type": "application/json", **(headers or {})}
        self.conn.request(method, path, body=body, headers=h)
        r = self.conn.getresponse()
        data = r.read()
        if self.conn.sock is not self.sock or r.will_close:
            self.reused = False
        return r.status, dict(r.getheaders()), data

    def close(self) -> None:
        self.conn.close()


def engines_idle(stack, ids, timeout: float = 30.0) -> None:
    """Wait until every engine in ``ids`` reports nothing running or waiting (bounded poll)."""
    def idle():
        inst = health(stack)["instances"]
        return all(inst[i]["running"] == 0 and inst[i]["waiting"] == 0 for i in ids)

    wait_until(idle, timeout=timeout, every=0.2)


@pytest.fixture(scope="session")
def rel_models_dir(synth_models):
    return next(iter(synth_models.values())).parent


@pytest.fixture(scope="session")
def shared_stack(rel_models_dir):
    cfg = stack_config(
        rel_models_dir,
        # requester probes every 0.5 s: an orphaned call is stopped well before it could finish on its own
        [engine("rel-a", MODEL, max_num_seqs=8, requester_probe_s=0.5), engine("rel-b", MODEL, max_num_seqs=8, requester_probe_s=0.5)],
        max_tokens_limit=2048,
    )
    s = start_stack(cfg)
    yield s
    s.stop()


def http_client(stack, timeout: float = 60.0) -> httpx.Client:
    return httpx.Client(base_url=stack.api, timeout=timeout)


def now() -> float:
    return time.monotonic()


class ExtraRouter:
    """A second router process on a running stack's NATS with its own config overrides (placement knobs,
    timeouts): cheaper than a new stack, and the engines are the real ones."""

    def __init__(self, stack, name: str, tmp_path, **router):
        from talaria.config import load_config

        data = load_config(stack.cfg_path).model_dump(mode="json")
        r = data["router"]
        for k, v in router.items():
            if isinstance(v, dict):
                r[k] = {**r.get(k, {}), **v}
            else:
                r[k] = v
        r["id"], r["port"] = name, 0
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        self.stack, self.name = stack, name
        child = stack._spawn(name, ["-m", "services.router", "--config", str(path)], "listening on")
        assert child.ready.wait(60), f"router {name} did not start"
        self.api = child.ready_line.rsplit(" ", 1)[-1]
        ids = {e.id for e in stack.cfg.engines}
        wait_until(lambda: ids <= {i for i, v in httpx.get(f"{self.api}/health", timeout=5).json()["instances"].items() if v["healthy"]}, timeout=30)

    def health(self) -> dict:
        return httpx.get(f"{self.api}/health", timeout=5).json()

    def stop(self) -> None:
        c = self.stack.children.pop(self.name, None)
        if c is not None:
            c.terminate()
            c.proc.wait(30)
