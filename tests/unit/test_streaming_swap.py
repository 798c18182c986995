"""Partial-layer residency and streaming hot-swap (issue 16, JointServe §4.3-4.4): k* from measured costs,
the transfer scheduler's priorities / chunk-boundary preemption / κ-floor, and on the real cold engine a layer
group never runs before its own copy completed (artificially slow copier) with tokens identical to a fully
resident run for every synthesized architecture."""

from __future__ import annotations

import threading
import time

import pytest

from services.engine.cold.engine import ColdEngine
from services.engine.executor import Engine
from services.engine.streaming_swap import startup_prefix, stream_copy
from services.engine.substrate.groups import layer_groups
from services.engine.substrate.transfer import TrafficClass, TransferQueue, TransferScheduler, TransferTicket
from services.engine.types import EngineRequest, SamplingParams
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture

ARCHS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


# ------------------------------------------------------------------ k* (pure)
def test_startup_prefix_is_the_smallest_that_never_stalls():
    # equal copy and compute per group: group j (j >= k) lands at (j-k+1)*c, compute reaches it at j*c
    assert startup_prefix([1.0] * 4, [1.0] * 4) == 1
    # copies twice as slow as compute: need half the model resident first
    assert startup_prefix([2.0] * 4, [1.0] * 4) == 3  # k=3: group 3 lands at 2 <= 3
    assert startup_prefix([5.0] * 4, [0.1] * 4) == 4  # nothing can hide: load all
    assert startup_prefix([0.0] * 3, [0.0] * 3) == 1
    assert startup_prefix([0.1, 3.0, 0.1], [1.0, 5.0, 1.0]) == 2
    with pytest.raises(ValueError):
        startup_prefix([1.0], [1.0, 2.0])


# ------------------------------------------------------------------ the transfer queue (pure)
def _chunks(n, size=100, tag=""):
    return [(size, f"{tag}{i}") for i in range(n)]


def test_priority_and_preemption_at_chunk_boundaries():
    q = TransferQueue(kappa=0.0)
    q.submit(TrafficClass.STREAM, _chunks(3, tag="s"), TransferTicket(3))
    assert q.pick()[2] == "s0"
    q.submit(TrafficClass.PREFETCH, _chunks(2, tag="p"), TransferTicket(2))  # arrives mid-stream
    assert [q.pick()[2] for _ in range(4)] == ["p0", "p1", "s1", "s2"]
    assert q.pick() is None


def test_kappa_floor_keeps_kv_restores_moving_under_a_weight_burst():
    q = TransferQueue(kappa=0.25, window_bytes=10_000)
    q.submit(TrafficClass.PREFETCH, _chunks(40, tag="w"), TransferTicket(40))
    q.submit(TrafficClass.KV, _chunks(10, tag="k"), TransferTicket(10))
    order = [q.pick()[2] for _ in range(20)]
    kv = sum(1 for x in order if x.startswith("k"))
    assert kv >= 0.25 * 20 - 1 and order[0] == "w0"  # a floor, served between weight chunks
    assert q.floor_picks == kv
    q2 = TransferQueue(kappa=0.25)
    q2.submit(TrafficClass.KV, _chunks(2, tag="k"), TransferTicket(2))
    assert [q2.pick()[2] for _ in range(2)] == ["k0", "k1"]  # alone, KV takes the whole channel
    with pytest.raises(ValueError):
        TransferQueue(kappa=1.0)


def test_scheduler_serves_chunks_in_queue_order_and_tickets_complete():
    log, gate = [], threading.Event()

    def copy(p):
        gate.wait()
        log.append(p)

    ts = TransferScheduler(TransferQueue(kappa=0.2, window_bytes=1000), copy_fn=copy)
    try:
        w = ts.submit(TrafficClass.STREAM, _chunks(8, tag="s"), "weights")
        k = ts.submit(TrafficClass.KV, _chunks(2, tag="k"), "kv")
        gate.set()
        k.sync()
        w.sync()
        assert w.done() and k.done() and log.index("k1") < log.index("s7")  # KV did not wait for the burst
        ts.drain()
        assert ts.stats.bytes_by_class["KV"] == 200 and ts.stats.chunks == 10
    finally:
        ts.close()


