"""kvstore gRPC service in-process: real gRPC server, real Mooncake TCP transfers, health, error codes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.kvstore.client import KvStoreClient, StoreUnavailable, read_pages, write_pages
from services.kvstore.registry import Family, Layout
from services.kvstore.server import KvStoreServer
from services.kvstore.transfer import HostBuffer, MooncakeEndpoint
from services.kvstore.wire import layout_to_pb
from talaria.config import KvStoreConfig
from talaria.v1 import kvstore_pb2 as pb
from talaria.v1 import kvstore_pb2_grpc as pbg

PAGE_BYTES = 2 * 2 * 16 * 2 * 8 * 4


def layout(rank=0, tp=1, model="m@1") -> Layout:
    return Layout(model, rank, tp, 16, "float32", Family.MHA, (2, 2, 16, 2, 8), PAGE_BYTES)


@pytest.fixture(scope="module")
def server():
    srv = KvStoreServer(KvStoreConfig(capacity_mb=4, slab_kb=2, max_request_pages=1000, max_message_mb=1))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = KvStoreClient(server.address)
    yield c
    c.close()


@pytest.fixture(scope="module")
def mooncake():
    mc = MooncakeEndpoint()
    buf = HostBuffer(1 << 20)
    mc.register(buf.address, buf.nbytes)
    yield mc, buf
    mc.close()


@pytest.fixture(scope="module")
def stub(server):
    ch = grpc.insecure_channel(server.address)
    yield pbg.KvStoreStub(ch)
    ch.close()


def test_health_service_reports_serving(server):
    with grpc.insecure_channel(server.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "talaria.v1.KvStore"):
            assert h.Check(health_pb2.HealthCheckRequest(service=name), timeout=2).status == health_pb2.HealthCheckResponse.SERVING


def test_checkpoint_and_restore_bytes_over_mooncake(client, mooncake):
    mc, buf = mooncake
    rng = np.random.default_rng(0)
    n = 5
    buf.array[: n * PAGE_BYTES] = rng.integers(0, 256, n * PAGE_BYTES, dtype=np.uint8)
    want = buf.array[: n * PAGE_BYTES].copy()
    lay = layout(model="bytes@1")
    r = client.reserve(lay, range(100, 100 + n))
    assert r.data_plane.transport == "mooncake" and r.data_plane.protocol == "tcp" and len(r.blocks) == n
    assert write_pages(mc, r.data_plane, r.blocks, buf.address, PAGE_BYTES) == n * PAGE_BYTES
    assert client.lookup(lay, range(100, 100 + n)).pages == 0  # not committed: invisible
    assert client.commit(r.lease_id, [b.block_id for b in r.blocks]).committed == n
    buf.array[: n * PAGE_BYTES] = 0
    got = client.lookup(lay, range(100, 100 + n), pin=True)
    assert got.pages == n and got.lease_id
    assert read_pages(mc, got.data_plane, got.blocks, buf.address, PAGE_BYTES) == n * PAGE_BYTES
    assert client.unpin(got.lease_id, read_complete=True).unpinned == n
    assert np.array_equal(buf.array[: n * PAGE_BYTES], want)
    s = client.stats()
    assert s.restores >= 1 and s.bytes_out >= n * PAGE_BYTES and s.bytes_in >= n * PAGE_BYTES and s.occupancy > 0


def test_tp_agreement_over_grpc(client):
    l0, l1 = layout(0, 2, "tp@1"), layout(1, 2, "tp@1")
    for lay, chain in ((l0, [1, 2, 3]), (l1, [1, 2, 4])):
        r = client.reserve(lay, chain)
        client.commit(r.lease_id, [b.block_id for b in r.blocks])
    got = client.lookup(l0, [1, 2, 3])
    assert got.pages == 2 and got.note == "tp_disagreement"


def _code(fn, req) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        fn(req, timeout=5)
    return ei.value.code()


def test_malformed_requests_get_invalid_argument(stub, client):
    good = layout_to_pb(layout())
    assert _code(stub.Reserve, pb.ReserveRequest(hashes=[1])) == grpc.StatusCode.INVALID_ARGUMENT  # no layout
    bad_bytes = pb.KvLayout(); bad_bytes.CopyFrom(good); bad_bytes.page_bytes = 12345
    assert _code(stub.Reserve, pb.ReserveRequest(layout=bad_bytes, hashes=[1])) == grpc.StatusCode.INVALID_ARGUMENT
    bad_rank = pb.KvLayout(); bad_rank.CopyFrom(good); bad_rank.tp_rank = 3
    assert _code(stub.Lookup, pb.LookupRequest(layout=bad_rank, hashes=[1])) == grpc.StatusCode.INVALID_ARGUMENT
    bad_family = pb.KvLayout(); bad_family.CopyFrom(good); bad_family.family = 0
    assert _code(stub.Lookup, pb.LookupRequest(layout=bad_family, hashes=[1])) == grpc.StatusCode.INVALID_ARGUMENT
    bad_dtype = pb.KvLayout(); bad_dtype.CopyFrom(good); bad_dtype.dtype = "complex1024"
    assert _code(stub.Reserve, pb.ReserveRequest(layout=bad_dtype, hashes=[1])) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(stub.Lookup, pb.LookupRequest(layout=good, hashes=[1], lease_s=-1)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(stub.Release, pb.ReleaseRequest(model="m@1")) == grpc.StatusCode.INVALID_ARGUMENT
    # unknown lease / block ids are no error: nothing happens
    assert stub.Commit(pb.CommitRequest(lease_id=999999, block_ids=[1]), timeout=5).committed == 0
    assert stub.Unpin(pb.UnpinRequest(lease_id=999999), timeout=5).unpinned == 0
    with pytest.raises(ValueError):  # the client turns refusals into ValueError, not "unavailable"
        client.reserve(Layout("m@1", 0, 1, 16, "float32", Family.MHA, (3,), 13), [1])
    assert client.healthy()


def test_undecodable_and_oversized_messages_get_error_codes(server, stub):
    with grpc.insecure_channel(server.address) as ch:
        raw = ch.unary_unary("/talaria.v1.KvStore/Lookup", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as ei:
            raw(b"\xff\xff\xff\xff garbage", timeout=5)
        assert ei.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        with pytest.raises(grpc.RpcError) as ei:
            raw(b"\x00" * (2 * 1024 * 1024), timeout=5)  # over max_message_mb=1
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    too_many = pb.LookupRequest(layout=layout_to_pb(layout()), hashes=list(range(1001)))
    assert _code(stub.Lookup, too_many) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Stats(pb.StatsRequest(), timeout=5).slabs_total > 0  # still serving


def test_dead_store_is_unavailable_quickly():
    c = KvStoreClient("127.0.0.1:1", timeout_s=0.5)
    assert not c.healthy()
    with pytest.raises(StoreUnavailable):
        c.lookup(layout(), [1])
    c.close()
