"""Cold engine: A→B→A token equality with fresh engines, bit-identical weights on every switch path, dirty
chunks never copied D2D, stable-address rebuilds, switch barriers, and the arena budget under random
switch/allocation sequences (property test)."""

from __future__ import annotations

import dataclasses
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.cold.engine import ColdEngine, ModelBusyError, UnknownModelError
from services.engine.executor import Engine
from services.engine.substrate.arena import ArenaBudgetError
from services.engine.substrate.staging import ChunkState
from services.engine.types import EngineRequest, SamplingParams
from tests.unit.engine_fixtures import stage_fully

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PAGE = 4
A, B, C = "tiny-llama", "tiny-qwen2", "tiny-qwen3"
CHUNK = 256 * 1024


def make_cold(synth_models, models=(A, B), **kw):
    kw.setdefault("page_size", PAGE)
    kw.setdefault("kv_cache_bytes", 40 << 20)  # room to stage a whole tiny model in the KV tail
    kw.setdefault("chunk_bytes", CHUNK)
    kw.setdefault("runtime_bytes", 64 * 1024)
    return ColdEngine({m: synth_models[m] for m in models}, **kw)


def weights_equal_bank(ce: ColdEngine) -> bool:
    e = ce.bank[ce.active]
    return torch.equal(ce.arena.bytes(0, e.nbytes), e.host)


@pytest.fixture(scope="module")
def prompts():
    return [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300, 400, 500], list(range(40, 71))]


@pytest.fixture(scope="module")
def fresh(synth_models, prompts):
    return {m: Engine(synth_models[m], page_size=PAGE, num_pages=128).generate(prompts, GREEDY) for m in (A, B)}


@pytest.fixture(scope="module")
def cold(synth_models):
    return make_cold(synth_models)


def test_a_b_a_tokens_equal_fresh_engines(cold, prompts, fresh):
    ce = cold
    for model in (A, B, A, B, A):
        assert ce.generate(prompts, GREEDY, model=model) == fresh[model]
        assert ce.active == model and weights_equal_bank(ce)
        ce.check_integrity()
    recs = list(ce.switch_records)
    assert [(r.from_model, r.to_model) for r in recs[-4:]] == [(A, B), (B, A), (A, B), (B, A)]
    for r in recs:
        assert r.staged_bytes + r.host_bytes == r.weight_bytes and len(r.phase_seconds) == 5
        assert r.total_seconds >= sum(r.phase_seconds) * 0.999
    assert recs[-1].kv_shell_reused and recs[-1].runtime_reused  # stable addresses: cached shell reused
    assert any(r.staged_bytes > 0 for r in recs[1:])  # the stager ran while the other model served
    st = ce.stats()
    assert {m.model: (m.loaded, m.active) for m in st.models} == {A: (True, True), B: (True, False)}
    assert st.num_switches == recs[-1].seq and recs[-1].to_model == A


def test_a_cold_call_is_validated_once(cold, prompts, monkeypatch):
    """The cold engine validates a call at its intake; its model's shell takes it as validated (no second check
    against the same limits on the executor thread)."""
    import services.engine.cold.engine as cold_mod
    import services.engine.executor as ex_mod

    seen: list[str] = []

    def counting(req, *a, **kw):
        seen.append(req.request_id)
        return ex_mod.validate_request.__wrapped__(req, *a, **kw)

    counting.__wrapped__ = ex_mod.validate_request
    monkeypatch.setattr(cold_mod, "validate_request", counting)
    monkeypatch.setattr(ex_mod, "validate_request", counting)
    cold.add_request(EngineRequest("once", list(prompts[0]), GREEDY, model=B))
    while cold.has_unfinished():
        cold.step()
    assert seen == ["once"]