# ------------------------------------------------------------------ the real cold engine
def slow_copy(log):
    def copy(p):
        time.sleep(0.002)  # an artificially slow channel: copies lag the forward
        stream_copy(p)
    return copy


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_groups_run_only_after_their_copy_and_tokens_match(synth_models, arch):
    log: list = []
    other = "tiny-llama" if arch != "tiny-llama" else "tiny-qwen2"
    ts = TransferScheduler(copy_fn=slow_copy(log))
    ce = ColdEngine({other: synth_models[other], arch: synth_models[arch]}, page_size=4, kv_cache_bytes=8 << 20,
                    chunk_bytes=128 * 1024, runtime_bytes=64 * 1024, staging=False, partial_layers=True, transfer=ts,
                    initial=other)
    try:
        ce.streamer.log = log
        ce.streamer.plan_k = lambda m: 1  # stream everything after the first group (the mechanism under test)
        prompt = [5, 6, 7, 8, 9, 10, 11]
        ref = Engine(synth_models[arch], page_size=4, num_pages=256).generate([prompt], GREEDY)[0]
        log.clear()
        got = ce.generate([prompt], GREEDY, model=arch)[0]
        assert got == ref
        groups = layer_groups(ce.bank[arch])
        first_run = {}
        last_copy = {}
        for i, ev in enumerate(log):
            if ev[0] == "run" and ev[1] == arch:
                first_run.setdefault(ev[2], i)
            elif ev[0] == "copied" and ev[1] == arch:
                last_copy[ev[2]] = i
        streamed = set(range(1, len(groups)))
        assert set(last_copy) == streamed  # groups >= k* were streamed, group 0 was copied in the switch
        for g in streamed:
            assert last_copy[g] < first_run[g], f"group {g} ran before its copy completed"
        assert ce.shell(arch).model.layer_gate is None  # whole model resident: the gate detached
        st = ce.streamer.snapshot()
        assert st["streams"] >= 1 and st["k"][arch] == 1 and st["bytes_by_class"]["STREAM"] > 0
        # switching back and forth again: the barrier finishes streams, outputs stay identical
        assert ce.generate([prompt], GREEDY, model=other)[0] == Engine(synth_models[other], page_size=4, num_pages=256).generate([prompt], GREEDY)[0]
        assert ce.generate([prompt], GREEDY, model=arch)[0] == ref
        ce.check_integrity()
    finally:
        ts.close()


def test_a_failed_stream_copy_fails_the_call_not_the_engine(synth_models):
    def broken(p):
        if len(p) > 2 and p[4] >= 2:
            raise RuntimeError("copy failed")
        stream_copy(p)

    ts = TransferScheduler(copy_fn=broken)
    ce = ColdEngine({m: synth_models[m] for m in ("tiny-llama", "tiny-qwen2")}, page_size=4, kv_cache_bytes=8 << 20,
                    chunk_bytes=128 * 1024, runtime_bytes=64 * 1024, staging=False, partial_layers=True, transfer=ts)
    try:
        ce.streamer.plan_k = lambda m: 1
        with pytest.raises(RuntimeError, match="copy failed"):
            ce.generate([[5, 6, 7]], GREEDY, model="tiny-qwen2")
    finally:
        ts.close()


def test_unified_residency_and_streaming_together_keep_outputs(synth_models):
    """A plan stages a prefix of the next model's groups; at the switch they move device-to-device and the
    rest streams; outputs equal fully resident runs."""
    from services.engine.cold.residency import ResidencyDriver

    models = ("tiny-llama", "tiny-qwen3")
    ts = TransferScheduler(copy_fn=slow_copy([]))
    ce = ColdEngine({m: synth_models[m] for m in models}, page_size=4, kv_cache_bytes=24 << 20, chunk_bytes=128 * 1024,
                    runtime_bytes=64 * 1024, partial_layers=True, transfer=ts,
                    residency=ResidencyDriver(every_steps=1, chunks_per_step=64, budget_fraction=0.4))
    try:
        ce.streamer.plan_k = lambda m: 1
        prompt = [5, 6, 7, 8, 9, 10, 11]
        refs = {m: Engine(synth_models[m], page_size=4, num_pages=256).generate([prompt], GREEDY)[0] for m in models}
        for m in (models[1], models[0], models[1]):
            ce.add_request(EngineRequest(f"r-{m}-{len(ce.switch_records)}", list(prompt), GREEDY, model=m))
            got = []
            while ce.has_unfinished():
                for o in ce.step():
                    got += o.new_token_ids
            assert got == refs[m]
        assert ce.switch_records[-1].staged_bytes > 0  # the plan kept a staged prefix of the returning model
        assert ce.streamer.snapshot()["streams"] >= 2
        ce.check_integrity()
    finally:
        ts.close()
