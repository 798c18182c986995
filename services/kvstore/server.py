"""The kvstore process: gRPC control API over the registry, Mooncake-registered host pool, health.

Thin by design (decode, call the registry under one lock, encode): every policy lives in
``registry.py``. Requests the registry cannot take get gRPC status codes, never a crash:

=========================  =========================================================================
INVALID_ARGUMENT           a layout descriptor that is inconsistent (dtype, slab shape vs page bytes,
                           rank outside tp_size, unknown family), or a request without a layout
RESOURCE_EXHAUSTED         more hashes/block ids than ``max_request_pages``, or a message larger than
                           ``max_message_mb`` (enforced by gRPC itself)
INTERNAL                   an undecodable message (gRPC's own deserialization failure)
=========================  =========================================================================

Auth (``auth.py``): with ``auth_token`` every control RPC needs ``authorization: Bearer <token>``
metadata (else UNAUTHENTICATED); with ``tls_*`` files the port is TLS, mutual when a CA is given.

Telemetry: ``Stats`` answers occupancy, hits, misses, restores, capacity misses, evictions and bytes
moved; the same numbers are logged every ``stats_log_s`` and, when the process has a NATS connection
(``NATS_URL`` / ``nats.url``), published every ``STATS_PUBLISH_S`` as a ``KvStoreStatsRecord`` on
``<ns>.kvstore.<store>.stats`` for the telemetry service. A background thread expires leases.

Traces: every control RPC but ``Stats`` is a span ``talaria.kvstore.<rpc>`` (kind SERVER) whose parent is the
W3C trace context the engine sent as gRPC metadata (``otel.grpc_metadata()`` in ``client.py``), so a call's
trace holds the store's reserve / commit / lookup / unpin work; attributes name the model key, pages, bytes
and hits / misses.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind

from services.kvstore.auth import server_credentials, server_interceptors
from services.kvstore.registry import POLICIES, HostKVRegistry, LayoutError
from services.kvstore.transfer import HostBuffer, MooncakeEndpoint
from services.kvstore.wire import WireError, block_to_pb, layout_from_pb
from talaria import otel
from talaria.config import KvStoreConfig
from talaria.v1 import kvstore_pb2 as pb
from talaria.v1 import kvstore_pb2_grpc as pbg

log = logging.getLogger(__name__)

POPULATE_CHUNK = 64 << 20  # bytes of the host pool faulted in per step of the populating thread (the first at start)

SERVICE_NAME = "talaria.v1.KvStore"
STATS_PUBLISH_S = 1.0  # period of the KvStoreStatsRecord on NATS

# span attributes (``talaria.kvstore.*``)
KV_MODEL = "talaria.kvstore.model"  # model key: <model>@<weights revision>
KV_TP_RANK = "talaria.kvstore.tp_rank"
KV_PAGES = "talaria.kvstore.pages"  # pages named by the request
KV_BYTES = "talaria.kvstore.bytes"  # bytes the RPC reserved / committed / made restorable / read
KV_HIT_PAGES = "talaria.kvstore.hit_pages"
KV_MISS_PAGES = "talaria.kvstore.miss_pages"
KV_HIT = "talaria.kvstore.hit"
KV_LEASE = "talaria.kvstore.lease_id"
KV_STORE = "talaria.kvstore.store_id"



def _gap_note(policy: object) -> str:
    """", re-access gap p50/p90 X/Y s (N seen)" for a policy that learns the gaps (``ValuePerByte``), else ""."""
    gaps = getattr(policy, "gaps", None)
    if gaps is None or not gaps.ready:
        return ""
    return f", re-access gap p50/p90 {gaps.quantile(0.5):.1f}/{gaps.quantile(0.9):.1f} s ({gaps.samples} seen)"

class KvStoreServicer(pbg.KvStoreServicer):
    def __init__(
        self, registry: HostKVRegistry, data_plane: pb.DataPlane, *, max_pages: int, epoch: int,
        telemetry: otel.Telemetry | None = None, store_id: str = "",
    ) -> None:
        self.registry = registry
        self.data_plane = data_plane
        self.max_pages = max_pages
        self.epoch = epoch
        self.lock = threading.Lock()
        self.telemetry = telemetry if telemetry is not None else otel.disabled("talaria-kvstore")
        self.store_id = store_id

    def _span(self, rpc: str, ctx, **attrs):
        """The span of one RPC, child of the caller's trace context (gRPC metadata) when it sent one."""
        try:
            parent = otel.extract(dict(ctx.invocation_metadata() or ()))
        except Exception:  # noqa: BLE001 - a malformed header never fails the RPC
            parent = None
        if self.store_id:
            attrs[KV_STORE] = self.store_id
        return self.telemetry.tracer.start_as_current_span(f"talaria.kvstore.{rpc}", context=parent, kind=SpanKind.SERVER, attributes=attrs)

    # ---------------------------------------------------------------- helpers
    def _layout(self, req, ctx):
        if not req.HasField("layout"):
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "layout is required")
        try:
            return layout_from_pb(req.layout)
        except WireError as e:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _limit(self, n: int, what: str, ctx) -> None:
        if n > self.max_pages:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{n} {what} exceed the limit of {self.max_pages} per request")

    def _lease(self, s: float, ctx) -> float:
        if s < 0 or s != s:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lease_s must be >= 0, got {s}")
        return s

    # ---------------------------------------------------------------- RPCs
    def Reserve(self, req: pb.ReserveRequest, ctx) -> pb.ReserveReply:
        with self._span("reserve", ctx, **{KV_PAGES: len(req.hashes)}) as span:
            layout = self._layout(req, ctx)
            span.set_attribute(KV_MODEL, layout.model)
            span.set_attribute(KV_TP_RANK, layout.tp_rank)
            self._limit(len(req.hashes), "hashes", ctx)
            lease_s = self._lease(req.lease_s, ctx)
            try:
                with self.lock:
                    res = self.registry.reserve(layout, list(req.hashes), lease_s)
            except LayoutError as e:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            span.set_attributes({
                "talaria.kvstore.reserved_pages": len(res.blocks), KV_BYTES: len(res.blocks) * layout.page_bytes,
                "talaria.kvstore.present_pages": res.present_pages, "talaria.kvstore.capacity_miss_pages": res.capacity_miss_pages,
                KV_LEASE: res.lease_id,
            })
        return pb.ReserveReply(
            epoch=self.epoch, lease_id=res.lease_id, blocks=[block_to_pb(b) for b in res.blocks],
            present_pages=res.present_pages, capacity_miss_pages=res.capacity_miss_pages, data_plane=self.data_plane,
        )

    def Commit(self, req: pb.CommitRequest, ctx) -> pb.CommitReply:
        with self._span("commit", ctx, **{KV_PAGES: len(req.block_ids), KV_LEASE: req.lease_id, "talaria.kvstore.abort": req.abort}) as span:
            self._limit(len(req.block_ids), "block ids", ctx)
            if req.checksums and len(req.checksums) != len(req.block_ids):
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(req.checksums)} checksums for {len(req.block_ids)} block ids")
            with self.lock:
                before = self.registry.counters.bytes_in
                committed, aborted = self.registry.commit(
                    req.lease_id, list(req.block_ids), abort=req.abort, checksums=list(req.checksums), checksum_algo=req.checksum_algo,
                )
                moved = self.registry.counters.bytes_in - before
            span.set_attributes({"talaria.kvstore.committed_pages": committed, "talaria.kvstore.aborted_pages": aborted, KV_BYTES: moved})
        return pb.CommitReply(epoch=self.epoch, committed=committed, aborted=aborted)

    def Lookup(self, req: pb.LookupRequest, ctx) -> pb.LookupReply:
        with self._span("lookup", ctx, **{KV_PAGES: len(req.hashes), "talaria.kvstore.pin": req.pin}) as span:
            layout = self._layout(req, ctx)
            span.set_attribute(KV_MODEL, layout.model)
            span.set_attribute(KV_TP_RANK, layout.tp_rank)
            self._limit(len(req.hashes), "hashes", ctx)
            lease_s = self._lease(req.lease_s, ctx)
            try:
                with self.lock:
                    res = self.registry.lookup(layout, list(req.hashes), pin=req.pin, lease_s=lease_s)
            except LayoutError as e:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            span.set_attributes({
                KV_HIT_PAGES: res.pages, KV_MISS_PAGES: len(req.hashes) - res.pages, KV_HIT: res.pages > 0,
                KV_BYTES: res.pages * layout.page_bytes, KV_LEASE: res.lease_id, **({"talaria.kvstore.note": res.note} if res.note else {}),
            })
        return pb.LookupReply(
            epoch=self.epoch, pages=res.pages, blocks=[block_to_pb(b) for b in res.blocks], lease_id=res.lease_id,
            data_plane=self.data_plane, note=res.note,
        )

    def Pin(self, req: pb.PinRequest, ctx) -> pb.PinReply:
        with self._span("pin", ctx, **{KV_PAGES: len(req.block_ids)}) as span:
            self._limit(len(req.block_ids), "block ids", ctx)
            lease_s = self._lease(req.lease_s, ctx)
            with self.lock:
                lease_id, n = self.registry.pin(list(req.block_ids), lease_s)
            span.set_attributes({KV_LEASE: lease_id, "talaria.kvstore.pinned_pages": n})
        return pb.PinReply(epoch=self.epoch, lease_id=lease_id, pinned=n)

    def Unpin(self, req: pb.UnpinRequest, ctx) -> pb.UnpinReply:
        with self._span("unpin", ctx, **{KV_LEASE: req.lease_id, "talaria.kvstore.read_complete": req.read_complete}) as span:
            with self.lock:
                before = self.registry.counters.bytes_out
                n = self.registry.unpin(req.lease_id, read_complete=req.read_complete)
                moved = self.registry.counters.bytes_out - before
            span.set_attributes({"talaria.kvstore.unpinned_pages": n, KV_BYTES: moved})
        return pb.UnpinReply(epoch=self.epoch, unpinned=n)

    def Release(self, req: pb.ReleaseRequest, ctx) -> pb.ReleaseReply:
        with self._span("release", ctx, **{KV_MODEL: req.model, KV_TP_RANK: req.tp_rank, KV_PAGES: len(req.hashes)}) as span:
            self._limit(len(req.hashes), "hashes", ctx)
            if not req.model:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required")
            if not req.hashes and not req.all_of_model:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "name hashes or set all_of_model")
            if req.leaves_only and req.all_of_model:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "leaves_only names one chain: not with all_of_model")
            with self.lock:
                if req.leaves_only:  # a session ended; shared prefixes stay
                    n = self.registry.release_leaves(req.model, req.tp_rank, list(req.hashes))
                else:
                    n = self.registry.release(req.model, req.tp_rank, list(req.hashes), req.all_of_model)
            span.set_attribute("talaria.kvstore.released_pages", n)
        return pb.ReleaseReply(epoch=self.epoch, released=n)

    def Stats(self, req: pb.StatsRequest, ctx) -> pb.StatsReply:
        return self.stats()

    def stats(self) -> pb.StatsReply:
        r = self.registry
        with self.lock:
            c = r.counters
            return pb.StatsReply(
                epoch=self.epoch, data_plane=self.data_plane, capacity_bytes=r.capacity_bytes, slab_bytes=r.slab_bytes,
                slabs_total=r.num_slabs, slabs_free=r.slabs_free, used_bytes=r.used_bytes, entries=r.num_entries,
                reserved=r.num_reserved, pinned=r.num_pinned, lookups=c.lookups, hit_pages=c.hit_pages,
                miss_pages=c.miss_pages, restores=c.restores, capacity_miss_pages=c.capacity_miss_pages,
                evictions=c.evictions, bytes_in=c.bytes_in, bytes_out=c.bytes_out, stale_lookups=c.stale_lookups,
                expired_leases=c.expired_leases, eviction_policy=getattr(r.policy, "name", type(r.policy).__name__),
                occupancy=r.used_bytes / r.capacity_bytes,
            )


