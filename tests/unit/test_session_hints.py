"""Issue 14 item 4 (pure parts): hint validation and Dynamo aliases, X-Session-End, the lease bound and the
session end in the gateway, priority / latency-sensitivity order in the engine queue, chain-leaf release in the
radix cache and the kvstore registry."""

from __future__ import annotations

import pytest

from services.engine.kv.allocator import PageAllocator
from services.engine.kv.manager import KVManager
from services.engine.kv.radix import RadixCache
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from services.engine.session_chains import SessionChains
from services.kvstore.registry import HostKVRegistry
from services.router.errors import APIError
from services.router.hints import CallHints, parse_ttl
from services.router.schemas import ChatCompletionRequest, parse_request
from services.router.session_api import session_end_header
from talaria.clock import ManualClock
from talaria.kv_layout import Family, Layout
from talaria.v1 import engine_pb2 as pb
from tests.unit.test_router_placement import hook, make_gateway, place, snapshot

MSG = [{"role": "user", "content": "hi"}]


def parse(**extra) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": MSG, **extra})


def bad(param: str, **extra) -> None:
    with pytest.raises(APIError) as e:
        parse(**extra).hints()
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)


def test_native_hints_and_dynamo_aliases_resolve_alike():
    native = parse(priority=5, expected_output_tokens=300, expected_tool_s=2.5, cache_ttl_s=600).hints()
    assert native == CallHints(5, 300, 2.5, 600.0)
    alias = parse(nvext={"agent_hints": {"priority": 5, "osl": 300}, "cache_control": {"type": "ephemeral", "ttl": "10m"}}, expected_tool_s=2.5).hints()
    assert alias == native
    assert parse(cache_control={"type": "ephemeral", "ttl": "1h"}).hints().cache_ttl_s == 3600.0
    assert parse(cache_control={"type": "ephemeral"}).hints().cache_ttl_s == 300.0  # Dynamo's default
    assert parse(nvext={"agent_hints": {"latency_sensitivity": 1.2, "speculative_prefill": False}}).hints().latency_sensitivity_s == 1.2
    assert parse().hints() == CallHints() and CallHints().proto() is None  # no hint: the wire field stays unset
    m = native.proto()
    assert (m.has_priority, m.priority, m.expected_output_tokens, m.expected_tool_s, m.cache_ttl_s) == (True, 5, 300, 2.5, 600.0)
    assert CallHints(priority=0).proto().has_priority  # an explicit 0 is a hint too


def test_bad_hints_are_400_naming_the_field():
    bad("priority", priority="high")
    bad("priority", priority=1 << 31)
    bad("expected_output_tokens", expected_output_tokens=0)
    bad("expected_tool_s", expected_tool_s=-1)
    bad("cache_ttl_s", cache_ttl_s=0)
    bad("nvext.agent_hints.osl", nvext={"agent_hints": {"osl": -3}})
    bad("nvext.greed_sampling", nvext={"greed_sampling": True})  # other nvext fields: refused, not ignored
    bad("nvext.agent_hints.prefix_id", nvext={"agent_hints": {"prefix_id": "x"}})
    bad("nvext.agent_hints.speculative_prefill", nvext={"agent_hints": {"speculative_prefill": True}})
    bad("cache_control.type", cache_control={"type": "persistent"})
    bad("cache_control.ttl", cache_control={"type": "ephemeral", "ttl": "forever"})
    bad("nvext.cache_control.ttl", nvext={"cache_control": {"type": "ephemeral", "ttl": "2d"}})
    bad("nvext.agent_hints.priority", priority=1, nvext={"agent_hints": {"priority": 2}})  # contradiction
    bad("cache_control.ttl", cache_ttl_s=60, cache_control={"type": "ephemeral", "ttl": "5m"})


def test_parse_ttl():
    assert [parse_ttl(v, "p") for v in ("300", "5m", "1h", 90, "2.5s")] == [300.0, 300.0, 3600.0, 90.0, 2.5]
    for v in ("", "5 d", True, 0, 86401):
        with pytest.raises(APIError):
            parse_ttl(v, "p")


def test_session_end_header():
    assert session_end_header(None, "") is False
    assert session_end_header("true", "s") is True and session_end_header("False", "s") is False
    for value, session in (("maybe", "s"), ("true", "")):
        with pytest.raises(APIError) as e:
            session_end_header(value, session)
        assert e.value.param == "X-Session-End"


def test_cache_ttl_bounds_the_lease_and_session_end_drops_it():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock, tau=5.0)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    assert place(ls, store, "s").instance_id == "a"
    h = hook("a", "s", clock)
    h.hints.CopyFrom(pb.AgentCallHints(cache_ttl_s=2.0))
    lease = ls.on_hook(h)
    assert lease.t_exp_unix - lease.t_done_unix == pytest.approx(2.0)  # min(tau, ttl)
    h.hints.cache_ttl_s = 60.0
    assert ls.on_hook(h).t_exp_unix - clock.now() == pytest.approx(5.0)  # never longer than tau
    store.install_now(lease)
    assert gw.leases.get("s", "m") is not None and gw.sessions.get("s") is not None
    ended = hook("a", "s", clock, rid="r2")
    ended.session_ended = True
    assert ls.on_hook(ended) is None  # no lease installed; session and leases forgotten
    assert gw.leases.get("s", "m") is None and gw.sessions.get("s") is None
    assert gw.end_session("s") == []  # idempotent: unknown now


