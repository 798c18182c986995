"""Every metric the telemetry service exposes on ``/metrics``, with the record that feeds it.

One :class:`Metrics` owns its own ``prometheus_client.CollectorRegistry`` (no global registry, so two services
or tests can live in one process). Names follow the OpenTelemetry GenAI semantic conventions where one
exists (``gen_ai.server.time_to_first_token`` → ``gen_ai_server_time_to_first_token_seconds`` in Prometheus
form), ``talaria_*`` otherwise. Session ids are never labels (unbounded cardinality); per-session figures
are in the JSON summary and the records file.

``CATALOG`` says which record feeds each metric; the one metric no record feeds yet
(``talaria_kv_load_seconds``) is still defined (it stays empty) because the dashboard reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets (seconds): sub-ms switches on GPU up to multi-minute sessions.
_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SCT = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1)


@dataclass(frozen=True, slots=True)
class MetricDoc:
    name: str  # Prometheus name (without _total/_bucket suffixes)
    kind: str
    labels: tuple[str, ...]
    fed_by: str
    help: str


CATALOG: tuple[MetricDoc, ...] = (
    # histograms
    MetricDoc("gen_ai_server_time_to_first_token_seconds", "histogram", ("model", "instance"), "CompletionHook.ttft_seconds", "engine arrival to first token"),
    MetricDoc("talaria_ttft_schedule_aware_seconds", "histogram", ("model",), "CallRecord (router)", "router arrival of the call (its intended enqueue time in a closed loop) to the first token seen by the router"),
    MetricDoc("gen_ai_server_time_per_output_token_seconds", "histogram", ("model", "instance"), "CompletionHook", "(finish - arrival - ttft) / (output tokens - 1)"),
    MetricDoc("gen_ai_server_request_duration_seconds", "histogram", ("model", "instance"), "CompletionHook", "engine arrival to finish"),
    MetricDoc("talaria_session_completion_seconds", "histogram", (), "CallRecord (+ CompletionHook)", "SCT: a session's first call arrival to its last response; recorded once the session was idle for session_idle_s"),
    MetricDoc("talaria_switch_seconds", "histogram", ("path",), "SwitchRecord (engine .switch subject / snapshot)", "model switch latency by load path (full_staged | partial | host_only)"),
    MetricDoc("talaria_switch_phase_seconds", "histogram", ("phase",), "SwitchRecord", "time of each of the five switch phases"),
    MetricDoc("talaria_kv_load_seconds", "histogram", ("how",), "no record carries it yet (a restore's seconds are in the engine's talaria.engine.kv_restore span)", "time to bring a session prefix back: restore from host vs recompute"),
    MetricDoc("talaria_round_wall_seconds", "histogram", ("instance",), "RoundSummary.wall_s (engine .round subject)", "wall time of a cold-pool round (active + switch)"),
    # counters
    MetricDoc("talaria_calls", "counter", ("model", "instance", "finish_reason"), "CompletionHook", "calls finished by an engine"),
    MetricDoc("talaria_call_phase_seconds", "counter", ("model", "instance", "phase"), "CompletionHook.attribution", "engine seconds of finished calls by phase (engine_queue | round_wait | switch_wait | restore | prefill | decode | preemption | other): exact per call, so rate() gives each phase's share of engine time"),
    MetricDoc("talaria_tokens", "counter", ("model", "type"), "CompletionHook", "input / output / cached (served from KV, not recomputed) tokens"),
    MetricDoc("talaria_sp_admitted", "counter", ("instance",), "RoundSummary.sp_admitted", "session-prefill admissions"),
    MetricDoc("talaria_sp_deferred", "counter", ("instance",), "RoundSummary.sp_deferred", "session-prefill deferrals"),
    MetricDoc("talaria_kv_hits", "counter", ("source",), "CompletionHook usage (host: restored_tokens > 0, else device: cached_tokens > 0, else recompute)", "calls by where their prefix came from: host KV restore, device KV, or recomputed (one count per call)"),
    MetricDoc("talaria_kv_hit_tokens", "counter", ("source",), "CompletionHook usage (device = cached - restored, host = restored, recompute = prompt - cached)", "prompt tokens by source, exact per call; the three sum to the prompt tokens"),
    MetricDoc("talaria_kv_restore_verify_failures", "counter", ("instance",), "CompletionHook.kv_restore_verify_failures (cumulative per engine; growth counted, a drop = a restarted engine, from 0)", "restored KV pages whose bytes failed their checksum (not published, recomputed instead)"),
    MetricDoc("talaria_avoidable_cold_opens", "counter", (), "CallRecord.avoidable_open (router)", "placements that open a model although another healthy instance had it resident"),
    MetricDoc("talaria_lease_hits", "counter", (), "CallRecord.lease == hit", "calls placed by a live soft-reservation lease"),
    MetricDoc("talaria_lease_expiries", "counter", (), "CallRecord.lease == expired", "returning calls that found their lease expired"),
    MetricDoc("talaria_placements", "counter", ("reason",), "CallRecord (start)", "placement decisions by reason"),
    MetricDoc("talaria_deadline_risk_events", "counter", ("instance",), "RoundSummary.deadline_risk", "rounds that reported deadline risk"),
    MetricDoc("talaria_token_deadline_tokens", "counter", ("instance", "token", "on_time"), "RoundSummary.token_deadlines", "tokens scored against per-token deadlines (token=first|later; on_time=true|false)"),
    MetricDoc("talaria_inter_token_gap_p99_seconds", "gauge", ("instance",), "RoundSummary.token_deadlines.gap_p99_s", "p99 inter-token gap of the latest round"),
    MetricDoc("talaria_errors", "counter", ("kind",), "CallRecord.error / CompletionHook.error / undecodable records / failed writes of the records file (records_file_write)", "errors by kind"),
    MetricDoc("talaria_switches", "counter", ("instance", "path"), "SwitchRecord", "model switches"),
    MetricDoc("talaria_telemetry_records", "counter", ("kind",), "every record received", "records observed by this service"),
    MetricDoc("talaria_host_store_lookups", "counter", ("store",), "KvStoreStatsRecord.stats.lookups", "prefix lookups answered by the host KV store"),
    MetricDoc("talaria_host_store_pages", "counter", ("store", "outcome"), "KvStoreStatsRecord.stats hit_pages / miss_pages / capacity_miss_pages", "pages looked up (hit | miss) or refused for lack of space (capacity_miss)"),
    MetricDoc("talaria_host_store_restores", "counter", ("store",), "KvStoreStatsRecord.stats.restores", "restores (read leases completed) served by the host KV store"),
    MetricDoc("talaria_host_store_evictions", "counter", ("store",), "KvStoreStatsRecord.stats.evictions", "pages evicted from the host KV store"),
    MetricDoc("talaria_host_store_bytes", "counter", ("store", "direction"), "KvStoreStatsRecord.stats bytes_in / bytes_out", "bytes checkpointed into (in) and restored out of (out) the host KV store"),
    # gauges
    MetricDoc("talaria_kv_occupancy_ratio", "gauge", ("instance",), "InstanceSnapshot.kv_usage", "fraction of device KV pages in use"),
    MetricDoc("talaria_staging_slack_bytes", "gauge", ("instance",), "InstanceSnapshot.staging_slack_bytes", "free weight-staging bytes (cold pool)"),
    MetricDoc("talaria_host_store_occupancy_ratio", "gauge", ("store",), "KvStoreStatsRecord.stats.occupancy (<ns>.kvstore.<store>.stats)", "fraction of the host KV pool in use"),
    MetricDoc("talaria_host_store_capacity_bytes", "gauge", ("store",), "KvStoreStatsRecord.stats.capacity_bytes", "size of the host KV pool"),
    MetricDoc("talaria_host_store_used_bytes", "gauge", ("store",), "KvStoreStatsRecord.stats.used_bytes", "host KV pool bytes holding pages (committed, reserved or pinned)"),
    MetricDoc("talaria_host_store_entries", "gauge", ("store",), "KvStoreStatsRecord.stats.entries", "committed pages in the host KV store"),
    MetricDoc("talaria_instance_up", "gauge", ("instance",), "InstanceSnapshot (fresh within 3 periods)", "1 while the instance heartbeats"),
    MetricDoc("talaria_instance_running_calls", "gauge", ("instance",), "InstanceSnapshot.num_running", "calls running"),
    MetricDoc("talaria_instance_waiting_calls", "gauge", ("instance",), "InstanceSnapshot.num_waiting", "calls waiting"),
    MetricDoc("talaria_prefix_hit_ratio", "gauge", ("instance",), "InstanceSnapshot.prefix_hit_rate", "prefix cache hit rate reported by the engine"),
    MetricDoc("talaria_sessions_open", "gauge", (), "CallRecord / CompletionHook", "sessions seen and not yet idle"),
    MetricDoc("talaria_calls_in_flight", "gauge", (), "CallRecord start/end", "calls placed and not finished"),
)


class Metrics:
    """The Prometheus instruments (attributes named after ``CATALOG`` without prefixes)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        d = {m.name: m for m in CATALOG}

        def hist(name: str, buckets) -> Histogram:
            m = d[name]
            return Histogram(name, m.help + f" [fed by {m.fed_by}]", m.labels, buckets=buckets, registry=r)

        def counter(name: str) -> Counter:
            m = d[name]
            return Counter(name, m.help + f" [fed by {m.fed_by}]", m.labels, registry=r)

        def gauge(name: str) -> Gauge:
            m = d[name]
            return Gauge(name, m.help + f" [fed by {m.fed_by}]", m.labels, registry=r)

        self.ttft = hist("gen_ai_server_time_to_first_token_seconds", _LAT)
        self.ttft_sched = hist("talaria_ttft_schedule_aware_seconds", _LAT)
        self.tpot = hist("gen_ai_server_time_per_output_token_seconds", _TPOT)
        self.duration = hist("gen_ai_server_request_duration_seconds", _SCT)
        self.sct = hist("talaria_session_completion_seconds", _SCT)
        self.switch = hist("talaria_switch_seconds", _LAT)
        self.switch_phase = hist("talaria_switch_phase_seconds", _LAT)
        self.kv_load = hist("talaria_kv_load_seconds", _LAT)
        self.round_wall = hist("talaria_round_wall_seconds", _LAT)
        self.calls = counter("talaria_calls")
        self.tokens = counter("talaria_tokens")
        self.call_phase = counter("talaria_call_phase_seconds")
        self.sp_admitted = counter("talaria_sp_admitted")
        self.sp_deferred = counter("talaria_sp_deferred")
        self.kv_hits = counter("talaria_kv_hits")
        self.kv_hit_tokens = counter("talaria_kv_hit_tokens")
        self.kv_verify_failures = counter("talaria_kv_restore_verify_failures")
        self.avoidable_opens = counter("talaria_avoidable_cold_opens")
        self.lease_hits = counter("talaria_lease_hits")
        self.lease_expiries = counter("talaria_lease_expiries")
        self.placements = counter("talaria_placements")
        self.deadline_risk = counter("talaria_deadline_risk_events")
        self.deadline_tokens = counter("talaria_token_deadline_tokens")
        self.gap_p99 = gauge("talaria_inter_token_gap_p99_seconds")
        self.errors = counter("talaria_errors")
        self.switches = counter("talaria_switches")
        self.records = counter("talaria_telemetry_records")
        self.kv_occupancy = gauge("talaria_kv_occupancy_ratio")
        self.staging_slack = gauge("talaria_staging_slack_bytes")
        self.host_occupancy = gauge("talaria_host_store_occupancy_ratio")
        self.host_capacity = gauge("talaria_host_store_capacity_bytes")
        self.host_used = gauge("talaria_host_store_used_bytes")
        self.host_entries = gauge("talaria_host_store_entries")
        self.host_lookups = counter("talaria_host_store_lookups")
        self.host_pages = counter("talaria_host_store_pages")
        self.host_restores = counter("talaria_host_store_restores")
        self.host_evictions = counter("talaria_host_store_evictions")
        self.host_bytes = counter("talaria_host_store_bytes")
        self.up = gauge("talaria_instance_up")
        self.running = gauge("talaria_instance_running_calls")
        self.waiting = gauge("talaria_instance_waiting_calls")
        self.prefix_hit = gauge("talaria_prefix_hit_ratio")
        self.sessions_open = gauge("talaria_sessions_open")
        self.in_flight = gauge("talaria_calls_in_flight")
        # Unlabelled counters appear at 0 from the start; labelled ones with their known label values.
        for source in ("device", "host", "recompute"):
            self.kv_hits.labels(source)
            self.kv_hit_tokens.labels(source)

    def exposition(self) -> bytes:
        """Prometheus text format 0.0.4."""
        return generate_latest(self.registry)