def test_interleaved_calls_switch_when_idle(cold, prompts, fresh):
    ce = cold
    ids = {}
    for i, p in enumerate(prompts):
        for m in (A, B):
            rid = f"i{i}-{m}"
            ids[rid] = (m, i)
            ce.add_request(EngineRequest(rid, p, GREEDY, model=m))
    got = {rid: [] for rid in ids}
    left = set(ids)
    for _ in range(500):
        for o in ce.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                left.discard(o.request_id)
        if not left:
            break
    assert not left
    for rid, (m, i) in ids.items():
        assert got[rid] == fresh[m][i]


def test_every_switch_path_is_bit_identical_and_dirty_chunks_never_d2d(cold):
    ce = cold
    if ce.active != A:
        ce.switch_to(A)
    ce.substrate.area.discard()
    # host only: nothing staged
    r = ce.switch_to(B)
    assert r.path == "host_only" and r.staged_bytes == 0 and weights_equal_bank(ce)
    # full staged
    stage_fully(ce, A)
    r = ce.switch_to(A)
    assert r.path == "full_staged" and r.host_bytes == 0 and weights_equal_bank(ce)
    # partial: stage B, then allocate KV pages over part of the staged tail and scribble over them as a
    # forward pass would; those chunks must come from the bank, not from the (now garbage) staging copy
    stage_fully(ce, B)
    area, alloc = ce.substrate.area, ce.shell(A).kv.allocator
    top = area.slot_pages(0)
    pages = alloc.allocate(alloc.num_free)  # low ids first: reaches the staged tail last
    assert top.start in pages
    dirty = {i for (m, i), c in area.by_index.items() if m == B and c.state is ChunkState.DIRTY}
    clean = {i for (m, i), c in area.by_index.items() if m == B and c.state is ChunkState.CLEAN}
    assert dirty  # the allocation overlapped staged chunks
    for (m, i), c in area.by_index.items():
        if i in dirty and m == B:
            ce.arena.bytes(c.addr, c.addr + c.nbytes).fill_(0xAB)
    alloc.decref(pages)
    r = ce.switch_to(B)
    e = ce.bank[B]
    assert r.dirty_bytes == sum(e.chunk_range(i)[1] - e.chunk_range(i)[0] for i in dirty)
    assert r.staged_bytes == sum(e.chunk_range(i)[1] - e.chunk_range(i)[0] for i in clean)
    assert r.path == ("partial" if clean else "host_only")
    assert weights_equal_bank(ce)


def test_staged_tail_survives_real_serving(synth_models, prompts, fresh):
    """Serve A while B is staged: KV writes of A never corrupt clean staged chunks of B."""
    ce = make_cold(synth_models, kv_cache_bytes=24 << 20)
    stage_fully_or_partial = ce.substrate.stage(B, 1000)
    assert stage_fully_or_partial > 0
    ce.substrate.area.poll(wait=True)
    for _ in range(3):
        assert ce.generate(prompts, GREEDY, model=A) == fresh[A]
    ce.check_integrity()
    r = ce.switch_to(B)
    assert r.staged_bytes > 0 and weights_equal_bank(ce)
    assert ce.generate(prompts, GREEDY, model=B) == fresh[B]


def test_address_change_rebuilds_cached_state(synth_models, prompts, fresh):
    ce = make_cold(synth_models, staging=False)
    ce.generate(prompts[:1], GREEDY, model=A)
    ce.switch_to(B)
    ce.arena.set_runtime_bytes(128 * 1024)  # the runtime region moves: KV end and runtime base change
    r = ce.switch_to(A)
    assert not r.kv_shell_reused and not r.runtime_reused and r.path == "host_only"
    assert ce.generate(prompts, GREEDY, model=A) == fresh[A]
    r = ce.switch_to(B)
    assert not r.kv_shell_reused  # B's cached shell points at the old KV end as well
    r = ce.switch_to(A)
    assert r.kv_shell_reused and r.runtime_reused
    ce.check_integrity()


