"""Client of one kvstore: gRPC control calls with deadlines, and the Mooncake byte moves they describe.

Used by the engine's host tier and by the benchmark. Every control call has a deadline
(``timeout_s``), so a dead or hung store costs at most that long and surfaces as
:class:`StoreUnavailable`; the caller decides what to do (the engine recomputes).

Byte moves: a checkpoint gathers pages into a registered local staging buffer and ``write_pages``
pushes them into the blocks a ``reserve`` returned; a restore ``read_pages`` pulls the blocks of a
pinned ``lookup`` into staging. Page ``j`` of a call lives at ``local_base + j * page_bytes``; adjacent
pages and adjacent slabs coalesce into one transfer.

Public API: this module is the kvstore's client surface, the only one another service may import
(``__all__``): the client, its error, the page copies, the Mooncake endpoint the caller registers its
staging buffers with, and the channel credentials of ``auth.py``. Everything else in ``services/kvstore``
is internal.

Tracing: every control call carries the caller's current OpenTelemetry context as W3C ``traceparent``
gRPC metadata (``otel.grpc_metadata()``), so the store's spans join the call's trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.kvstore.auth import call_metadata, channel_credentials
from talaria.kv_layout import Layout
from services.kvstore.transfer import Copy, MooncakeEndpoint, TransferError
from services.kvstore.wire import layout_to_pb
from talaria import otel
from talaria.v1 import kvstore_pb2 as pb
from talaria.v1 import kvstore_pb2_grpc as pbg


__all__ = ["KvStoreClient", "MooncakeEndpoint", "StoreUnavailable", "channel_credentials", "read_pages", "write_pages"]


R = TypeVar("R", bound=Message)  # the reply message of one RPC


class StoreUnavailable(RuntimeError):
    """The store did not answer (down, restarting, deadline passed) or a transfer to it failed."""


class KvStoreClient:
    def __init__(
        self, address: str, *, timeout_s: float = 2.0, max_message_mb: int = 4, auth_token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """``auth_token`` / ``credentials`` (TLS, ``auth.channel_credentials``): how this client proves it is
        an engine of the stack."""
        self.address = address
        self.timeout_s = timeout_s
        self._auth = call_metadata(auth_token)
        limit = max_message_mb * 1024 * 1024
        open_channel = grpc.insecure_channel if credentials is None else (lambda a, options: grpc.secure_channel(a, credentials, options=options))
        self._channel = open_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                # a restarted store is found again within about a second (gRPC's default backoff grows to 2 min)
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self._stub = pbg.KvStoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, fn: Callable[..., object], req: Message, reply: type[R]) -> R:
        """``fn(req)`` with the timeout and metadata every RPC carries; its ``reply`` message (errors mapped)."""
        try:
            r = fn(req, timeout=self.timeout_s, metadata=(otel.grpc_metadata() + self._auth) or None)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise StoreUnavailable(f"kvstore at {self.address} refused our credentials") from None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise ValueError(f"kvstore refused the request: {code.name}: {e.details()}") from None
            raise StoreUnavailable(f"kvstore at {self.address}: {code.name if code else e}") from None
        if not isinstance(r, reply):  # the generated stub is untyped: what it returned is checked here
            raise StoreUnavailable(f"kvstore at {self.address} answered {type(r).__name__}, not {reply.__name__}")
        return r

    # ---------------------------------------------------------------- control
    def healthy(self) -> bool:
        try:
            # (types-grpcio-health-checking declares HealthStub without its methods)
            r = self._health.Check(health_pb2.HealthCheckRequest(service="talaria.v1.KvStore"), timeout=self.timeout_s)  # type: ignore[attr-defined]
        except grpc.RpcError:
            return False
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    def reserve(self, layout: Layout, hashes: Sequence[int], lease_s: float = 0.0, owner: str = "") -> pb.ReserveReply:
        return self._call(self._stub.Reserve, pb.ReserveRequest(layout=layout_to_pb(layout), hashes=list(hashes), lease_s=lease_s, owner=owner), pb.ReserveReply)

    def commit(
        self, lease_id: int, block_ids: Sequence[int], abort: bool = False, checksums: Sequence[int] = (), checksum_algo: str = "",
    ) -> pb.CommitReply:
        """``checksums``: one per block id, recorded by the store and returned by lookups."""
        return self._call(self._stub.Commit, pb.CommitRequest(
            lease_id=lease_id, block_ids=list(block_ids), abort=abort, checksums=list(checksums), checksum_algo=checksum_algo,
        ), pb.CommitReply)

    def lookup(self, layout: Layout, hashes: Sequence[int], pin: bool = False, lease_s: float = 0.0) -> pb.LookupReply:
        return self._call(self._stub.Lookup, pb.LookupRequest(layout=layout_to_pb(layout), hashes=list(hashes), pin=pin, lease_s=lease_s), pb.LookupReply)

    def pin(self, block_ids: Sequence[int], lease_s: float = 0.0) -> pb.PinReply:
        return self._call(self._stub.Pin, pb.PinRequest(block_ids=list(block_ids), lease_s=lease_s), pb.PinReply)

    def unpin(self, lease_id: int, read_complete: bool = False) -> pb.UnpinReply:
        return self._call(self._stub.Unpin, pb.UnpinRequest(lease_id=lease_id, read_complete=read_complete), pb.UnpinReply)

    def release(
        self, model: str, tp_rank: int = 0, hashes: Sequence[int] = (), all_of_model: bool = False, leaves_only: bool = False,
    ) -> pb.ReleaseReply:
        """``leaves_only``: ``hashes`` is one chain; drop it from the end while nothing extends it."""
        return self._call(self._stub.Release, pb.ReleaseRequest(
            model=model, tp_rank=tp_rank, hashes=list(hashes), all_of_model=all_of_model, leaves_only=leaves_only,
        ), pb.ReleaseReply)

    def stats(self) -> pb.StatsReply:
        return self._call(self._stub.Stats, pb.StatsRequest(), pb.StatsReply)


def page_copies(blocks: Sequence[pb.Block], dp: pb.DataPlane, local_base: int, page_bytes: int) -> list[Copy]:
    """Copies between local page ``j`` (``local_base + j*page_bytes``) and the segments of ``blocks[j]``."""
    out: list[Copy] = []
    for j, b in enumerate(blocks):
        local = local_base + j * page_bytes
        for s in b.segments:
            out.append(Copy(local, dp.pool_base + s.offset, s.length))
            local += s.length
    return out


def write_pages(mc: MooncakeEndpoint, dp: pb.DataPlane, blocks: Sequence[pb.Block], local_base: int, page_bytes: int) -> int:
    try:
        return mc.write(dp.peer, page_copies(blocks, dp, local_base, page_bytes))
    except TransferError as e:
        raise StoreUnavailable(str(e)) from None


def read_pages(mc: MooncakeEndpoint, dp: pb.DataPlane, blocks: Sequence[pb.Block], local_base: int, page_bytes: int) -> int:
    try:
        return mc.read(dp.peer, page_copies(blocks, dp, local_base, page_bytes))
    except TransferError as e:
        raise StoreUnavailable(str(e)) from None
