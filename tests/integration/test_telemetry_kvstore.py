"""Issue 7 with the kvstore (issue 4): one call whose prefix is restored from the host KV store is ONE connected
trace across the router, engine and kvstore processes; the store's stats reach the telemetry service's /metrics.

Every process writes its spans to its own JSONL file under ``telemetry.traces_dir``; the test assembles them by
trace id. The engine's host KV spans are children of its call span, the store's RPC spans children of those
(W3C trace context sent as gRPC metadata by ``services/kvstore/client.py``).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from talaria.natsutil import connect
from talaria.otel import read_spans, traces_by_id
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import client_for, engine, stack_config, start_stack, wait_until

pytestmark = pytest.mark.slow

LLAMA = "tiny-llama"
TEXT = "The agent called the search tool and read the result. " * 12


@pytest.fixture(scope="module")
def stack(models_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("telemetry-kv")
    cfg = stack_config(
        models_dir, [engine("e0", LLAMA, page_size=16)],
        kvstore={"enabled": True, "capacity_mb": 64, "slab_kb": 32, "retry_after_s": 0.3, "rpc_timeout_s": 1.0},
    )
    cfg["telemetry"] = {"traces_dir": str(d / "traces"), "port": 0, "session_idle_s": 5.0}
    s = start_stack(cfg)
    s.test_dir = d
    assert s.telemetry_url
    yield s
    s.stop()


def chat(client, content: str, session: str):
    r = client.chat.completions.create(
        model=LLAMA, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=8,
        extra_headers={"X-Session-ID": session},
    )
    return r, r.id.split("-", 1)[1]


async def _flush_until_host(stack, session: str, timeout: float = 15.0) -> None:
    """Flush the engine's device caches until the session's KV is held only by the kvstore."""
    nc = await connect(stack.nats_url, "test")
    subj = Subjects(stack.cfg.namespace)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_FLUSH_CACHE)
            rep = pb.ControlReply.FromString((await nc.request(subj.control("e0"), req.SerializeToString(), timeout=5)).data)
            if {s.session_id: s.state for s in rep.snapshot.sessions}.get(session) == pb.KV_HOST:
                return
            assert loop.time() < deadline, f"session {session} never reached the host tier"
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


def _trace(stack, request_id: str, want: set[str]) -> list[dict]:
    """The spans of the trace whose router span carries ``request_id``, once spans named ``want`` are in."""

    def ready():
        spans = read_spans(stack.test_dir / "traces")
        root = next((s for s in spans if s["attributes"].get("talaria.request.id") == request_id and s["resource"]["service.name"] == "talaria-router" and s["kind"] == "SERVER"), None)
        if root is None:
            return None
        trace = traces_by_id(spans)[root["trace_id"]]
        return trace if want <= {s["name"] for s in trace} else None

    try:
        return wait_until(ready, timeout=15)
    except AssertionError:
        spans = read_spans(stack.test_dir / "traces")
        names = sorted({(s["resource"]["service.name"], s["name"], s["parent_span_id"] is None) for s in spans})
        raise AssertionError(f"trace of {request_id} lacks some of {sorted(want)}; spans seen (service, name, root): {names}") from None


def _connected(trace: list[dict]) -> dict[str, dict]:
    by_id = {s["span_id"]: s for s in trace}
    roots = [s["name"] for s in trace if s["parent_span_id"] is None]
    assert roots == [f"chat {LLAMA}"], f"one root, the router's call span; roots: {roots}"
    for s in trace:
        assert s["parent_span_id"] is None or s["parent_span_id"] in by_id, f"{s['name']} has a parent outside the trace"
    return by_id


def _metrics(stack) -> dict:
    text = httpx.get(f"{stack.telemetry_url}/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in fams[family].samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_restored_call_is_one_trace_across_router_engine_and_kvstore(stack):
    client = client_for(stack)
    _, rid1 = chat(client, TEXT, "kv-trace")
    asyncio.run(_flush_until_host(stack, "kv-trace"))  # checkpointed, and gone from the device caches
    r2, rid2 = chat(client, TEXT + " next turn", "kv-trace")
    assert r2.usage.prompt_tokens_details.cached_tokens > 0

    # the first call: its checkpoint (run on the engine's worker after the call ended) is in the call's trace
    t1 = _trace(stack, rid1, {"talaria.engine.call", "talaria.engine.kv_checkpoint", "talaria.kvstore.reserve", "talaria.kvstore.commit"})
    by_id = _connected(t1)
    call1 = next(s for s in t1 if s["name"] == "talaria.engine.call")
    ckpt = next(s for s in t1 if s["name"] == "talaria.engine.kv_checkpoint")
    assert ckpt["parent_span_id"] == call1["span_id"] and ckpt["attributes"]["talaria.kv.bytes"] > 0
    for name in ("talaria.kvstore.reserve", "talaria.kvstore.commit"):
        s = next(x for x in t1 if x["name"] == name)
        assert s["parent_span_id"] == ckpt["span_id"] and s["kind"] == "SERVER", name
        assert s["resource"]["service.name"] == "talaria-kvstore"
    commit = next(s for s in t1 if s["name"] == "talaria.kvstore.commit")
    assert commit["attributes"]["talaria.kvstore.committed_pages"] > 0 and commit["attributes"]["talaria.kvstore.bytes"] > 0
    reserve = next(s for s in t1 if s["name"] == "talaria.kvstore.reserve")
    assert reserve["attributes"]["talaria.kvstore.model"].startswith(f"{LLAMA}@")
    assert by_id[call1["parent_span_id"]]["name"] == f"chat {LLAMA}"

    # the returning call: its prefix restored from the store, one connected trace over three processes
    t2 = _trace(stack, rid2, {"talaria.engine.call", "talaria.engine.prefill", "talaria.engine.kv_restore", "talaria.kvstore.lookup", "talaria.kvstore.unpin"})
    _connected(t2)
    pids = {s["resource"]["service.name"]: s["resource"]["process.pid"] for s in t2}
    assert set(pids) == {"talaria-router", "talaria-engine", "talaria-kvstore"}, pids
    assert len(set(pids.values())) == 3, f"three processes: {pids}"
    call2 = next(s for s in t2 if s["name"] == "talaria.engine.call")
    restore = next(s for s in t2 if s["name"] == "talaria.engine.kv_restore")
    ra = restore["attributes"]
    assert restore["parent_span_id"] == call2["span_id"]
    assert ra["talaria.kv.decision"] == "restore" and ra["talaria.kv.tokens"] > 0 and ra["talaria.kv.bytes"] > 0 and ra["talaria.kv.seconds"] > 0
    assert ra["talaria.session.id"] == "kv-trace"
    lookup = next(s for s in t2 if s["name"] == "talaria.kvstore.lookup")
    la = lookup["attributes"]
    assert lookup["parent_span_id"] == restore["span_id"] and lookup["resource"]["service.name"] == "talaria-kvstore"
    assert la["talaria.kvstore.hit"] is True and la["talaria.kvstore.hit_pages"] * 16 >= ra["talaria.kv.tokens"]
    assert la["talaria.kvstore.model"].startswith(f"{LLAMA}@") and la["talaria.kvstore.bytes"] > 0
    unpin = next(s for s in t2 if s["name"] == "talaria.kvstore.unpin")
    assert unpin["parent_span_id"] == restore["span_id"] and unpin["attributes"]["talaria.kvstore.read_complete"] is True
    assert unpin["attributes"]["talaria.kvstore.bytes"] == ra["talaria.kv.bytes"]
    prefill = next(s for s in t2 if s["name"] == "talaria.engine.prefill")
    assert prefill["attributes"]["talaria.kv.source"] == "host"
    assert prefill["attributes"]["talaria.prefill.restored_tokens"] == ra["talaria.kv.tokens"]

    # the store's stats on NATS -> the telemetry service's host-store metrics
    def fed():
        fams = _metrics(stack)
        return fams if _value(fams, "talaria_host_store_restores", "talaria_host_store_restores_total") >= 1 else None

    fams = wait_until(fed, timeout=10)
    occ = [s for s in fams["talaria_host_store_occupancy_ratio"].samples]
    assert occ and all(0 < s.value <= 1 for s in occ), occ
    assert _value(fams, "talaria_host_store_bytes", "talaria_host_store_bytes_total", direction="in") > 0
    assert _value(fams, "talaria_host_store_bytes", "talaria_host_store_bytes_total", direction="out") >= ra["talaria.kv.bytes"]
    assert _value(fams, "talaria_host_store_pages", "talaria_host_store_pages_total", outcome="hit") > 0
    assert _value(fams, "talaria_host_store_capacity_bytes", "talaria_host_store_capacity_bytes") == 64 * 2**20
    assert _value(fams, "talaria_host_store_entries", "talaria_host_store_entries") > 0
    stores = httpx.get(f"{stack.telemetry_url}/summary", timeout=5).json()["stores"]
    assert len(stores) == 1 and next(iter(stores.values()))["restores"] >= 1
