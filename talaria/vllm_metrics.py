"""Serving metrics under vLLM's Prometheus names, so dashboards, alerts and autoscalers written for vLLM read a
Talaria stack unchanged.

Every series carries ``model_name`` (the served model name, as vLLM labels it) and ``engine`` (the Talaria
instance id; vLLM v1 labels its engine index the same way; ``instance`` is left to Prometheus, which sets it
to the scrape target). The router's ``/metrics`` exports them for every engine it hears (heartbeats and
completion hooks on NATS); an engine with ``metrics_port`` exports its own on its own ``/metrics``. Scrape one
of the two per dashboard: they count the same calls, and every router replica exports every engine (the
bundled dashboards read the engines' own job, ``talaria-engine``, where each series exists once).

| name | type | fed by |
|---|---|---|
| ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` | gauge | ``InstanceSnapshot.models[].num_running`` / ``num_waiting`` |
| ``vllm:kv_cache_usage_perc`` (and the older ``vllm:gpu_cache_usage_perc``) | gauge, 0..1 | ``InstanceSnapshot.kv_usage`` (one pool per instance: every model the instance serves shows it) |
| ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` | counter | ``CompletionHook.usage`` |
| ``vllm:request_success_total`` | counter, + ``finished_reason`` | ``CompletionHook.finish_reason`` (calls without an error) |
| ``vllm:time_to_first_token_seconds`` | histogram | ``CompletionHook.ttft_seconds`` (engine arrival to first token) |
| ``vllm:time_per_output_token_seconds`` | histogram | (finish - arrival - ttft) / (completion tokens - 1), calls with 2+ tokens |
| ``vllm:e2e_request_latency_seconds`` | histogram | ``finish_unix - arrival_unix`` |
| ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` | counter (tokens) | prompt tokens / ``usage.cached_tokens`` (device or host KV) |

Beside them ``talaria_engine_kernel_on{engine, kernel}`` (1: the compute kernel runs, 0: its fallback;
``InstanceSnapshot.kernels``).

A hook with an error counts its tokens but no latency and no success. The class owns its registry (no global
state); the instruments are thread-safe (the engine feeds them from its heartbeat thread and its loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from talaria.v1 import engine_pb2 as pb

if TYPE_CHECKING:
    import threading
    from http.server import ThreadingHTTPServer

LABELS = ("model_name", "engine")
# vLLM's buckets (v0.8+), so histogram_quantile over either system compares like with like
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# the host KV tier's cumulative counters (services/engine/host_kv.py COUNTERS) exported, and their help text
HOST_KV_COUNTERS = {
    "checkpoints": ("talaria_host_kv_checkpoints", "Session checkpoints written to the kvstore"),
    "checkpoint_bytes": ("talaria_host_kv_checkpoint_bytes", "Bytes of KV pages checkpointed to the kvstore"),
    "checkpoint_cpu_s": ("talaria_host_kv_checkpoint_cpu_seconds", "CPU seconds the tier's checkpoint thread spent (copies, checksums, store RPCs, transfer): on a CPU engine taken from the compute threads' cores"),
    "restores": ("talaria_host_kv_restores", "Prompts restored from the kvstore instead of recomputed"),
    "restore_bytes": ("talaria_host_kv_restore_bytes", "Bytes of KV pages restored from the kvstore"),
    "restore_cpu_s": ("talaria_host_kv_restore_cpu_seconds", "CPU seconds the tier's restore thread spent (lookups, transfers, checksums, scatters)"),
    "restores_declined": ("talaria_host_kv_restores_declined", "Restores the measured costs declined (recomputing was cheaper)"),
    "store_failures": ("talaria_host_kv_store_failures", "Kvstore RPCs or transfers that failed (the call recomputed or the checkpoint was dropped)"),
}
TALARIA_NAMES = ("talaria_engine_kernel_on", *(n for n, _h in HOST_KV_COUNTERS.values()))  # beside the vLLM names, in the same registry
NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


class ServingMetrics:
    """The vLLM-named instruments, in a registry of their own (or ``registry``, to share one /metrics)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Calls running on the engine (in its batch)", LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Calls queued on the engine", LABELS, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the engine's device KV pages in use (1 = 100%)", LABELS, registry=r)
        self.gpu_kv_usage = Gauge("vllm:gpu_cache_usage_perc", "Same as vllm:kv_cache_usage_perc (vLLM's older name)", LABELS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished calls", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished calls", LABELS, registry=r)
        self.success = Counter("vllm:request_success", "Calls finished without an error", LABELS + ("finished_reason",), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Engine arrival to first token", LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first", LABELS, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Engine arrival to the call's end", LABELS, buckets=E2E_BUCKETS, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", LABELS, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (device or host KV)", LABELS, registry=r)
        self.kernel_on = Gauge("talaria_engine_kernel_on", "1 if the engine runs this compute kernel, 0 if it runs the fallback (InstanceSnapshot.kernels)", ("engine", "kernel"), registry=r)
        self.host_kv = _HostKvCounters()
        r.register(self.host_kv)

    def observe_snapshot(self, snap: pb.InstanceSnapshot) -> None:
        """Set the gauges of every model ``snap`` lists. Mutates the gauges only."""
        for m in snap.models:
            key = (m.model, snap.instance_id)
            self.running.labels(*key).set(m.num_running)
            self.waiting.labels(*key).set(m.num_waiting)
            self.kv_usage.labels(*key).set(snap.kv_usage)
            self.gpu_kv_usage.labels(*key).set(snap.kv_usage)
        for k in snap.kernels:
            self.kernel_on.labels(snap.instance_id, k.name).set(0 if k.state.startswith("off") else 1)

    def observe_host_kv(self, engine: str, counters: Iterable[tuple[str, Iterable[tuple[str, float]]]]) -> None:
        """The host KV tiers' cumulative counters of ``engine`` (``EngineStats.host_kv_counters``: per model).
        Mutates the exported values only."""
        self.host_kv.update(engine, counters)

    def observe_hook(self, hook: pb.CompletionHook) -> None:
        """Count one finished call (tokens, prefix-cache lookups; latencies and success unless it failed).
        Mutates the counters and histograms only."""
        key = (hook.model, hook.instance_id)
        u = hook.usage
        self.prompt_tokens.labels(*key).inc(u.prompt_tokens)
        self.generation_tokens.labels(*key).inc(u.completion_tokens)
        self.prefix_queries.labels(*key).inc(u.prompt_tokens)
        self.prefix_hits.labels(*key).inc(min(u.cached_tokens, u.prompt_tokens))
        if hook.HasField("error") or hook.finish_reason in ("abort", "error"):
            return
        self.success.labels(*key, hook.finish_reason or "stop").inc()
        e2e = max(0.0, hook.finish_unix - hook.arrival_unix)
        self.e2e.labels(*key).observe(e2e)
        if u.completion_tokens >= 1 and hook.ttft_seconds > 0:
            self.ttft.labels(*key).observe(hook.ttft_seconds)
        if u.completion_tokens >= 2 and hook.ttft_seconds > 0:
            self.tpot.labels(*key).observe(max(0.0, e2e - hook.ttft_seconds) / (u.completion_tokens - 1))

    def exposition(self) -> bytes:
        """Prometheus text format 0.0.4."""
        return generate_latest(self.registry)


class _HostKvCounters(Collector):
    """The host KV counters as Prometheus counters: the tier keeps the cumulative values, the heartbeat's
    ``EngineStats`` carries them here, a scrape reads the latest."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], dict[str, float]] = {}  # (model, engine) -> counter -> value

    def update(self, engine: str, counters: Iterable[tuple[str, Iterable[tuple[str, float]]]]) -> None:
        for model, kv in counters:
            self._values[(model, engine)] = {k: float(v) for k, v in kv if k in HOST_KV_COUNTERS}

    def collect(self) -> Iterator[CounterMetricFamily]:
        values = dict(self._values)
        for key, (name, help_text) in HOST_KV_COUNTERS.items():
            fam = CounterMetricFamily(name, help_text, labels=LABELS)
            for labels, kv in values.items():
                if key in kv:
                    fam.add_metric(list(labels), kv[key])
            yield fam


TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def serve_metrics(exposition: Callable[[], bytes], host: str, port: int) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve ``exposition()`` (bytes, text format 0.0.4) at ``GET /metrics`` from a daemon thread; returns
    (server, thread) with the bound port in ``server.server_port``.

    Why not ``prometheus_client.start_http_server``: it negotiates OpenMetrics with the scraper, and a Prometheus
    2.x scraper (which does not offer UTF-8 names) gets every name "escaped" with underscores: ``vllm:...``
    arrives as ``vllm_...`` and no vLLM dashboard finds it. The text format is always sent, as the router's
    ``/metrics`` does."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = exposition()
            self.send_response(200)
            self.send_header("Content-Type", TEXT_CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: not worth a log line each
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
