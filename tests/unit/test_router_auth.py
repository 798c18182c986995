"""Issue 17, API keys at the router: 401 / 403 / 429 with OpenAI error bodies, open paths by config, keys
never logged or echoed, tenant-scoped session ids. The real router app (FastAPI) over its ASGI interface;
no engine: a call that passes auth reaches placement, which answers 429 "overloaded" from the snapshot."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from services.router.auth import KeyRing, TokenBucket, key_hash, scope_session
from talaria.clock import ManualClock
from talaria.config import ConfigError, parse_config
from talaria.v1 import engine_pb2 as pb

KEY_A, KEY_B, KEY_LIMITED = "sk-tenant-a-0123456789abcdef", "sk-tenant-b-0123456789abcdef", "sk-limited-0123456789abcdef"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class _FakeNC:
    is_connected = True


def _app(auth: dict | None = None, open_health: bool = True):
    from services.router.app import create_app
    from services.router.service import make_state

    keys = [
        {"sha256": key_hash(KEY_A), "tenant": "team-a"},
        {"sha256": key_hash(KEY_B), "tenant": "team-b", "models": ["other"]},
        {"sha256": key_hash(KEY_LIMITED), "tenant": "team-c", "rate_limit_rpm": 6},
    ]
    auth = {"api_keys": keys, "open_health": open_health} if auth is None else auth
    cfg = parse_config({"router": {"auth": auth, "placement": {"admission_budget_s": 1.0}}, "engines": [{"id": "e0", "models": ["m"]}]})
    state = make_state(cfg)
    state.nc = _FakeNC()
    snap = pb.InstanceSnapshot(instance_id="e0", epoch=1, seq=1, heartbeat_period_s=30, num_waiting=500)  # overloaded
    snap.models.append(pb.ModelState(model="m", loaded=True, active=True, max_context=4096))
    state.gateway.on_snapshot(snap)
    client = TestClient(create_app(state))
    state.keyring.clock = ManualClock(100.0).now  # rate limits do not refill while a test runs
    return state, client


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _assert_openai_error(r, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")


def test_missing_or_wrong_key_is_401_and_the_key_is_never_echoed_or_logged(caplog):
    state, client = _app()
    caplog.set_level(logging.DEBUG)
    _assert_openai_error(client.post("/v1/chat/completions", json=BODY), 401, "missing_api_key")
    wrong = "sk-wrong-key-that-is-secret-42"
    r = client.post("/v1/chat/completions", json=BODY, headers=_bearer(wrong))
    _assert_openai_error(r, 401, "invalid_api_key")
    _assert_openai_error(client.post("/v1/chat/completions", json=BODY, headers={"Authorization": f"Basic {KEY_A}"}), 401, "invalid_api_key")
    _assert_openai_error(client.get("/v1/models"), 401, "missing_api_key")
    r_ok = client.post("/v1/chat/completions", json=BODY, headers=_bearer(KEY_A))
    assert r_ok.status_code == 429 and r_ok.json()["error"]["code"] == "overloaded"  # passed auth, reached placement
    for secret in (wrong, KEY_A):
        assert secret not in r.text + r_ok.text
        assert secret not in caplog.text
    assert state.counters["auth_401"] == 4


def test_key_not_allowed_a_model_is_403():
    _, client = _app()
    assert [m["id"] for m in client.get("/v1/models", headers=_bearer(KEY_A)).json()["data"]] == ["m"]
    assert client.get("/v1/models", headers=_bearer(KEY_B)).json()["data"] == []  # B may call only "other"
    r = client.post("/v1/chat/completions", json=BODY, headers=_bearer(KEY_B))
    _assert_openai_error(r, 403, "model_not_allowed")
    assert r.json()["error"]["param"] == "model"
    # the same model with a key that has no allow-list passes auth
    assert client.post("/v1/chat/completions", json=BODY, headers=_bearer(KEY_A)).json()["error"]["code"] == "overloaded"


def test_rate_limited_key_gets_429_with_retry_after():
    _, client = _app()
    codes = [client.post("/v1/chat/completions", json=BODY, headers=_bearer(KEY_LIMITED)).json()["error"]["code"] for _ in range(2)]
    assert codes == ["overloaded", "rate_limit_exceeded"]  # burst = 6 rpm / 6 = 1 call
    r = client.post("/v1/chat/completions", json=BODY, headers=_bearer(KEY_LIMITED))
    _assert_openai_error(r, 429, "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1
    # another key is not affected
    assert client.post("/v1/chat/completions", json=BODY, headers=_bearer(KEY_A)).json()["error"]["code"] == "overloaded"


@pytest.mark.parametrize("open_health", [True, False])
def test_health_and_metrics_open_or_keyed_by_config(open_health):
    _, client = _app(open_health=open_health)
    for path in ("/health", "/ready", "/router/metrics", "/metrics"):
        r = client.get(path)
        assert (r.status_code != 401) == open_health, path
        assert client.get(path, headers=_bearer(KEY_A)).status_code != 401
    assert client.get("/router/decisions").status_code == 401  # names sessions: never open with keys
    assert client.get("/router/decisions", headers=_bearer(KEY_A)).status_code == 200


def test_no_keys_means_open_and_says_so(caplog):
    caplog.set_level(logging.WARNING)
    _, client = _app(auth={})
    assert "open to anyone" in caplog.text
    assert client.post("/v1/chat/completions", json=BODY).json()["error"]["code"] == "overloaded"


def test_sessions_are_scoped_by_the_keys_tenant():
    state, client = _app()
    seen: list[str] = []
    real = state.gateway.request
    state.gateway.request = lambda sid, *a: seen.append(sid) or real(sid, *a)
    client.post("/v1/chat/completions", json=BODY, headers={**_bearer(KEY_A), "X-Session-ID": "agent-1"})
    client.post("/v1/chat/completions", json={**BODY, "model": "other"}, headers={**_bearer(KEY_B), "X-Session-ID": "agent-1"})
    assert seen == ["team-a|agent-1", "team-b|agent-1"]
    assert scope_session("", "agent-1") == "agent-1" and scope_session("t", "") == ""


def test_token_bucket_refills_with_the_injected_clock():
    b = TokenBucket(rate_per_s=1.0, burst=2.0)
    assert [b.take(0.0), b.take(0.0)] == [0.0, 0.0]
    assert b.take(0.0) == pytest.approx(1.0)
    assert b.take(0.5) == pytest.approx(0.5)
    assert b.take(1.0) == 0.0


def test_config_rejects_bad_keys_and_tenants():
    with pytest.raises(ConfigError, match="sha256"):
        parse_config({"router": {"auth": {"api_keys": [{"sha256": "not-a-hash", "tenant": "t"}]}}})
    with pytest.raises(ConfigError, match="tenant"):
        parse_config({"router": {"auth": {"api_keys": [{"sha256": key_hash("k"), "tenant": "a|b"}]}}})
    ring = KeyRing([], ManualClock().now)
    assert not ring.enabled and ring.authenticate(None).tenant == ""


def test_cli_api_key_flag_stores_only_the_hash():
    from talaria.cli import _with_api_key
    from talaria.config import StackConfig

    cfg = _with_api_key(StackConfig(), "sk-from-the-command-line-123")
    (k,) = cfg.router.auth.api_keys
    assert k.sha256 == key_hash("sk-from-the-command-line-123") and k.tenant == "default"
    assert "sk-from-the-command-line-123" not in cfg.model_dump_json()
