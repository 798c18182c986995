"""Records in, metrics + sessions + a records file out. No NATS, no HTTP: the service feeds it bytes (or
decoded messages in tests) with the receive time, so every rule here is testable without processes.

Record kinds and where they come from (subjects in ``talaria/subjects.py``):

| kind | subject | payload |
|---|---|---|
| heartbeat | ``<ns>.engine.*.heartbeat`` | ``InstanceSnapshot`` (gauges; switch records embedded in it) |
| hook | ``<ns>.hook.completed`` | ``CompletionHook`` (TTFT, TPOT, tokens, KV hits, SCT fallback) |
| call | ``<ns>.router.*.calls`` | ``CallRecord`` (SCT, schedule-aware TTFT, placement, leases, avoidable opens) |
| switch | ``<ns>.engine.*.switch`` | ``SwitchRecord`` (also embedded in heartbeats) |
| round | ``<ns>.engine.*.round`` | ``RoundSummary`` |
| kvstore | ``<ns>.kvstore.*.stats`` | ``KvStoreStatsRecord`` (host-store gauges; its cumulative counters become Prometheus counters by delta) |
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from services.telemetry.metrics import Metrics
from services.telemetry.sessions import SessionResult, SessionTracker
from talaria.attribution import CallAttribution
from talaria.v1 import engine_pb2 as pb
from talaria.v1 import kvstore_pb2 as kpb
from talaria.v1 import telemetry_pb2 as tpb

log = logging.getLogger(__name__)

SWITCH_PHASES = ("save_teardown", "open_weights", "restore_kv_shell", "restore_runtime", "publish")


class RecordWriter:
    """Appends one JSON object per line to a file (``{"kind": ..., "recv_unix": ..., ...}``). Thread-safe;
    write errors are counted, never raised."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", buffering=1 << 16)
        self._lock = threading.Lock()
        self.errors = 0
        self.lines = 0

    def write(self, record: dict[str, Any]) -> None:
        try:
            line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
            with self._lock:
                self._f.write(line)
                self.lines += 1
        except Exception as e:  # noqa: BLE001
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        """Count a failed write (``errors``, exported by ``Collector.tick`` as ``talaria_errors_total{kind="records_file_write"}`` and in
        ``/summary``'s ``records_file_errors``) and log the first one: the records file silently losing lines is what this prevents."""
        self.errors += 1
        if self.errors == 1:
            log.warning("telemetry records file %s: write failed (%s); further failures are counted, not logged", self.path, e)

    def flush(self) -> None:
        with self._lock:
            try:
                self._f.flush()
            except Exception as e:  # noqa: BLE001
                self._failed(e)

    def close(self) -> None:
        with self._lock:
            try:
                self._f.close()
            except Exception:  # noqa: BLE001
                pass


