"""Router process: NATS subscriptions (heartbeats, completion hooks) feeding the placement gateway
(registry, session table, EWMA books), the lease store (JetStream KV bucket shared by router replicas, with
a watcher mirroring it locally), and the HTTP server. ``run_router`` returns when ``stop`` is set (SIGTERM/SIGINT in ``__main__``),
after the HTTP server has stopped accepting and in-flight responses have finished (graceful drain).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import uvicorn
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from services.router.app import create_app
from services.router.engine_client import InboxMux
from services.router.gateway import Gateway, PoolSpec
from services.router.lease_service import LeaseService
from services.router.leases import JetStreamLeases, LeaseTable, MemoryLeases
from services.router.resume import Resumes
from services.router.responses_store import JetStreamResponses, MemoryResponses
from services.router.policy import PolicyParams
from services.router.profiles import Defaults, DemandMeter, ProfileBook, ShapeBook
from services.router.registry import Registry
from services.router.return_gap import GapParams, GapPredictor
from services.router.sessions import SessionTable
from talaria.clock import MonotonicClock
from talaria.config import StackConfig
from talaria import gctune, otel
from talaria.natsutil import close_connection, connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from talaria.vllm_metrics import ServingMetrics

log = logging.getLogger(__name__)


@dataclass
class RouterState:
    cfg: StackConfig
    subjects: Subjects
    registry: Registry
    sessions: SessionTable
    gateway: Gateway
    leases: LeaseService  # lease settlement, sizing, installation; resume tokens (owns the lease store)
    responses: MemoryResponses | JetStreamResponses | None = None  # stored Responses (None = off)
    nc: NATS | None = None
    counters: Counter = field(default_factory=Counter)
    telemetry: otel.Telemetry = field(default_factory=otel.disabled)  # spans of every call
    serving_metrics: ServingMetrics = field(default_factory=ServingMetrics)  # vLLM-named /metrics
    _bg: set = field(default_factory=set)  # fire-and-forget publish tasks
    _mux: InboxMux | None = None

    @property
    def lease_store(self) -> MemoryLeases | JetStreamLeases:
        """The lease store the lease service settles in (``MemoryLeases``, or ``JetStreamLeases`` after start)."""
        return self.leases.store

    @lease_store.setter
    def lease_store(self, store: MemoryLeases | JetStreamLeases) -> None:
        self.leases.store = store

    def tracer(self):
        return self.telemetry.tracer

    def inbox_mux(self) -> InboxMux:
        """The reply-inbox mux on the current NATS connection (made on first use; a new connection object,
        as tests make, gets a new one). Mutates ``_mux``."""
        assert self.nc is not None
        if self._mux is None or self._mux.nc is not self.nc:
            self._mux = InboxMux(self.nc, self.subjects.inbox_prefix(self.cfg.router.id))
        return self._mux

    def publish_call(self, rec) -> None:
        """Send a CallRecord to the telemetry service without waiting for it. A record that cannot be sent (no
        NATS connection now, or the publish failed) is dropped and counted (``call_record_dropped`` /
        ``call_record_failed`` in ``/health``'s counters): telemetry is best effort, but a gap in it is visible.
        Mutates ``counters``."""
        nc = self.nc
        if nc is None or not nc.is_connected:
            self.counters["call_record_dropped"] += 1
            return
        subject, data = self.subjects.router_calls(self.cfg.router.id), rec.SerializeToString()

        async def send() -> None:
            try:
                await nc.publish(subject, data)
            except Exception:  # noqa: BLE001 - telemetry is best effort
                self.counters["call_record_failed"] += 1

        task = asyncio.get_running_loop().create_task(send())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def on_heartbeat(self, data: bytes) -> None:
        snap = pb.InstanceSnapshot()
        try:
            snap.ParseFromString(data)
        except Exception:  # noqa: BLE001 - one bad message must not stop the subscription
            self.counters["bad_heartbeat"] += 1
            return
        self.gateway.on_snapshot(snap)
        self.serving_metrics.observe_snapshot(snap)

    async def on_completed(self, data: bytes) -> None:
        hook = pb.CompletionHook()
        try:
            hook.ParseFromString(data)
        except Exception:  # noqa: BLE001
            self.counters["bad_hook"] += 1
            return
        self.counters["hooks"] += 1
        self.serving_metrics.observe_hook(hook)
        if hook.session_ended and hook.session_id:  # every replica drops the leases (idempotent)
            await self.lease_store.drop_session(hook.session_id, [hook.model])
        lease = self.leases.on_hook(hook)
        if lease is not None:
            try:
                await self.lease_store.install(lease, lease.t_exp_unix - lease.t_done_unix)
            except Exception as e:  # noqa: BLE001 - a lost lease costs affinity, never correctness
                self.counters["lease_install_failed"] += 1
                log.warning("lease for session %s not installed: %s", hook.session_id, e)
        if self.gateway.adaptive and hook.session_id and not hook.HasField("error") and hook.prefix.committed_tokens > 0:
            self.send_retention(hook.instance_id, hook.session_id, hook.model, hook.request_id, hook.finish_unix, lease)
        tool = hook.tool_names[0] if hook.tool_names else ""
        self.prefetch(hook.session_id, hook.model, tool, hook.prefix.committed_tokens)

    async def on_intent(self, data: bytes) -> None:
        """A ``ToolIntent``: install the session's lease early, prefetch its next model."""
        intent = pb.ToolIntent()
        try:
            intent.ParseFromString(data)
        except Exception:  # noqa: BLE001
            self.counters["bad_intent"] += 1
            return
        lease = self.leases.on_intent(intent)
        if lease is not None:
            try:
                await self.lease_store.install(lease, lease.t_exp_unix - lease.t_done_unix)
            except Exception:  # noqa: BLE001 - the hook's lease follows anyway
                self.counters["lease_install_failed"] += 1
        self.prefetch(intent.session_id, intent.model, intent.tool_name, intent.prompt_tokens + intent.generated_tokens)

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def send_retention(self, instance_id: str, session_id: str, model: str, lease_id: str, done: float, lease) -> None:
        """Tell the engine holding the session's KV how long the session is expected away (``RetentionHint``;
        window 0 = no lease: the KV may leave the device first). Fire and forget."""
        nc = self.nc
        if nc is None or not nc.is_connected:
            return
        h = pb.RetentionHint(schema_version=1, session_id=session_id, model=model, lease_id=lease_id, t_done_unix=done)
        if lease is not None:
            (h.gap_mu, h.gap_sigma), h.window_s, h.t_done_unix = self.leases.retention_gap(lease), lease.t_exp_unix - lease.t_done_unix, lease.t_done_unix
        subject, payload = self.subjects.retention(instance_id), h.SerializeToString()

        async def send() -> None:
            try:
                await nc.publish(subject, payload)
            except Exception:  # noqa: BLE001 - a lost hint costs retention order, never correctness
                self.counters["retention_hint_failed"] += 1

        self._background(send())

    def prefetch(self, session_id: str, model: str, tool: str, prompt_tokens: int) -> None:
        """Intent prefetch: ask the instance predicted to serve the session's next call (on another model) to
        open / switch to that model now (``CONTROL_OPEN_MODEL``). Fire and forget."""
        nc = self.nc
        if not (self.cfg.router.placement.intent_prefetch and session_id) or nc is None or not nc.is_connected:
            return
        target = self.leases.prefetch_target(session_id, model, tool, prompt_tokens)
        if target is None:
            return
        iid, nxt = target
        req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_OPEN_MODEL, model=nxt)

        async def send() -> None:
            try:
                await nc.request(self.subjects.control(iid), req.SerializeToString(), timeout=5.0)
                self.counters["prefetch_sent"] += 1
            except Exception:  # noqa: BLE001
                self.counters["prefetch_failed"] += 1

        self._background(send())