def test_barrier_runs_before_kv_release_and_open_close(synth_models):
    seen = []
    ce = make_cold(synth_models, models=(A, B, C))
    sid = "s1"
    ce.before_kv_release.append(lambda m: seen.append((m, ce.shell(m).kv.sessions.peek(sid) is not None)))
    ce.add_request(EngineRequest("r", [5, 6, 7, 8, 9, 10], GREEDY, session_id=sid, model=A))
    while ce.has_unfinished() and ce.stats().num_unfinished:
        ce.step()
    ce.open_model(C)  # already loaded: a request to make it active
    ce.step()
    assert ce.active == C and seen == [(A, True)]  # the barrier saw A's session KV before the release
    assert ce.shell(A).kv.sessions.peek(sid) is None  # released after the barrier
    ce.add_request(EngineRequest("q", [5, 6, 7], GREEDY, model=A))
    with pytest.raises(ModelBusyError):
        ce.close_model(A)
    while ce.stats().num_unfinished:
        ce.step()
    ce.close_model(B)
    assert ce.loaded == [A, C] and not ce.serves(B)
    with pytest.raises(UnknownModelError):
        ce.add_request(EngineRequest("x", [5, 6, 7], GREEDY, model=B))
    ce.open_model(B, activate=False)
    assert ce.serves(B) and ce.active == A


def test_budget_error_names_model_and_bytes(synth_models):
    with pytest.raises(ArenaBudgetError) as ei:
        make_cold(synth_models, arena_bytes=8 << 20)
    assert "tiny-" in str(ei.value) and "bytes" in str(ei.value)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("switch"), st.sampled_from([A, B, C])),
        st.tuples(st.just("stage"), st.sampled_from([A, B, C]), st.integers(1, 40)),
        st.tuples(st.just("alloc"), st.integers(1, 400)),
        st.tuples(st.just("free"), st.integers(0, 10)),
    ),
    min_size=5,
    max_size=25,
)


