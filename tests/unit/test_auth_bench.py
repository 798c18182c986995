"""Smoke test of ``talaria bench auth`` (issue 17): the three router configurations answer the same way and
the result has every number the report prints."""

from __future__ import annotations

from bench.auth_bench import _http_latency, _micro, render


def test_auth_bench_runs_and_renders():
    r = {"http": _http_latency(calls=4, warmup=1), "micro": _micro(20), "loadavg": ["0", "0", "0"]}
    assert set(r["http"]["added_p50_us"]) == {"api key", "resume token"}
    assert all(r["http"][k]["n"] == 4 for k in ("open", "api key", "api key + resume token"))
    assert all(v > 0 for v in r["micro"].values())
    assert "added p50" in render(r)