async def probe_gone(state: RouterState, instance_id: str, timeout: float) -> bool:
    """Ask NATS whether anyone still listens on the instance's cancel subject (a request the engine never
    answers: an empty CancelRequest is a no-op there). No responders: the process is gone; mutates the
    registry (``mark_gone``). A timeout means it is there but slow. Returns True when gone."""
    nc = state.nc
    if nc is None or not nc.is_connected:
        return False
    try:
        await nc.request(state.subjects.cancel(instance_id), b"", timeout=timeout)
    except NoRespondersError:
        state.registry.mark_gone(instance_id, "NATS: no responders on its subjects (process gone)")
        return True
    except Exception:  # noqa: BLE001 - timeout (alive but silent) or a NATS hiccup: decide nothing
        return False
    return False


async def watch_health(state: RouterState, every_s: float = 0.25) -> None:
    """Log every instance state change (ok / suspect / dead / draining, with the reason) and probe silent
    instances so a gone process is declared dead at once, while a slow one stays merely suspect."""
    probing: dict[str, asyncio.Task] = {}
    timeout = max(0.2, min(1.0, state.cfg.router.heartbeat_miss_limit_s / 2))
    while True:
        for iid, old, new, why in state.registry.sweep():
            state.counters[f"instance_{new}"] += 1
            level = logging.INFO if new in ("ok", "draining") or old == "new" else logging.WARNING
            log.log(level, "instance %s: %s -> %s (%s)", iid, old, new, why)
        for iid in state.registry.silent():
            t = probing.get(iid)
            if t is None or t.done():
                probing[iid] = asyncio.create_task(probe_gone(state, iid, timeout))
        await asyncio.sleep(every_s)


