"""The KV residency owner (``kv/session_residency.py``): one answer to "where is this session's KV", one
location type converted to the proto enum only at the wire edge. Pure: a real KV manager and store index,
no torch, no store."""

from __future__ import annotations

from services.engine import wire
from services.engine.kv import KvLocation, KVManager, Residency, SessionResidency
from services.engine.kv.host_tier import StoreIndex
from talaria.v1 import engine_pb2 as pb

P = 4


def manager(pages: int = 16, entries: int = 8) -> KVManager:
    return KVManager(pages, P, clock=lambda: 0.0, session_entries=entries)


def put_session(kv: KVManager, sid: str, n_tokens: int) -> list[int]:
    pages = kv.allocator.allocate(-(-n_tokens // P))
    kv.sessions.put(sid, list(range(n_tokens)), pages)
    return pages


def test_where_answers_device_then_host_then_missing_then_unknown():
    kv = manager()
    owner = SessionResidency(kv, "m", wall=lambda: 42.0)
    assert owner.where("a") is None  # never seen
    put_session(kv, "a", 10)
    owner.record("a")
    assert owner.where("a") == Residency("a", KvLocation.DEVICE, 10, "m", 2, 42.0)

    idx, up = StoreIndex(), [True]
    owner.attach_host(idx, lambda: up[0])
    idx.saw_epoch(7)
    idx.committed("b", [11, 12], 8, epoch=7, now_unix=5.0)
    assert owner.where("b") == Residency("b", KvLocation.HOST, 8, "m", 0, 5.0)
    up[0] = False  # the store is down: a checkpointed session cannot be restored now
    assert owner.where("b").where is KvLocation.MISSING
    up[0] = True
    idx.saw_epoch(8)  # the store restarted: what it held is gone
    assert owner.where("b").where is KvLocation.MISSING

    # the device answer wins over the host's for a session in both places, and each session is listed once
    idx.committed("a", [1, 2], 8, epoch=8, now_unix=6.0)
    assert owner.where("a").where is KvLocation.DEVICE
    assert sorted((r.session_id, r.where) for r in owner.sessions()) == [("a", KvLocation.DEVICE), ("b", KvLocation.MISSING)]


def test_an_evicted_or_dropped_entry_is_never_reported_on_the_device():
    kv = manager(entries=1)
    owner = SessionResidency(kv, "m")
    put_session(kv, "a", 8)
    owner.record("a")
    put_session(kv, "b", 8)  # the one-entry cache evicts "a"
    owner.record("b")
    assert owner.where("a") is None and [r.session_id for r in owner.device()] == ["b"]
    assert kv.drop_session_entry("b") is True  # the residency planner releases it
    assert owner.where("b") is None and owner.device() == []  # read-side filter: before any new record
    assert kv.drop_session_entry("b") is True  # idempotent: the device holds none of it
    kv.check_integrity()


def test_manager_reads_session_entries_without_exposing_its_caches():
    kv = manager()
    put_session(kv, "a", 6)
    assert kv.session_tokens("a") == list(range(6)) and kv.session_tokens("x") is None
    assert [e.session_id for e in kv.session_entries()] == ["a"]
    assert kv.num_session_pages == 2 and kv.num_radix_pages == 0
    (p,) = kv.allocator.allocate(1)
    assert kv.is_page_used(p) and not kv.only_pinned(p)  # a sequence's reference, no pin
    kv.pin_pages([p])
    kv.allocator.decref([p])  # the sequence lets go: only the transfer pin holds it now
    assert kv.only_pinned(p)
    assert kv.unpin_pages([p]) == 1 and not kv.is_page_used(p)


def test_one_location_type_everywhere_converted_to_the_proto_enum_at_the_wire_edge():
    from services.engine.api import SessionInfo
    from services.engine.slots.types import CallView

    assert SessionInfo is Residency
    assert CallView("r", "m", 0.0, 4).prefix_state is KvLocation.MISSING
    assert wire.kv_state(KvLocation.DEVICE) == pb.KV_DEVICE
    assert wire.kv_state(KvLocation.HOST) == pb.KV_HOST
    assert wire.kv_state(KvLocation.MISSING) == pb.KV_MISSING
    assert manager().session_prefix("nobody", [1, 2, 3]) == (KvLocation.MISSING, 0)

