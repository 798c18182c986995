"""Issue 17, tenant isolation of KV inside the engine (real executor, tiny synthesized model, CPU).

The tenant (set by the router from the API key, never by the client) salts the prefix-hash chain, so an
identical prompt of another tenant is a cache miss (no cross-tenant timing probe), while within a tenant
the hit count is exactly the one of an open (tenant-less) engine: salting costs no hits.
"""

from __future__ import annotations

import pytest

from services.engine.executor import Engine
from services.engine.types import EngineRequest, SamplingParams
from talaria.hashing import model_salt, page_hashes, tenant_salt
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PAGE = 4


@pytest.fixture(scope="module")
def llama(synth_models):
    return synth_models["tiny-llama"]


def run(engine: Engine, req: EngineRequest):
    engine.add_request(req)
    toks, final = [], None
    while final is None:
        for out in engine.step():
            toks += out.new_token_ids
            if out.finished:
                final = out
    engine.check_integrity()
    return toks, final.usage


def test_tenant_salt_is_the_model_salt_without_a_tenant_and_distinct_per_tenant():
    s = model_salt("m")
    assert tenant_salt(s, "") == s
    assert len({tenant_salt(s, t) for t in ("a", "b", "c")} | {s}) == 4
    assert tenant_salt(s, "a") == tenant_salt(s, "a")
    toks = list(range(32))
    assert not set(page_hashes(toks, PAGE, tenant_salt(s, "a"))) & set(page_hashes(toks, PAGE, tenant_salt(s, "b")))


def test_cross_tenant_probe_misses_while_the_owner_hits(llama):
    e = Engine(llama, page_size=PAGE, num_pages=256)
    p = e.tokenizer.encode("system: you are agent A with a private tool trace and secret plan " * 2)
    toks_a, u1 = run(e, EngineRequest("a1", p, GREEDY, session_id="team-a|S", tenant="team-a"))
    assert u1.cached_tokens == 0
    # tenant B: the same prompt, the same client-visible session id (scoped by its own tenant), no session
    toks_b, u2 = run(e, EngineRequest("b1", p, GREEDY, session_id="team-b|S", tenant="team-b"))
    toks_b2, u3 = run(e, EngineRequest("b2", p, GREEDY, tenant="team-b"))  # now B's own prefix is cached
    _, u4 = run(e, EngineRequest("a2", p, GREEDY, tenant="team-a"))  # A's own return hits its prefix
    assert u2.cached_tokens == 0, "tenant B must not hit tenant A's prefix"
    assert toks_b == toks_a and toks_b2 == toks_a  # isolation changes caching, never tokens
    assert u3.cached_tokens >= len(p) - PAGE and u4.cached_tokens >= len(p) - PAGE
    hashes = lambda t: set(page_hashes(p, PAGE, tenant_salt(e.salt, t)))  # what the kvstore is keyed by  # noqa: E731
    assert not hashes("team-a") & hashes("team-b")


def _workload(e: Engine):
    """Agent-like calls: two sessions returning with growing prompts, plus shared-system-prompt calls."""
    system = "you are a careful tool-using agent. tools: search, read, write. "
    calls = []
    for s in ("s1", "s2"):
        hist = system + f"task {s}: find the file"
        for turn in range(3):
            calls.append((s, e.tokenizer.encode(hist)))
            hist += f" observation {turn}: ok, next step {turn}"
    calls += [("", e.tokenizer.encode(system + f"one-off question {i}")) for i in range(3)]
    return calls


def test_salting_loses_no_hits_within_a_tenant(llama):
    """The same workload on an open engine (tenant "") and with every call in tenant "a": identical
    cached-token counts call by call (zero hit loss), identical tokens."""
    results = {}
    for tenant in ("", "team-a"):
        e = Engine(llama, page_size=PAGE, num_pages=512)
        out = []
        for i, (sid, prompt) in enumerate(_workload(e)):
            scoped = f"{tenant}|{sid}" if tenant and sid else sid
            toks, u = run(e, EngineRequest(f"r{i}", prompt, GREEDY, session_id=scoped, tenant=tenant))
            out.append((toks, u.cached_tokens, u.prompt_tokens))
        results[tenant] = out
    assert results[""] == results["team-a"]
    assert sum(c for _, c, _ in results[""]) > 0  # the workload does hit (the comparison is not vacuous)