@pytest.fixture(scope="module")
def cold3(synth_models):
    return make_cold(synth_models, models=(A, B, C), kv_cache_bytes=24 << 20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_arena_budget_never_exceeded(cold3, ops):
    ce = cold3
    base, cap = ce.arena.buffer.data_ptr(), ce.arena.capacity
    held: list[list[int]] = []
    for op in ops:
        alloc = ce.shell(ce.active).kv.allocator
        if op[0] == "switch":
            for pages in held:
                alloc.decref(pages)
            held.clear()
            r = ce.switch_to(op[1])
            assert weights_equal_bank(ce) and r.staged_bytes + r.host_bytes == r.weight_bytes
        elif op[0] == "stage":
            ce.substrate.stage(op[1], op[2])
        elif op[0] == "alloc":
            n = min(op[1], alloc.num_free)
            if n:
                held.append(alloc.allocate(n))
        elif held:
            alloc.decref(held.pop(op[1] % len(held)))
        # invariants: one buffer, never reallocated; regions ordered inside it; staging consistent
        assert ce.arena.buffer.data_ptr() == base and ce.arena.buffer.numel() == cap
        ce.arena.check()
        lay = ce.arena.layout
        assert lay.model == ce.active and lay.weights_end == ce.bank[ce.active].nbytes
        eng = ce.shell(ce.active)
        kv0 = eng.kv_cache.k[0]
        assert kv0.data_ptr() >= base + lay.kv_start
        last = eng.kv_cache.v[-1]
        assert last.data_ptr() + last.numel() * last.element_size() <= base + lay.kv_end
        area = ce.substrate.area
        if area is not None:
            area.check(alloc.is_used)
            for c in area.chunks.values():
                assert base + lay.kv_start <= base + c.addr and c.addr + c.nbytes <= lay.kv_end
    for pages in held:
        ce.shell(ce.active).kv.allocator.decref(pages)


def _kernels(ce: ColdEngine, model: str) -> tuple[bool, bool]:
    m = ce.shell(model).model
    return m.paged_decode is not None, m.fused_ops is not None


def test_engine_config_kernels_reach_every_cold_shell_and_survive_a_rebind(synth_models, prompts, fresh):
    """``paged_decode`` / ``fused_ops`` of an engine's config reach a cold engine's shells (they were dropped:
    every cold model ran the eager ops whatever the config said), and a runtime rebind onto moved weights
    keeps them."""
    from services.engine.main import build_cold_engine
    from talaria.config import EngineConfig, StackConfig

    stack = StackConfig(models_dir=str(next(iter(synth_models.values())).parent))
    off = build_cold_engine(stack, EngineConfig(id="c", pool="cold", models=[A, B], paged_decode="off", fused_ops="off",
                                                prefill_attention="off", kv_cache_mb=8, lone_prefill_tokens=96))
    assert _kernels(off, A) == (False, False)
    assert off.shell(A).settings.prefill_attention == "off"  # every shell's Engine gets it (the kernel itself needs bf16, head dim 64)
    assert off._shells[A].engine.scheduler.lone_prefill_tokens == 96  # the scheduler of every shell too
    off.switch_to(B)
    assert _kernels(off, B) == (False, False)
    assert off._shells[B].engine.scheduler.lone_prefill_tokens == 96
    on = make_cold(synth_models, staging=False)
    assert _kernels(on, A) == (True, True)
    sh = on._shells[A]
    sh.addresses = dataclasses.replace(sh.addresses, runtime=sh.addresses.runtime + 1)  # as if the runtime region moved
    before = sh.engine.model
    assert on.restore_runtime(A) is False and sh.engine.model is not before  # rebound onto fresh parameter views
    assert _kernels(on, A) == (True, True)
    assert on.generate(prompts, GREEDY, model=A) == fresh[A]


def test_cold_engine_rejects_hot_only_options():
    from pydantic import ValidationError

    from talaria.config import EngineConfig

    with pytest.raises(ValidationError, match="compile is for hot engines"):
        EngineConfig(id="c", pool="cold", models=[A], compile="on")
    with pytest.raises(ValidationError, match="packed_weights is for hot engines"):
        EngineConfig(id="c", pool="cold", models=[A], packed_weights=True)
    with pytest.raises(ValidationError, match="weight_link_mb_s paces a cold engine"):
        EngineConfig(id="h", pool="hot", models=[A], weight_link_mb_s=10.0)
    with pytest.raises(ValidationError, match="weight_link_mb_s paces a cold engine"):
        EngineConfig(id="c", pool="cold", models=[A, B], weight_link_mb_s=10.0, partial_layers=True)
    assert EngineConfig(id="c", pool="cold", models=[A, B], weight_link_mb_s=10.0).weight_link_mb_s == 10.0


def test_cpu_engine_stops_staging_once_measured_switches_say_it_does_not_pay(synth_models):
    """Issue 12: on a CPU the stager's copies run on the serving cores and move the bytes a host-only switch
    moves, so once both switch paths are measured staging continues only if a staged switch saves more than
    that copy: measured here it never does, and the engine stops staging (it staged before, to measure)."""
    from talaria.switch_path import SwitchPath

    ce = make_cold(synth_models)
    assert ce.staging_pays()  # nothing measured yet: stage, to measure
    ce.costs.observe(SwitchPath.HOST_ONLY, 0.010)
    assert ce.staging_pays()
    ce.costs.observe(SwitchPath.FULL_STAGED, 0.004)  # saves 6 ms, the copy costs 10 ms of the same cores
    assert not ce.staging_pays()
    other = B if ce.active == A else A
    ce.substrate.area.discard()
    ce.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1), model=other))
    ce._drain_intake()  # queued for the inactive model: the staging target
    ce._stage()  # the executor's per-step staging turn
    ce.substrate.area.poll(wait=True)
    assert ce.substrate.staged_fraction(other) == 0.0