def on_nats_state(state: RouterState, what: str) -> None:
    """NATS connection callback: on a disconnect, every call in flight ends with ``engine_unavailable`` (its chunks may be lost, and nothing would ever end it otherwise but ``idle_chunk_timeout_s``); after a
    reconnect, rebuild the lease mirror from the shared bucket at once instead of waiting for
    the old watcher to catch up. Mutates counters and the in-flight calls' queues."""
    state.counters[f"nats_{what}"] += 1
    if what == "disconnected" and state._mux is not None:
        # the server forgot every reply inbox's subscription; chunks sent until the reconnect are
        # gone and no engine sends them again, so each call in flight ends now with a clean 503 (the engine
        # stops its work on the router's cancel, delivered at the reconnect, or its next requester probe)
        lost = state._mux.bus_lost()
        if lost:
            state.counters["calls_bus_lost"] += lost
            log.warning("NATS connection lost: %d call(s) in flight end with engine_unavailable", lost)
    if what != "reconnected":
        return

    async def resync() -> None:
        try:
            ok = await state.lease_store.resync()
        except Exception as e:  # noqa: BLE001 - the watcher keeps mirroring; a failed resync only costs lag
            ok = False
            log.warning("lease mirror resync failed: %s", e)
        state.counters["lease_resync" if ok else "lease_resync_failed"] += 1
        log.info("lease mirror resynced after a NATS reconnect: %s (%d leases known)", "ok" if ok else "incomplete", len(state.gateway.leases))

    task = asyncio.get_running_loop().create_task(resync())
    state._bg.add(task)
    task.add_done_callback(state._bg.discard)


def policy_params(cfg: StackConfig) -> PolicyParams:
    return PolicyParams.from_config(cfg.router.placement)


def make_state(cfg: StackConfig) -> RouterState:
    clock = MonotonicClock()
    pc = cfg.router.placement
    rc = cfg.router
    registry = Registry(clock, miss_limit=rc.heartbeat_miss_limit, stale_after=pc.stale_after_periods, wall=time.time,
                        miss_limit_s=rc.heartbeat_miss_limit_s, dead_after_s=rc.engine_dead_after_s)
    sessions = SessionTable(clock)
    table = LeaseTable()
    defaults = Defaults.from_config(pc)
    gateway = Gateway(
        policy_params(cfg),
        registry,
        sessions,
        table,
        time.time,
        profiles=ProfileBook(defaults, pc.ewma_alpha),
        shapes=ShapeBook(pc.ewma_alpha),
        demand=DemandMeter(pc.ewma_alpha),
        tau_s=pc.lease_ttl_s,
        pools={e.id: PoolSpec(e.pool, tuple(e.models), e.page_size, e.max_num_seqs) for e in cfg.engines},
        router_id=cfg.router.id,
        decisions_kept=pc.decisions_kept,
    )
    counters: Counter = Counter()
    leases = LeaseService(
        gateway,
        MemoryLeases(table),
        Resumes.from_config(cfg.router.auth.resume_secret, gateway.wall, counters),  # signed resume tokens + fencing
        GapPredictor(GapParams(prior_median_s=pc.gap_prior_median_s, prior_sigma=pc.gap_prior_sigma, quantile=pc.gap_quantile, cap_s=pc.gap_cap_s)),
    )
    return RouterState(
        cfg=cfg,
        subjects=Subjects(cfg.namespace),
        registry=registry,
        sessions=sessions,
        gateway=gateway,
        leases=leases,
        responses=memory_responses(cfg),
        counters=counters,
    )


