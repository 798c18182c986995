"""Shared fixtures of the engine <-> host-KV tests: a real in-process kvstore (gRPC + Mooncake TCP on
loopback), one Mooncake endpoint per module, and a driver that steps a cold engine until its calls finish.

Import the fixtures a module needs by name (``from tests.unit.host_kv_fixtures import store, mooncake``);
``one_thread`` is autouse in the module that imports it (torch on one thread: the tiny models are faster that
way, and the store's threads get the other core). Not a conftest: most unit modules want none of these."""

from __future__ import annotations

import pytest

from services.kvstore.server import KvStoreServer
from services.kvstore.transfer import MooncakeEndpoint
from talaria.config import KvStoreConfig
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def store():
    """A running kvstore (64 MiB, 4 KiB slabs); stopped at the end of the module."""
    srv = KvStoreServer(KvStoreConfig(capacity_mb=64, slab_kb=4))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mooncake():
    mc = MooncakeEndpoint()
    yield mc
    mc.close()


def run_calls(ce, reqs, max_steps: int = 10_000) -> dict:
    """Add ``reqs`` to engine ``ce`` and step it until all finish. Returns, per request id, its final output
    (``out[rid]``) and every token it produced (``out[rid + ":tokens"]``). Mutates the engine (steps it)."""
    for r in reqs:
        ce.add_request(r)
    out: dict = {r.request_id + ":tokens": [] for r in reqs}
    done: set[str] = set()
    for _ in range(max_steps):
        for o in ce.step():
            key = o.request_id + ":tokens"
            if key in out:
                out[key] += o.new_token_ids
                if o.finished:
                    out[o.request_id] = o
                    done.add(o.request_id)
        if len(done) == len(reqs):
            return out
    raise AssertionError("calls did not finish")