class KvStoreServer:
    """Pool + Mooncake endpoint + registry + gRPC server. ``start()`` returns the bound gRPC port."""

    def __init__(
        self, cfg: KvStoreConfig, *, clock=time.monotonic, workers: int = 8, telemetry: otel.Telemetry | None = None,
        store_id: str = "",
    ) -> None:
        self.cfg = cfg
        self.store_id = store_id
        self.epoch = time.time_ns()
        capacity = cfg.capacity_mb * 1024 * 1024
        self.pool = HostBuffer(capacity)
        # faulted in ahead of use, not by the serving path (HostBuffer): the head now, the rest by a thread from
        # low addresses up -- the registry hands out the lowest free slabs first -- so a large pool does not
        # delay the store's start
        self.pool.populate(0, POPULATE_CHUNK)  # nothing uses the pool yet: the zero-writing fallback is safe here
        self.mooncake = MooncakeEndpoint(cfg.data_host, cfg.protocol)
        self.mooncake.register(self.pool.address, capacity)
        self.registry = HostKVRegistry(
            capacity, cfg.slab_kb * 1024, clock=clock, policy=POLICIES[cfg.eviction](), default_lease_s=cfg.lease_s,
        )
        dp = pb.DataPlane(transport="mooncake", protocol=cfg.protocol, peer=self.mooncake.name, pool_base=self.pool.address, pool_bytes=capacity)
        self.servicer = KvStoreServicer(
            self.registry, dp, max_pages=cfg.max_request_pages, epoch=self.epoch, telemetry=telemetry, store_id=store_id,
        )
        limit = cfg.max_message_mb * 1024 * 1024
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-rpc"),
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
            interceptors=server_interceptors(cfg),  # only authenticated engines (services/kvstore/auth.py)
        )
        pbg.add_KvStoreServicer_to_server(self.servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._populated = threading.Event()
        threading.Thread(target=self._populate_rest, name="kvstore-populate", daemon=True).start()

    def _populate_rest(self) -> None:
        """Fault the pool in past its head, a chunk at a time (the thread ``__init__`` starts). Mutates: the
        process's resident memory; sets ``_populated`` when done."""
        t0 = time.monotonic()
        for start in range(POPULATE_CHUNK, self.pool.nbytes, POPULATE_CHUNK):
            if self._stop.is_set():
                return
            # the store may already be writing there: never the zero-writing fallback
            if not self.pool.populate(start, start + POPULATE_CHUNK, may_write=False):
                log.info("kvstore pool: the kernel cannot fault memory in without writing it (MADV_POPULATE_WRITE, "
                         "Linux 5.14); past the first %d MiB the pool is faulted in by its first checkpoints", POPULATE_CHUNK >> 20)
                return
        log.info("kvstore pool: %d MiB resident after %.2f s (transparent huge pages advised: %s)", self.cfg.capacity_mb,
                 time.monotonic() - t0, "yes" if self.pool.huge_pages else "no")
        self._populated.set()

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Whether the whole pool is resident (waits up to ``timeout`` seconds for the populating thread; False
        also where the kernel cannot populate without writing)."""
        return self._populated.wait(timeout)

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    def start(self) -> int:
        creds = server_credentials(self.cfg)
        bind = f"{self.cfg.host}:{self.cfg.port}"
        self.port = self.server.add_secure_port(bind, creds) if creds is not None else self.server.add_insecure_port(bind)
        if not self.port:
            raise RuntimeError(f"kvstore cannot bind {self.cfg.host}:{self.cfg.port}")
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._threads = [threading.Thread(target=self._housekeeping, name="kvstore-expire", daemon=True)]
        for t in self._threads:
            t.start()
        return self.port

    def stats_record(self) -> pb.KvStoreStatsRecord:
        """The periodic telemetry record (published on ``<ns>.kvstore.<store>.stats`` by ``main.py``)."""
        return pb.KvStoreStatsRecord(
            schema_version=1, store_id=self.store_id, address=self.address, unix=time.time(), stats=self.servicer.stats(),
        )

    def _housekeeping(self) -> None:
        last_log, last_counters = time.monotonic(), None
        while not self._stop.wait(1.0):
            with self.servicer.lock:
                self.registry.expire()
                counters = repr(self.registry.counters)
            if self.cfg.stats_log_s and time.monotonic() - last_log >= self.cfg.stats_log_s and counters != last_counters:
                last_log, last_counters = time.monotonic(), counters
                s = self.servicer.stats()
                log.info(
                    "occupancy %.1f%% (%d entries), hits %d / misses %d pages, restores %d, capacity misses %d, "
                    "evictions %d, in %.1f MiB, out %.1f MiB%s", 100 * s.occupancy, s.entries, s.hit_pages,
                    s.miss_pages, s.restores, s.capacity_miss_pages, s.evictions, s.bytes_in / 2**20, s.bytes_out / 2**20,
                    _gap_note(self.registry.policy),
                )

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.mooncake.close()