def test_expected_output_tokens_replace_the_learned_decode_length():
    clock = ManualClock(100.0)
    ls, _ = make_gateway(clock)
    gw = ls.gw
    assert gw.request("s", "m", 100, 512, 400).expected_decode == 400.0
    assert gw.request("s", "m", 100, 128, 400).expected_decode == 128.0  # capped by max_tokens
    assert gw.request("s", "m", 100, 512).expected_decode == gw.shapes.shape("m").decode_tokens


def _seq(rid: str, priority: int = 0, queue_at: float = 0.0, preempted: bool = False) -> Sequence:
    s = Sequence(rid, [1, 2, 3])
    s.priority, s.queue_at = priority, queue_at
    s.num_preemptions = int(preempted)
    return s


def test_engine_queue_orders_by_priority_then_effective_arrival():
    sch = Scheduler(KVManager(16, 4, clock=ManualClock(0.0).now), max_num_seqs=4)
    sch.waiting.append(_seq("pre", preempted=True))
    for s in (_seq("a", 0, 1.0), _seq("b", 0, 2.0), _seq("hi", 5, 3.0), _seq("c", 0, 4.0), _seq("urgent", 0, 4.5 - 3.0), _seq("hi2", 5, 5.0)):
        sch.add(s)
    assert [s.request_id for s in sch.waiting] == ["pre", "hi", "hi2", "a", "urgent", "b", "c"]


def test_radix_drop_leaves_keeps_shared_prefixes():
    alloc = PageAllocator(8)
    radix = RadixCache(alloc, ManualClock(0.0).now)
    pages = alloc.allocate(4)
    radix.insert([1, 2, 3], pages[:3])  # session A: pages 1-2-3
    radix.insert([1, 2, 9], pages[:2] + [pages[3]])  # session B shares 1-2
    alloc.decref(pages)  # the tree holds them now
    assert radix.drop_leaves([1, 2, 3]) == 1  # only A's own page
    assert 1 in radix and 2 in radix and 3 not in radix
    assert radix.drop_leaves([1, 2, 3]) == 0  # idempotent
    radix.check_integrity()


def test_registry_release_leaves_keeps_shared_prefixes():
    lay = Layout("m@r", 0, 1, 4, "uint8", Family.MHA, (1024,), 1024)
    reg = HostKVRegistry(64 * 1024, 1024, clock=ManualClock(0.0).now)
    for chain in ([1, 2, 3], [1, 2, 9]):
        r = reg.reserve(lay, chain)
        reg.commit(r.lease_id, [b.block_id for b in r.blocks])
    assert reg.release_leaves("m@r", 0, [1, 2, 3]) == 1
    assert reg.lookup(lay, [1, 2, 9]).pages == 3 and reg.lookup(lay, [1, 2, 3]).pages == 2
    assert reg.release_leaves("m@r", 0, [1, 2, 9]) == 3  # now nothing else extends 1-2
    assert reg.num_entries == 0
    reg.check_integrity()


def test_session_chains_keep_every_branch_newest_last():
    c = SessionChains(max_sessions=2, max_chains=2)
    c.record("s", [1, 2])
    c.record("s", [1, 2, 3])  # extends: replaces its prefix
    c.record("s", [1, 5])  # a branch
    assert c.pop("s") == [[1, 2, 3], [1, 5]] and c.pop("s") == []
    for sid in ("a", "b", "c"):
        c.record(sid, [7])
    assert len(c) == 2 and c.pop("a") == []  # the oldest session went


def test_verify_failures_metric_counts_growth_per_engine():
    from services.telemetry.collector import Collector

    col = Collector(idle_s=60.0)
    for inst, total in (("e0", 0), ("e0", 2), ("e0", 2), ("e1", 1), ("e0", 1)):  # e0 restarted: 1 new
        col.on_hook(pb.CompletionHook(request_id="r", model="m", instance_id=inst, kv_restore_verify_failures=total), 0.0)
    c = col.metrics.kv_verify_failures
    assert c.labels("e0")._value.get() == 3 and c.labels("e1")._value.get() == 1


def test_kv_verify_bench_smoke():
    from bench.kv_verify_bench import run

    r = run(gib=1 / 1024, page_bytes=4096, repeats=1)
    assert r["pages"] == 256 and r["s_per_gib"]["verify"] > 0


def test_token_deadline_targets_are_validated_request_extras():
    """Issue 16's per-call targets reach the router as request extras (GenerateRequest.ttft_target_s /
    tpot_target_s); out of range is a 400 naming the field, never ignored."""
    r = parse(ttft_target_s=0.5, tpot_target_s=0.05)
    assert (r.ttft_target_s, r.tpot_target_s) == (0.5, 0.05)
    assert parse().ttft_target_s is None
    for field, value in (("ttft_target_s", -1), ("tpot_target_s", 0), ("ttft_target_s", 1e9)):
        with pytest.raises(APIError) as e:
            parse(**{field: value})
        assert e.value.status == 400 and e.value.param == field
