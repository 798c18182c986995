"""``talaria bench auth`` (issue 17): what API keys, resume tokens and tenant salting cost.

1. Router per-call latency, keys off vs keys on vs keys + a resume token, measured in one run with the
   configurations interleaved call by call: the real router app (``create_app``) over its ASGI interface,
   every call parsed, authenticated, its token verified (HMAC + decode; the token is expired so it is judged
   but installs nothing) and placed; the one instance is over its admission budget so placement answers 429
   without an engine — the same work for all three, so the difference is the auth/token cost. p50 and p90.
2. The two checks alone (``KeyRing.authenticate``, ``ResumeSigner.verify``): p50 per call in microseconds.
3. Prefix-cache hits within a tenant: one agent-like workload (sessions returning with growing prompts, a
   shared system prompt) on a real engine, open (tenant "") vs every call in one tenant: cached tokens
   must be identical (zero loss from salting); a second tenant replaying it gets no cross-tenant hit.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench import emit, ensure_models

KEY = "sk-bench-0123456789abcdef0123456789"


def _app(with_keys: bool):
    from fastapi.testclient import TestClient

    from services.router.app import create_app
    from services.router.auth import key_hash
    from services.router.service import make_state
    from talaria.config import parse_config
    from talaria.v1 import engine_pb2 as pb

    auth = {"api_keys": [{"sha256": key_hash(KEY), "tenant": "team-a"}], "resume_secret": "bench-secret-0123456789"} if with_keys else {"resume_secret": "bench-secret-0123456789"}
    cfg = parse_config({"router": {"auth": auth, "placement": {"admission_budget_s": 1.0, "lease_store": "memory"}}, "engines": [{"id": "e0", "models": ["m"]}]})
    state = make_state(cfg)

    class _NC:
        is_connected = True

    state.nc = _NC()
    snap = pb.InstanceSnapshot(instance_id="e0", epoch=1, seq=1, heartbeat_period_s=3600, num_waiting=500)
    snap.models.append(pb.ModelState(model="m", loaded=True, active=True, max_context=4096))
    state.gateway.on_snapshot(snap)
    return state, TestClient(create_app(state))


def _expired_token(tenant: str) -> str:
    from services.router.resume import ResumeClaim, ResumeSigner

    now = time.time()
    s = ResumeSigner(b"bench-secret-0123456789", time.time)
    return s.issue(ResumeClaim(tenant, f"{tenant}|agent-1" if tenant else "agent-1", "m", "e0", 1, "lease-1", 100, now - 60, now - 30))


def _http_latency(calls: int, warmup: int) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 32}], "max_tokens": 4}
    _, open_client = _app(False)
    _, keyed_client = _app(True)
    cases = {
        "open": (open_client, {"X-Session-ID": "agent-1"}),
        "api key": (keyed_client, {"X-Session-ID": "agent-1", "Authorization": f"Bearer {KEY}"}),
        "api key + resume token": (keyed_client, {"X-Session-ID": "agent-1", "Authorization": f"Bearer {KEY}", "X-Talaria-Resume-Token": _expired_token("team-a")}),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(warmup + calls):
        for name, (client, headers) in cases.items():  # interleaved: load drifts hit every case alike
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            dt = time.perf_counter() - t0
            if r.status_code != 429 or r.json()["error"]["code"] != "overloaded":
                raise RuntimeError(f"{name}: unexpected {r.status_code} {r.text[:200]}")
            if i >= warmup:
                samples[name].append(dt * 1e6)
    out = {k: {"p50_us": statistics.median(v), "p90_us": statistics.quantiles(v, n=10)[-1], "n": len(v)} for k, v in samples.items()}
    out["added_p50_us"] = {
        "api key": out["api key"]["p50_us"] - out["open"]["p50_us"],
        "resume token": out["api key + resume token"]["p50_us"] - out["api key"]["p50_us"],
    }
    return out


def _micro(n: int) -> dict[str, float]:
    from services.router.auth import KeyRing, key_hash
    from services.router.resume import ResumeClaim, ResumeSigner
    from talaria.config import ApiKeyConfig

    ring = KeyRing([ApiKeyConfig(sha256=key_hash(f"other-{i}"), tenant=f"t{i}") for i in range(999)] + [ApiKeyConfig(sha256=key_hash(KEY), tenant="team-a")], time.monotonic)
    signer = ResumeSigner(b"bench-secret-0123456789", time.time)
    now = time.time()
    tok = signer.issue(ResumeClaim("team-a", "team-a|agent-1", "m", "e0", 1, "lease-1", 100, now, now + 3600))
    header = f"Bearer {KEY}"

    def p50(fn) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        return statistics.median(ts) / 1e3

    return {
        "authenticate_us (1000 keys)": p50(lambda: ring.authenticate(header)),
        "verify_token_us": p50(lambda: signer.verify(tok, "team-a", "team-a|agent-1", "m")),
        "issue_token_us": p50(lambda: signer.issue(ResumeClaim("team-a", "team-a|agent-1", "m", "e0", 1, "lease-2", 100, now, now + 1))),
    }


def _hits(models_dir, model: str, say) -> dict[str, Any]:
    import torch

    from services.engine.executor import Engine
    from services.engine.types import EngineRequest, SamplingParams

    mdir = ensure_models(models_dir, [model], say=say)
    torch.set_num_threads(1)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    system = "you are a careful tool-using agent; tools: search(query), read(path), write(path, text). " * 3
    out: dict[str, Any] = {}
    for label, tenants in (("open", ("",)), ("one tenant", ("team-a",)), ("two tenants, same workload", ("team-a", "team-b"))):
        e = Engine(Path(mdir) / model, page_size=16, num_pages=2048)
        cached = prompt = 0
        per_tenant: dict[str, int] = {}
        for tenant in tenants:
            n = 0
            for s in range(4):
                hist = system + f"task {s}: find the file"
                for turn in range(4):
                    sid = f"{tenant}|s{s}" if tenant else f"s{s}"
                    toks = e.tokenizer.encode(hist)
                    e.add_request(EngineRequest(f"{tenant}-{s}-{turn}", toks, sp, session_id=sid, tenant=tenant))
                    while True:
                        done = [o for o in e.step() if o.finished]
                        if done:
                            u = done[0].usage
                            break
                    cached, prompt, n = cached + u.cached_tokens, prompt + u.prompt_tokens, n + u.cached_tokens
                    hist += f" observation {turn}: ok; next step {turn}"
            per_tenant[tenant or "-"] = n
        out[label] = {"cached_tokens": cached, "prompt_tokens": prompt, "hit_rate": cached / prompt, "cached_by_tenant": per_tenant}
    return out


def render(r: dict[str, Any]) -> str:
    h = r["http"]
    lines = [f"router per call (ASGI, {h['open']['n']} calls each, interleaved; loadavg {r['loadavg']})",
             f"{'configuration':<26}{'p50 us':>10}{'p90 us':>10}"]
    for k in ("open", "api key", "api key + resume token"):
        lines.append(f"{k:<26}{h[k]['p50_us']:>10.0f}{h[k]['p90_us']:>10.0f}")
    lines.append(f"added p50: api key {h['added_p50_us']['api key']:+.0f} us, resume token {h['added_p50_us']['resume token']:+.0f} us")
    lines.append("checks alone (p50): " + ", ".join(f"{k} {v:.1f}" for k, v in r["micro"].items()))
    if r.get("hits"):
        lines.append("prefix-cache hits (same workload):")
        for k, v in r["hits"].items():
            lines.append(f"  {k:<28} cached {v['cached_tokens']:>6} / {v['prompt_tokens']:>6} prompt tokens = {v['hit_rate']:.3f}  by tenant {v['cached_by_tenant']}")
    return "\n".join(lines)


def main(args) -> int:
    from bench import quiet_loggers

    with quiet_loggers("services.router.auth", "services.router.resume", "httpx", "httpx2"):
        result: dict[str, Any] = {"http": _http_latency(args.calls, args.warmup), "micro": _micro(2000)}
    if not args.no_hits:
        result["hits"] = _hits(args.models_dir, args.model, print)
    result["loadavg"] = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    return emit(result, render(result), args.json)