def read_records(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a run (what the benchmark and report tools read), optionally of one kind."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or r.get("kind") == kind:
            out.append(r)
    return out


def _msg_dict(msg) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def decode_switch(data: bytes) -> dict[str, Any]:
    """A ``SwitchRecord`` as a flat dict with ``phases`` {name: seconds}."""
    m = pb.SwitchRecord()
    m.ParseFromString(data)
    return normalize_switch(_msg_dict(m))


def normalize_switch(d: dict[str, Any]) -> dict[str, Any]:
    """A ``SwitchRecord`` dict with its five ``<phase>_seconds`` fields gathered into ``phases``."""
    out = dict(d)
    out["phases"] = {p: float(d.get(f"{p}_seconds", 0.0) or 0.0) for p in SWITCH_PHASES}
    out["total_seconds"] = float(d.get("total_seconds", 0.0) or sum(out["phases"].values()))
    out["path"] = str(d.get("path", "") or "unknown")
    return out


def decode_round(data: bytes) -> dict[str, Any]:
    m = pb.RoundSummary()
    m.ParseFromString(data)
    return _msg_dict(m)


def record_number(d: dict, *keys: str) -> float:
    """The first of ``keys`` in record ``d`` that holds a number (a JSON-encoded proto carries 64-bit counts as
    strings; a bool is not a number here); 0.0 when none does. The one reader of numbers in telemetry records
    (this collector, and ``bench/report.py`` over the records file)."""
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
    return 0.0


def kv_source_split(prompt: int, cached: int, restored: int) -> dict[str, int]:
    """Where one call's prompt tokens came from, exactly, from its usage: ``device`` = cached - restored
    (already in device KV), ``host`` = restored (from the host KV store for this call), ``recompute`` =
    prompt - cached. The three add up to the prompt tokens (out-of-range inputs are clamped)."""
    prompt = max(0, int(prompt))
    cached = min(max(0, int(cached)), prompt)
    restored = min(max(0, int(restored)), cached)
    return {"device": cached - restored, "host": restored, "recompute": prompt - cached}


def kv_call_source(split: dict[str, int]) -> str:
    """One call's KV source for ``kv_hits`` (one count per call): ``host`` when any prompt token was restored
    from the host store, else ``device`` when any was cached, else ``recompute`` (the engine span's
    ``talaria.kv.source`` uses the same rule)."""
    return "host" if split["host"] else ("device" if split["device"] else "recompute")


class Collector:
    """State of the telemetry service: metrics, sessions, recent records, counts."""

    def __init__(self, idle_s: float, writer: RecordWriter | None = None, record_heartbeats: bool = False, on_switch=None):
        self.metrics = Metrics()
        self.sessions = SessionTracker(idle_s)
        self.writer = writer
        self._writer_errors_seen = 0  # writer.errors already counted in talaria_errors{kind="records_file_write"}
        self.record_heartbeats = record_heartbeats
        self.on_switch = on_switch  # callback(dict) for switch spans
        self.counts: dict[str, int] = {}
        self.instances: dict[str, dict[str, Any]] = {}
        self._switch_seen: OrderedDict[tuple[str, int, float], None] = OrderedDict()
        self.stores: dict[str, dict[str, Any]] = {}  # store id -> latest stats (summary)
        self._store_last: dict[str, tuple[int, dict[str, int]]] = {}  # store id -> (epoch, cumulative counters)
        self._verify_last: dict[str, int] = {}  # instance -> cumulative restore verify failures
        self._lock = threading.Lock()
        self.started_unix = time.time()

    # ---------------------------------------------------------------- plumbing
    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.metrics.records.labels(kind).inc()

    def _write(self, kind: str, now: float, body: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write({"kind": kind, "recv_unix": now, **body})

    def _bad(self, kind: str, e: Exception) -> None:
        self.metrics.errors.labels(f"bad_{kind}").inc()
        log.debug("undecodable %s record: %s", kind, e)

    def feed(self, kind: str, data: bytes, now: float | None = None) -> None:
        """Decode and apply one message; never raises (bad payloads are counted as errors)."""
        now = time.time() if now is None else now
        try:
            if kind == "heartbeat":
                m = pb.InstanceSnapshot()
                m.ParseFromString(data)
                self.on_heartbeat(m, now)
            elif kind == "hook":
                m = pb.CompletionHook()
                m.ParseFromString(data)
                self.on_hook(m, now)
            elif kind == "call":
                m = tpb.CallRecord()
                m.ParseFromString(data)
                self.on_call(m, now)
            elif kind == "switch":
                self.on_switch_record(decode_switch(data), now)
            elif kind == "round":
                self.on_round(decode_round(data), now)
            elif kind == "kvstore":
                m = kpb.KvStoreStatsRecord()
                m.ParseFromString(data)
                self.on_kvstore_stats(m, now)
            else:
                raise ValueError(f"unknown record kind {kind!r}")
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the service
            self._bad(kind, e)

    # ---------------------------------------------------------------- records
    def on_heartbeat(self, s: pb.InstanceSnapshot, now: float) -> None:
        with self._lock:
            self._count("heartbeat")
            inst = s.instance_id
            m = self.metrics
            m.kv_occupancy.labels(inst).set(s.kv_usage)
            m.staging_slack.labels(inst).set(s.staging_slack_bytes)
            m.running.labels(inst).set(s.num_running)
            m.waiting.labels(inst).set(s.num_waiting)
            m.prefix_hit.labels(inst).set(s.prefix_hit_rate)
            m.up.labels(inst).set(0 if s.draining else 1)
            self.instances[inst] = {
                "pool": pb.Pool.Name(s.pool),
                "last_heartbeat_unix": now,
                "period_s": s.heartbeat_period_s,
                "kv_usage": s.kv_usage,
                "staging_slack_bytes": s.staging_slack_bytes,
                "running": s.num_running,
                "waiting": s.num_waiting,
                "draining": s.draining,
                "models": [x.model for x in s.models if x.active],
                "kernels": {k.name: k.state for k in s.kernels},  #
            }
            if s.cold_scheduler:  # per-token deadline attainment since the engine epoch began
                self.instances[inst].update({
                    "cold_scheduler": s.cold_scheduler, "deadline_attainment": s.deadline_attainment,
                    "ttft_attainment": s.ttft_attainment, "gap_p99_s": s.gap_p99_s,
                    "transfer_stream_bytes": s.transfer_stream_bytes, "transfer_kv_bytes": s.transfer_kv_bytes,
                })
            if self.record_heartbeats:
                self._write("heartbeat", now, _msg_dict(s))
        for rec in s.switches:  # switch records embedded in the snapshot
            d = _msg_dict(rec)
            d.setdefault("instance_id", s.instance_id)
            self.on_switch_record(normalize_switch(d), now)

    def on_hook(self, h: pb.CompletionHook, now: float) -> None:
        with self._lock:
            self._count("hook")
            m = self.metrics
            model, inst = h.model, h.instance_id
            reason = h.finish_reason or "stop"
            m.calls.labels(model, inst, reason).inc()
            u = h.usage
            if h.HasField("error"):
                m.errors.labels(h.error.code or "engine_error").inc()
            self._verify_failures(inst, h.kv_restore_verify_failures)
            ok = not h.HasField("error") and reason != "abort"
            if h.HasField("attribution"):  # the engine's exact split of the call's time
                for name, secs in CallAttribution.from_proto(h.attribution).components.items():
                    if secs > 0 and name not in ("router_queue_s", "placement_s"):
                        m.call_phase.labels(model, inst, name[:-2]).inc(secs)
            if ok:
                if h.ttft_seconds > 0:
                    m.ttft.labels(model, inst).observe(h.ttft_seconds)
                dur = max(0.0, h.finish_unix - h.arrival_unix)
                m.duration.labels(model, inst).observe(dur)
                if u.completion_tokens > 1 and h.ttft_seconds > 0:
                    m.tpot.labels(model, inst).observe(max(0.0, dur - h.ttft_seconds) / (u.completion_tokens - 1))
                m.tokens.labels(model, "input").inc(u.prompt_tokens)
                m.tokens.labels(model, "output").inc(u.completion_tokens)
                m.tokens.labels(model, "cached").inc(u.cached_tokens)
                split = kv_source_split(u.prompt_tokens, u.cached_tokens, u.restored_tokens)
                m.kv_hits.labels(kv_call_source(split)).inc()
                for source, n in split.items():
                    if n:
                        m.kv_hit_tokens.labels(source).inc(n)
            self.sessions.call_ended(
                h.session_id,
                h.request_id,
                h.arrival_unix or now,
                h.finish_unix or now,
                now,
                model=model,
                instance=inst,
                error=h.HasField("error"),
                tokens=(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            )
            self._write("hook", now, _msg_dict(h))

    def on_call(self, c: tpb.CallRecord, now: float) -> None:
        with self._lock:
            self._count(f"call_{c.phase or 'unknown'}")
            m = self.metrics
            if c.phase == "start":
                m.placements.labels(c.placement_reason or "unknown").inc()
                if c.lease == "hit":
                    m.lease_hits.inc()
                elif c.lease == "expired":
                    m.lease_expiries.inc()
                if c.avoidable_open:
                    m.avoidable_opens.inc()
                self.sessions.call_started(c.session_id, c.request_id, c.arrival_unix or now, now)
            elif c.phase == "end":
                if c.error:
                    m.errors.labels(c.error).inc()
                    if not c.instance_id and c.placement_reason:  # never placed (overload, no instance)
                        m.placements.labels(c.placement_reason).inc()
                elif c.first_token_unix and c.arrival_unix:
                    m.ttft_sched.labels(c.model).observe(max(0.0, c.first_token_unix - c.arrival_unix))
                u = c.usage
                self.sessions.call_ended(
                    c.session_id,
                    c.request_id,
                    c.arrival_unix or now,
                    c.end_unix or now,
                    now,
                    model=c.model,
                    instance=c.instance_id,
                    error=bool(c.error),
                    tokens=(u.prompt_tokens, u.completion_tokens, u.cached_tokens) if c.HasField("usage") else None,
                )
                if c.HasField("attribution"):  # summed per session
                    self.sessions.call_attribution(c.session_id, c.request_id, c.arrival_unix or now, CallAttribution.from_proto(c.attribution).as_dict())
            self._write("call", now, _msg_dict(c))

    def on_switch_record(self, d: dict[str, Any], now: float) -> None:
        inst = str(d.get("instance_id", ""))
        key = (inst, int(record_number(d, "seq")), float(record_number(d, "started_unix")))
        with self._lock:
            if key in self._switch_seen:  # the same record on the subject and in a snapshot
                return
            self._switch_seen[key] = None
            while len(self._switch_seen) > 4096:
                self._switch_seen.popitem(last=False)
            self._count("switch")
            m = self.metrics
            m.switch.labels(d["path"]).observe(d["total_seconds"])
            m.switches.labels(inst, d["path"]).inc()
            for phase, secs in d["phases"].items():
                m.switch_phase.labels(phase).observe(secs)
            self._write("switch", now, d)
        if self.on_switch is not None:
            try:
                self.on_switch(d)
            except Exception:  # noqa: BLE001
                log.debug("switch span failed", exc_info=True)

    def on_round(self, d: dict[str, Any], now: float) -> None:
        with self._lock:
            self._count("round")
            m = self.metrics
            inst = str(d.get("instance_id", ""))
            m.sp_admitted.labels(inst).inc(record_number(d, "sp_admitted"))
            m.sp_deferred.labels(inst).inc(record_number(d, "sp_deferred"))
            if d.get("deadline_risk"):
                m.deadline_risk.labels(inst).inc()
            wall = record_number(d, "wall_s")
            if wall:
                m.round_wall.labels(inst).observe(wall)
            td = d.get("token_deadlines")
            if isinstance(td, dict) and (record_number(td, "tokens") or record_number(td, "first_tokens")):  #
                for token, n, ok in (("first", "first_tokens", "first_on_time"), ("later", "tokens", "tokens_on_time")):
                    m.deadline_tokens.labels(inst, token, "true").inc(record_number(td, ok))
                    m.deadline_tokens.labels(inst, token, "false").inc(max(0.0, record_number(td, n) - record_number(td, ok)))
                m.gap_p99.labels(inst).set(record_number(td, "gap_p99_s"))
            # A round's host hits are not counted into kv_hits: every call's hook already reports its own
            # restored tokens (counting both would count a host hit twice). They stay in the records file.
            self._write("round", now, d)

    def on_host_store(self, store: str, occupancy: float) -> None:
        self.metrics.host_occupancy.labels(store).set(occupancy)

    # the store's cumulative counters -> (metric attribute, extra label values)
    _STORE_COUNTERS = {
        "lookups": ("host_lookups", ()),
        "hit_pages": ("host_pages", ("hit",)),
        "miss_pages": ("host_pages", ("miss",)),
        "capacity_miss_pages": ("host_pages", ("capacity_miss",)),
        "restores": ("host_restores", ()),
        "evictions": ("host_evictions", ()),
        "bytes_in": ("host_bytes", ("in",)),
        "bytes_out": ("host_bytes", ("out",)),
    }

    def _verify_failures(self, inst: str, total: int) -> None:
        """Advance ``talaria_kv_restore_verify_failures`` by the growth of an engine's cumulative count (a
        smaller value = the engine restarted: count from 0). Caller holds the lock."""
        prev = self._verify_last.get(inst, 0)
        if total < prev:
            prev = 0
        if total > prev:
            self.metrics.kv_verify_failures.labels(inst).inc(total - prev)
        self._verify_last[inst] = total

    def on_kvstore_stats(self, rec: kpb.KvStoreStatsRecord, now: float) -> None:
        """A store's periodic stats: gauges set, counters advanced by the growth since its previous record
        (a new epoch — a restarted, empty store — counts from zero again)."""
        with self._lock:
            self._count("kvstore")
            st, store = rec.stats, rec.store_id or "unknown"
            m = self.metrics
            self.on_host_store(store, st.occupancy)
            m.host_capacity.labels(store).set(st.capacity_bytes)
            m.host_used.labels(store).set(st.used_bytes)
            m.host_entries.labels(store).set(st.entries)
            cur = {k: int(getattr(st, k)) for k in self._STORE_COUNTERS}
            epoch, prev = self._store_last.get(store, (None, None))
            if prev is None or epoch != st.epoch:
                prev = dict.fromkeys(cur, 0)
            for k, v in cur.items():
                delta = v - prev[k]
                if delta > 0:
                    attr, extra = self._STORE_COUNTERS[k]
                    getattr(m, attr).labels(store, *extra).inc(delta)
            self._store_last[store] = (st.epoch, cur)
            self.stores[store] = {
                "address": rec.address, "last_stats_unix": now, "epoch": st.epoch, "occupancy": st.occupancy,
                "capacity_bytes": st.capacity_bytes, "used_bytes": st.used_bytes, "entries": st.entries, **cur,
            }
            if self.record_heartbeats:
                self._write("kvstore", now, _msg_dict(rec))

    # ---------------------------------------------------------------- periodic + views
    def tick(self, now: float | None = None) -> list[SessionResult]:
        """End idle sessions (recording their SCT), refresh liveness gauges. Call periodically."""
        now = time.time() if now is None else now
        with self._lock:
            ended = self.sessions.expire(now)
            for r in ended:
                self.metrics.sct.observe(r.sct_seconds)
                self._write("session", now, r.as_dict())
            for inst, v in self.instances.items():
                stale = now - v["last_heartbeat_unix"] > 3 * max(v["period_s"], 0.1)
                if stale:
                    self.metrics.up.labels(inst).set(0)
            self.metrics.sessions_open.set(len(self.sessions.open))
            self.metrics.in_flight.set(self.sessions.calls_in_flight)
        if self.writer is not None:
            self.writer.flush()
            lost = self.writer.errors - self._writer_errors_seen
            if lost > 0:  # failed writes of the records file, as an error kind the dashboards already show
                self.metrics.errors.labels("records_file_write").inc(lost)
                self._writer_errors_seen += lost
        return ended

    def summary(self) -> dict[str, Any]:
        with self._lock:
            finished = self.sessions.finished
            scts = sorted(r.sct_seconds for r in finished)

            def pct(q: float) -> float | None:
                if not scts:
                    return None
                i = max(0, min(len(scts) - 1, int(-(-q * len(scts) // 1)) - 1))  # nearest rank
                return scts[i]

            return {
                "since_unix": self.started_unix,
                "records": dict(self.counts),
                "instances": dict(self.instances),
                "stores": dict(self.stores),
                "sessions": {
                    "open": len(self.sessions.open),
                    "calls_in_flight": self.sessions.calls_in_flight,
                    "finished": len(finished),
                    "sct_p50_s": pct(0.5),
                    "sct_p95_s": pct(0.95),
                    "recent": [r.as_dict() for r in finished[-50:]],
                },
                "records_file": str(self.writer.path) if self.writer is not None else None,
                "records_file_errors": self.writer.errors if self.writer is not None else 0,
            }