def memory_responses(cfg: StackConfig) -> MemoryResponses | None:
    """The process-local response store (the jetstream one replaces it at start when configured), or None (off)."""
    rc = cfg.router.responses
    return None if rc.store == "off" else MemoryResponses(rc.ttl_s, rc.max_entries, rc.max_response_bytes)


async def run_router(cfg: StackConfig, stop: asyncio.Event, ready: asyncio.Future | None = None) -> None:
    url = cfg.nats_url()
    if not url:
        raise RuntimeError("router needs a NATS server: set nats.url in the config or NATS_URL")
    state = make_state(cfg)
    state.telemetry = otel.setup("talaria-router", cfg.router.id, cfg.telemetry, cfg.namespace)
    state.nc = await connect(url, f"router-{cfg.router.id}", cfg.nats, on_state=lambda s: on_nats_state(state, s))
    async def on_heartbeat(msg) -> None:
        state.on_heartbeat(msg.data)

    async def on_completed(msg) -> None:
        await state.on_completed(msg.data)

    async def on_intent(msg) -> None:
        await state.on_intent(msg.data)

    if cfg.router.placement.lease_store == "jetstream" and state.gateway.leases_enabled:
        store = JetStreamLeases(state.nc, state.subjects.lease_bucket(), state.gateway.leases, cfg.router.placement.lease_ttl_s)
        try:
            await store.start()
            state.lease_store = store
            log.info("leases in JetStream bucket %s (tau %.2fs)", state.subjects.lease_bucket(), store.ttl_s)
        except Exception as e:  # noqa: BLE001 - no JetStream: leases stay local to this replica
            log.warning("JetStream lease bucket unavailable (%s); leases are local to this router", e)

    rc = cfg.router.responses
    if rc.store == "jetstream":
        rstore = JetStreamResponses(state.nc, state.subjects.responses_bucket(), rc.ttl_s, rc.max_bytes, rc.max_response_bytes)
        try:
            await rstore.start()
            state.responses = rstore
        except Exception as e:  # noqa: BLE001 - no JetStream: stored responses stay in this replica
            log.warning("JetStream responses bucket unavailable (%s); stored responses are local to this router", e)

    subs = [
        await state.nc.subscribe(state.subjects.all_heartbeats(), cb=on_heartbeat),
        await state.nc.subscribe(state.subjects.completed(), cb=on_completed),
        await state.nc.subscribe(state.subjects.intent(), cb=on_intent),
    ]
    watcher = asyncio.create_task(watch_health(state))
    app = create_app(state)
    server = uvicorn.Server(
        uvicorn.Config(app, host=cfg.router.host, port=cfg.router.port, log_level="warning", lifespan="off", timeout_graceful_shutdown=30)
    )
    server.install_signal_handlers = lambda: None  # the process owner handles signals
    serve = asyncio.create_task(server.serve())
    while not server.started:
        if serve.done():
            await serve  # propagate the bind error
            raise RuntimeError("router HTTP server stopped during startup")
        await asyncio.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    api = f"http://{host}:{port}"
    log.info("router %s: GC thresholds %s after start-up (router.gc_gen0_threshold)", cfg.router.id, gctune.tune(cfg.router.gc_gen0_threshold))
    log.info("router %s listening on %s", cfg.router.id, api)
    print(f"router {cfg.router.id} listening on {api}", flush=True)
    if ready is not None and not ready.done():
        ready.set_result((api, state))
    try:
        await stop.wait()
    finally:
        server.should_exit = True
        await serve
        watcher.cancel()
        await state.lease_store.stop()
        if state._mux is not None:
            await state._mux.close()
        await close_connection(state.nc, subs)
        await asyncio.to_thread(state.telemetry.shutdown)  # bounded by telemetry.export_timeout_s

