"""Issue 17 end to end on a real local stack (nats-server with generated credentials, kvstore with a generated
token, an engine process, the router with API keys for three tenants), through the official openai client:
401/403, tenant isolation of sessions, leases and KV, signed resume tokens, engine fencing, NATS auth."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
import uuid
from pathlib import Path

import httpx
import nats
import openai
import pytest

from services.router.auth import key_hash
from services.router.leases import lease_key
from services.router.resume import HEADER, ResumeClaim, ResumeSigner
from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb
from tests.integration.conftest import engine, stack_config, start_stack, wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
KEY_A, KEY_B, KEY_C = "sk-a-" + uuid.uuid4().hex, "sk-b-" + uuid.uuid4().hex, "sk-c-" + uuid.uuid4().hex
PROMPT = "You are agent A. Private plan: open the vault with the tool, then report the contents. " * 4


@pytest.fixture(scope="module")
def stack(models_dir, tmp_path_factory):
    keys = [
        {"sha256": key_hash(KEY_A), "tenant": "team-a"},
        {"sha256": key_hash(KEY_B), "tenant": "team-b"},
        {"sha256": key_hash(KEY_C), "tenant": "team-c", "models": ["tiny-qwen2"]},
    ]
    cfg = stack_config(
        models_dir, [engine("e0", MODEL, page_size=16)],
        kvstore={"enabled": True, "capacity_mb": 32, "slab_kb": 32, "retry_after_s": 0.3, "rpc_timeout_s": 2.0},
        auth={"api_keys": keys}, placement={"lease_ttl_s": 60.0},
    )
    cfg["telemetry"] = {"traces_dir": str(tmp_path_factory.mktemp("sec") / "traces"), "port": 0}  # spans are checked for secrets
    s = start_stack(cfg)  # polls /health, which stays open (router.auth.open_health defaults to true)
    yield s
    s.stop()


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.api}/v1", api_key=key, max_retries=0, timeout=60)


def chat(stack, key: str, session: str, content: str = PROMPT, token: str | None = None):
    headers = {"X-Session-ID": session}
    if token:
        headers[HEADER] = token
    return client(stack, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0, extra_headers=headers,
    )


def metrics(stack) -> dict:
    return httpx.get(f"{stack.api}/router/metrics", timeout=5).json()["placement"]


def counters(stack) -> dict:
    return httpx.get(f"{stack.api}/health", timeout=5).json()["counters"]


def last_decision(stack, session: str) -> dict:
    ds = httpx.get(f"{stack.api}/router/decisions", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=5).json()["decisions"]
    return [d for d in ds if d["session_id"] == session][-1]


def test_missing_wrong_and_not_allowed_keys(stack):
    r = httpx.post(f"{stack.api}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    bad = "sk-wrong-" + uuid.uuid4().hex
    with pytest.raises(openai.AuthenticationError) as e:
        client(stack, bad).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key" and bad not in str(e.value.body)
    with pytest.raises(openai.PermissionDeniedError) as e:
        chat(stack, KEY_C, "c-1")
    assert e.value.status_code == 403 and e.value.body["code"] == "model_not_allowed"
    r = chat(stack, KEY_A, "a-smoke", "hello").parse()
    assert r.usage.completion_tokens >= 1


def test_other_tenant_reusing_a_session_id_gets_no_lease_no_session_and_no_cached_tokens(stack):
    r1 = chat(stack, KEY_A, "shared")
    assert r1.parse().usage.prompt_tokens > 64
    wait_until(lambda: last_decision(stack, "team-a|shared") and metrics(stack)["leases_installed"] >= 1 and metrics(stack)["leases_live"] >= 1)
    returns = metrics(stack)["returns"]
    rb = chat(stack, KEY_B, "shared")  # same X-Session-ID, identical prompt
    b = rb.parse()
    assert b.usage.prompt_tokens_details.cached_tokens == 0, "tenant B hit tenant A's KV"
    assert rb.headers["x-talaria-placement"] != "lease"
    d = last_decision(stack, "team-b|shared")
    assert d["lease"] == "none"
    assert metrics(stack)["returns"] == returns  # B had no session entry: not a return
    ra = chat(stack, KEY_A, "shared")  # A's own return hits its KV and its lease
    a = ra.parse()
    assert a.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens - 16
    assert ra.headers["x-talaria-placement"] == "lease"
    assert a.choices[0].message.content == b.choices[0].message.content  # isolation never changes tokens


async def test_resume_token_honoured_alone_and_bad_tokens_ignored(stack):
    r1 = chat(stack, KEY_A, "resume-1")
    token = r1.headers[HEADER]
    assert token and KEY_A not in token
    key = lease_key("team-a|resume-1", MODEL)
    wait_until(lambda: metrics(stack)["leases_live"] >= 1 and last_decision(stack, "team-a|resume-1"))
    # The shared store loses the lease (a partition, a slow replica): delete it; the router's mirror follows.
    nc = await connect(stack.nats_url, "test-store")
    try:
        kv = await nc.jetstream().key_value(Subjects(stack.cfg.namespace).lease_bucket())
        deadline = time.monotonic() + 20
        while True:
            try:
                await kv.get(key)
                break
            except Exception:  # noqa: BLE001 - the hook's lease not installed yet
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        await kv.purge(key)
    finally:
        await nc.drain()
    before = counters(stack)
    r2 = chat(stack, KEY_A, "resume-1", token=token)
    assert r2.headers["x-talaria-placement"] == "lease"  # honoured from the token alone
    after = counters(stack)
    assert after.get("resume_token_ok", 0) == before.get("resume_token_ok", 0) + 1
    assert after.get("resume_token_installed", 0) == before.get("resume_token_installed", 0) + 1
    # replaying it, forging it, another tenant presenting it, an expired one: ignored and counted
    secret = stack.secret_env["TALARIA__ROUTER__AUTH__RESUME_SECRET"].encode()
    now = time.time()
    expired = ResumeSigner(secret, time.time).issue(ResumeClaim("team-a", "team-a|resume-2", MODEL, "e0", 1, "x", 10, now - 100, now - 50))
    forged = ResumeSigner(b"not-the-stack-secret-000000", time.time).issue(ResumeClaim("team-a", "team-a|resume-2", MODEL, "e0", 1, "y", 10, now, now + 60))
    cases = [(KEY_A, "resume-1", token, "replayed"), (KEY_A, "resume-2", forged, "forged"), (KEY_A, "resume-2", expired, "expired"), (KEY_B, "resume-1", token, "wrong_tenant")]
    for k, session, tok, outcome in cases:
        before = counters(stack).get(f"resume_token_{outcome}", 0)
        r = chat(stack, k, session, token=tok)
        assert r.parse().usage.completion_tokens >= 1  # normal placement, the call is served
        assert counters(stack).get(f"resume_token_{outcome}", 0) == before + 1, outcome


async def test_engine_refuses_a_resume_from_an_older_epoch(stack):
    nc = await connect(stack.nats_url, "test-fence")
    subj = Subjects(stack.cfg.namespace)
    try:
        hb = await nc.subscribe(subj.heartbeat("e0"))
        epoch = pb.InstanceSnapshot.FromString((await hb.next_msg(10)).data).epoch
        await hb.unsubscribe()

        async def first_chunk(resume_epoch: int) -> pb.TokenChunk:
            req = pb.GenerateRequest(
                schema_version=1, request_id=uuid.uuid4().hex, session_id="team-a|fence", tenant="team-a", model=MODEL,
                text="fencing", sampling=pb.SamplingParams(temperature=0, max_tokens=2), resume_epoch=resume_epoch,
            )
            msg = await nc.request(subj.generate("e0"), req.SerializeToString(), timeout=30)
            return pb.TokenChunk.FromString(msg.data)

        old = await first_chunk(epoch - 1)
        assert old.HasField("error") and (old.error.code, old.error.http_status) == ("resume_fenced", 503)
        cur = await first_chunk(epoch)
        assert cur.accepted and not cur.HasField("error")
    finally:
        await nc.drain()


async def test_unauthenticated_nats_client_is_refused_and_no_secret_is_on_disk_or_in_logs(stack):
    plain = stack.cfg.nats.url
    assert "@" not in plain
    for kw in ({}, {"user": "talaria", "password": "wrong-password"}):
        with pytest.raises(Exception, match="Authorization"):
            await nats.connect(plain, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, **kw)
    # the stack's own credentials work (and can publish on engine subjects)
    nc = await connect(stack.nats_url, "test-authed")
    await nc.publish(Subjects(stack.cfg.namespace).cancel("e0"), pb.CancelRequest(schema_version=1, request_id="none").SerializeToString())
    await nc.flush()
    await nc.drain()
    secrets = [v for k, v in stack.secret_env.items() if "PASSWORD" in k or "TOKEN" in k or "SECRET" in k]
    assert len(secrets) == 3
    conf = Path(stack.nats.conf_file)
    assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
    on_disk = conf.read_text() + stack.cfg_path.read_text()
    logs = "\n".join(line for c in stack.children.values() for line in c.log)
    traces_dir = Path(stack.cfg.telemetry.traces_dir)
    read_spans = lambda: "".join(f.read_text(errors="replace") for f in traces_dir.glob("*.jsonl*"))  # noqa: E731
    spans = wait_until(lambda: (t := read_spans()) and "team-a|shared" in t and t)  # the calls' spans were written
    for s in secrets + [KEY_A, KEY_B, KEY_C]:
        assert s not in on_disk and s not in logs and s not in spans
    assert json.loads(stack.cfg_path.read_text())["nats"]["password"] is None