def test_a_paced_weight_link_makes_a_host_only_switch_take_bytes_over_bandwidth(synth_models):
    """A cold engine with ``weight_link_bytes_per_s``: a host-only switch moves the target's whole image over the
    link, so its record's H2D phase and total take at least bytes / bandwidth, and the switch cost the engine
    measures and reports (the heartbeat's profile, which the router prices from) carries that time. Without the
    link the same switch is a CPU memcpy of a few MB (milliseconds)."""
    from talaria.switch_path import SwitchPath

    nbytes = max(e.nbytes for e in (make_cold(synth_models, staging=False).bank[m] for m in (A, B)))
    bw = nbytes / 0.4  # a whole tiny model takes >= 0.4 s on the link
    ce = make_cold(synth_models, staging=False, weight_link_bytes_per_s=bw)
    other = B if ce.active == A else A
    ce.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1), model=other)
    rec = ce.switch_records[-1]
    assert (rec.to_model, rec.path, rec.host_bytes) == (other, SwitchPath.HOST_ONLY, ce.bank[other].nbytes)
    floor = rec.host_bytes / bw
    assert rec.h2d_seconds >= floor and rec.total_seconds >= floor > 0.2
    assert ce.stats().profile.switch_by_path[SwitchPath.HOST_ONLY] >= 0.5 * floor  # EWMA with the paced initial switch (a smaller model)


def test_engine_config_weight_link_reaches_the_cold_engines_copier(synth_models):
    """``engines[].weight_link_mb_s`` (MB/s, 10^6 bytes) becomes the cold engine's paced link; unset, none."""
    from services.engine.main import build_cold_engine
    from talaria.config import EngineConfig, StackConfig

    stack = StackConfig(models_dir=str(next(iter(synth_models.values())).parent))
    paced = build_cold_engine(stack, EngineConfig(id="c", pool="cold", models=[A, B], kv_cache_mb=8, weight_link_mb_s=250.0))
    assert paced.substrate.copier.link is not None and paced.substrate.copier.link.bytes_per_s == 250e6
    assert build_cold_engine(stack, EngineConfig(id="c", pool="cold", models=[A, B], kv_cache_mb=8)).substrate.copier.link is None


def test_weight_link_paces_host_copies_only_and_queues_transfers():
    """``WeightLink`` books transfers one after another at its bandwidth (injected clock); the copier paces a
    bank-sourced copy (switch-time ``copy`` + ``barrier``, staging ``submit``) and leaves a D2D copy alone."""
    import time

    from services.engine.substrate.copier import Copier, WeightLink

    now = [10.0]
    link = WeightLink(1000.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert link.reserve(500) == 10.5 and link.reserve(1000) == 11.5  # the second waits for the first
    now[0] = 20.0
    assert link.reserve(100) == 20.1  # an idle link starts at once
    link.wait_until(20.1)
    assert now[0] == pytest.approx(20.1)
    with pytest.raises(ValueError):
        WeightLink(0)

    src, dst = torch.ones(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    c = Copier("cpu", link=WeightLink(8 * (1 << 20)))  # 1 MiB takes 1/8 s
    t0 = time.monotonic()
    c.copy(dst, src)  # D2D: not on the link
    c.barrier()
    assert time.monotonic() - t0 < 0.1
    t0 = time.monotonic()
    c.copy(dst, src, from_host=True)
    c.barrier()
    assert time.monotonic() - t0 >= 0.125 and torch.equal(dst, src)
    dst.zero_()
    t0 = time.monotonic()
    c.submit(dst, src, from_host=True).sync()
    assert time.monotonic() - t0 >= 0.125 and torch.equal(dst, src)
    c.close()


def test_staging_pays_behind_a_paced_link_when_a_staged_switch_saves_more_than_its_memcpy(synth_models):
    """With a paced weight link the stager's link time passes on its own thread; the serving cores pay only the
    memcpy (a staged switch's D2D copy measures it), so a 1 s host-only switch against a 4 ms staged one keeps
    staging on. Without a link the same costs stop it (the copy would cost the cores the host-only time)."""
    from talaria.switch_path import SwitchPath

    for link, pays in ((None, False), (1e9, True)):
        ce = make_cold(synth_models, staging=False, weight_link_bytes_per_s=link)
        ce.costs.observe(SwitchPath.HOST_ONLY, 1.0)
        ce.costs.observe(SwitchPath.FULL_STAGED, 0.004)
        assert ce.staging_pays() is pays
