"""vLLM-named serving metrics (issue 43 item 6): what a heartbeat and a completion hook put in each series,
and the router's ``/metrics`` fed through its real NATS handlers (``on_heartbeat`` / ``on_completed``)."""

from __future__ import annotations

import asyncio
import urllib.error

import pytest

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from talaria.v1 import engine_pb2 as pb
from talaria.vllm_metrics import ServingMetrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a Prometheus exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def snapshot(instance="e0", kv=0.25, models=(("m", 2, 1),)) -> pb.InstanceSnapshot:
    snap = pb.InstanceSnapshot(instance_id=instance, epoch=1, seq=1, heartbeat_period_s=30, kv_usage=kv)
    for name, running, waiting in models:
        snap.models.append(pb.ModelState(model=name, loaded=True, active=True, max_context=4096, num_running=running, num_waiting=waiting))
    return snap


def hook(model="m", instance="e0", prompt=10, completion=5, cached=6, ttft=0.5, e2e=2.5, reason="stop", error=False) -> pb.CompletionHook:
    h = pb.CompletionHook(model=model, instance_id=instance, finish_reason=reason, arrival_unix=100.0, finish_unix=100.0 + e2e, ttft_seconds=ttft)
    h.usage.prompt_tokens, h.usage.completion_tokens, h.usage.cached_tokens = prompt, completion, cached
    if error:
        h.error.message = "boom"
    return h


L = (("engine", "e0"), ("model_name", "m"))


def test_snapshot_and_hooks_fill_the_vllm_series():
    m = ServingMetrics()
    m.observe_snapshot(snapshot(models=(("m", 2, 1), ("other", 0, 3))))
    m.observe_hook(hook())
    m.observe_hook(hook(prompt=4, completion=1, cached=0, ttft=0.2, e2e=0.2, reason="length"))
    m.observe_hook(hook(prompt=7, completion=0, cached=7, error=True))
    s = samples(m.exposition().decode())
    assert s[("vllm:num_requests_running", L)] == 2 and s[("vllm:num_requests_waiting", L)] == 1
    assert s[("vllm:num_requests_waiting", (("engine", "e0"), ("model_name", "other")))] == 3
    assert s[("vllm:kv_cache_usage_perc", L)] == 0.25 == s[("vllm:gpu_cache_usage_perc", L)]
    assert s[("vllm:prompt_tokens_total", L)] == 21 and s[("vllm:generation_tokens_total", L)] == 6
    assert s[("vllm:prefix_cache_queries_total", L)] == 21 and s[("vllm:prefix_cache_hits_total", L)] == 13
    assert s[("vllm:request_success_total", tuple(sorted(L + (("finished_reason", "stop"),))))] == 1
    assert s[("vllm:request_success_total", tuple(sorted(L + (("finished_reason", "length"),))))] == 1
    # latencies of the two calls without an error; TPOT only for the one with 2+ tokens: (2.5 - 0.5) / 4
    assert s[("vllm:e2e_request_latency_seconds_count", L)] == 2 and abs(s[("vllm:e2e_request_latency_seconds_sum", L)] - 2.7) < 1e-9
    assert s[("vllm:time_to_first_token_seconds_count", L)] == 2
    assert s[("vllm:time_per_output_token_seconds_count", L)] == 1 and abs(s[("vllm:time_per_output_token_seconds_sum", L)] - 0.5) < 1e-9


def test_host_kv_counters_are_exported_per_model_and_engine():
    m = ServingMetrics()
    m.observe_host_kv("e0", [("m", [("checkpoints", 3), ("checkpoint_cpu_s", 0.25), ("restores", 1), ("dirty_marked", 9)])])
    m.observe_host_kv("e0", [("m", [("checkpoints", 4), ("checkpoint_cpu_s", 0.5), ("restores", 1)]), ("other", [("restore_cpu_s", 0.125)])])
    s = samples(m.exposition().decode())
    assert s[("talaria_host_kv_checkpoints_total", L)] == 4  # the latest cumulative value, not a sum of heartbeats
    assert s[("talaria_host_kv_checkpoint_cpu_seconds_total", L)] == 0.5 and s[("talaria_host_kv_restores_total", L)] == 1
    assert s[("talaria_host_kv_restore_cpu_seconds_total", (("engine", "e0"), ("model_name", "other")))] == 0.125
    assert not any(name.startswith("talaria_host_kv_dirty") for name, _l in s)  # only the exported counters


class _FakeNC:
    is_connected = True


def test_router_metrics_endpoint_reads_heartbeats_and_hooks():
    from services.router.app import create_app
    from services.router.service import make_state
    from talaria.config import parse_config

    state = make_state(parse_config({"engines": [{"id": "e0", "models": ["m"]}]}))
    state.nc = _FakeNC()
    client = TestClient(create_app(state))
    state.on_heartbeat(snapshot(kv=0.5).SerializeToString())
    asyncio.run(state.on_completed(hook().SerializeToString()))
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = samples(r.text)
    assert s[("vllm:kv_cache_usage_perc", L)] == 0.5 and s[("vllm:num_requests_running", L)] == 2
    assert s[("vllm:generation_tokens_total", L)] == 5 and s[("vllm:time_to_first_token_seconds_count", L)] == 1


def test_engine_heartbeat_reports_its_kernels_to_router_health_and_its_own_metrics(synth_models):
    """A real CPU engine's snapshot carries which kernels it runs (issue 43 item 4); the router's /health
    shows them per instance, and the engine's own /metrics port serves them with its vLLM series."""
    import urllib.request

    from services.engine.executor import Engine
    from services.engine.model.paged_attn import load_extension
    from services.engine.service import EngineService
    from services.router.app import create_app
    from services.router.service import make_state
    from talaria.config import EngineConfig, StackConfig, parse_config

    eng = Engine(synth_models["tiny-llama"], page_size=4, num_pages=64, dtype="float32")
    svc = EngineService(StackConfig(), EngineConfig(id="e0", models=["tiny-llama"], metrics_port=0), eng)
    snap = svc.snapshot()
    kernels = {k.name: k.state for k in snap.kernels}
    built = load_extension() is not None
    assert set(kernels) == {"paged_decode", "fused_ops", "prefill_attention", "decode_gemm"}
    assert (kernels["paged_decode"] == "on") == built and (kernels["fused_ops"] == "on") == built
    assert kernels["prefill_attention"].startswith("off")  # a float32 model: ATen's flash kernel

    state = make_state(parse_config({"engines": [{"id": "e0", "models": ["tiny-llama"]}]}))
    state.nc = _FakeNC()
    state.on_heartbeat(snap.SerializeToString())
    health = TestClient(create_app(state)).get("/health").json()
    assert health["instances"]["e0"]["kernels"] == kernels

    port = svc.start_metrics_server()
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        svc.metrics_server[0].shutdown()
        svc.metrics_server[0].server_close()
    s = samples(text)
    assert s[("talaria_engine_kernel_on", (("engine", "e0"), ("kernel", "paged_decode")))] == float(built)
    assert s[("talaria_engine_kernel_on", (("engine", "e0"), ("kernel", "prefill_attention")))] == 0.0
    assert ("vllm:num_requests_running", (("engine", "e0"), ("model_name", "tiny-llama"))) in s


def test_engine_metrics_port_keeps_vllm_names_for_a_prometheus_2_scraper():
    """Prometheus 2.x asks for OpenMetrics without UTF-8 names; prometheus_client's own server then escapes
    ``vllm:num_requests_running`` to ``vllm_num_requests_running`` (seen for real: deploy/check's Prometheus
    had every engine series under underscore names). The engine's server always answers the text format."""
    import urllib.request

    from talaria.v1 import engine_pb2 as pb
    from talaria.vllm_metrics import ServingMetrics, serve_metrics

    m = ServingMetrics()
    m.observe_snapshot(pb.InstanceSnapshot(instance_id="e0", models=[pb.ModelState(model="tiny-llama", num_running=2)]))
    server, thread = serve_metrics(m.exposition, "127.0.0.1", 0)
    try:
        accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        req = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=5) as r:
            ctype, text = r.headers["Content-Type"], r.read().decode()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/other", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert ctype.startswith("text/plain; version=0.0.4")
    s = samples(text)
    assert s[("vllm:num_requests_running", (("engine", "e0"), ("model_name", "tiny-llama")))] == 2.0
    assert not any(name.startswith("vllm_") for name, _ in s)
