"""Memory substrate: arena budget, bank layout, staging fences/dirty marking, policies (CPU)."""

from __future__ import annotations

import pytest
import torch

from services.engine.substrate.arena import Arena, ArenaBudgetError
from services.engine.substrate.bank import WeightBank, bind_model
from services.engine.substrate.policy import EngineView, IdleSwitchRule, classify_path, plan_staging, predict_next
from talaria.switch_path import SwitchCostModel
from services.engine.substrate.staging import ChunkState, KVGeometry, StagingArea, StagingAwareAllocator


def test_arena_layout_and_budget_error():
    a = Arena(1 << 20, runtime_bytes=4096, min_kv_bytes=8192)
    base = a.buffer.data_ptr()
    lay = a.set_weights("m1", 1000)
    assert lay.kv_start == 1024 and lay.kv_end == a.capacity - 4096
    a.check()
    with pytest.raises(ArenaBudgetError) as ei:
        a.plan("big-model", 1 << 20)
    msg = str(ei.value)
    assert "big-model" in msg and str((1 << 20) + 8192 + 4096) in msg and str(a.capacity) in msg
    assert a.layout == lay  # a failed plan changed nothing
    a.set_weights("m2", 5000)
    assert a.buffer.data_ptr() == base and a.buffer.numel() == a.capacity  # never reallocated
    before = a.base_addresses()
    a.set_runtime_bytes(8192)
    assert a.base_addresses()["runtime"] != before["runtime"] and a.layout.kv_end == a.runtime_start
    v = a.view(a.layout.kv_start, (4, 8), torch.float32)
    assert v.data_ptr() == base + a.layout.kv_start


def test_bank_image_matches_loader_and_binds_views(synth_models):
    bank = WeightBank(chunk_bytes=64 * 1024, pin=False)
    e = bank.load("tiny-qwen2", synth_models["tiny-qwen2"])
    assert bank.load("tiny-qwen2", synth_models["tiny-qwen2"]) is e  # loaded once
    assert e.num_chunks == -(-e.nbytes // e.chunk_bytes) and e.chunk_range(e.num_chunks - 1)[1] == e.nbytes
    region = torch.zeros(e.nbytes + 4096, dtype=torch.uint8)
    region[: e.nbytes].copy_(e.host)
    model = bind_model(e, region)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays tied (stored once)
    for name, p in model.named_parameters():
        spec = next(s for s in e.specs if s.name == name)
        assert p.data_ptr() == region.data_ptr() + spec.offset  # a view, not a copy
    from services.engine.model.loader import load_model

    ref, _ = load_model(synth_models["tiny-qwen2"])
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), ref.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


class _Ticket:
    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished

    def sync(self):
        self.finished = True


def _area(num_pages=64, blocks=4, seg=256, chunk=512):
    return StagingArea(KVGeometry(kv_start=0, num_pages=num_pages, num_blocks=blocks, seg_bytes=seg), chunk)


def test_staging_slots_fill_the_tail_of_every_block():
    a = _area()
    assert a.k == 2 and a.num_slots == 4 * 32
    assert [a.slot_pages(s) for s in range(5)] == [range(62, 64)] * 4 + [range(60, 62)]
    assert [a.slot_addr(s) for s in range(4)] == [b * 64 * 256 + 62 * 256 for b in range(4)]
    assert list(a.slots_of_page(63)) == [0, 1, 2, 3] and list(a.slots_of_page(60)) == [4, 5, 6, 7]


def test_free_slot_scan_stops_at_its_limit():
    """The stager's scan runs at every step boundary: with a limit it returns the first slots of the full
    (top-first) scan and looks at no more slots than it needs."""
    a = _area()
    looked: list[int] = []

    def used(p: int) -> bool:
        looked.append(p)
        return p in (63, 62)  # the top level is taken by KV

    full = a.free_slots(used, 0)
    looked.clear()
    first = a.free_slots(used, 0, limit=3)
    assert first == full[:3] == [4, 5, 6]
    assert len(looked) <= 2 * (4 + 3)  # the taken level's 4 slots and the 3 found, 2 pages each
    assert a.free_slots(used, 0, limit=0) == []


def test_allocator_skips_fenced_pages_and_marks_dirty():
    alloc = StagingAwareAllocator(8)
    a = _area(num_pages=8, blocks=2, seg=256, chunk=512)  # slots of 2 pages
    alloc.area = a
    t = _Ticket()
    a.stage("B", 0, 0, 512, lambda addr: t)  # pages 6, 7 fenced while writing
    assert alloc.num_free == 6 and not alloc.can_allocate(7)
    got = alloc.allocate(6)
    assert sorted(got) == [0, 1, 2, 3, 4, 5]  # fenced pages skipped
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    t.finished = True
    a.poll()
    assert a.chunks[0].state is ChunkState.CLEAN and not a.fenced
    a.stage("B", 1, 1, 512, lambda addr: _Ticket())  # same level, other block: shares pages 6, 7
    a.poll(wait=True)
    assert alloc.allocate(1) == [6]  # an allocation over staged chunks dirties both
    assert a.chunks[0].state is ChunkState.DIRTY and a.chunks[1].state is ChunkState.DIRTY
    assert a.clean("B") == {} and a.dirty_bytes == 1024
    alloc.decref([6])
    assert a.chunks[0].state is ChunkState.DIRTY  # dirty is sticky: the page may have been written


def test_fences_are_counted_per_page():
    alloc = StagingAwareAllocator(8)
    a = _area(num_pages=8, blocks=2, seg=256, chunk=512)
    alloc.area = a
    t0, t1 = _Ticket(), _Ticket()
    a.stage("B", 0, 0, 512, lambda addr: t0)
    a.stage("B", 1, 1, 512, lambda addr: t1)
    t0.finished = True
    a.poll()
    assert 6 in a.fenced and 7 in a.fenced  # chunk 1 is still being written over the same pages
    assert sorted(alloc.allocate(6)) == [0, 1, 2, 3, 4, 5] and alloc.num_free == 0


def test_idle_switch_rule_and_prediction():
    rule = IdleSwitchRule()
    v = EngineView("A", True, {"B": 2}, {"B": 1.0}, loaded=("A", "B", "C"))
    assert rule.decide(v, 5.0) is None  # never away from a busy model
    v = EngineView("A", False, {"B": 2, "C": 1}, {"B": 3.0, "C": 1.0}, loaded=("A", "B", "C"))
    assert rule.decide(v, 5.0) == "C"  # oldest queued call first
    v = EngineView("A", False, {"B": 2}, {"B": 3.0}, requested="C", loaded=("A", "B", "C"))
    assert rule.decide(v, 5.0) == "C" and predict_next(v, 5.0) == "C"
    v = EngineView("A", False, {}, {}, previous="B", loaded=("A", "B"))
    assert rule.decide(v, 5.0) is None and predict_next(v, 5.0) == "B"  # A→B→A: stage the way back
    assert predict_next(EngineView("A", False, loaded=("A",)), 0.0) is None


def test_staging_plan_path_and_costs():
    assert plan_staging(6, {0, 2}, 10, 3) == [1, 3, 4]
    assert plan_staging(6, set(), 2, 8) == [0, 1]
    assert classify_path(4, 4) == "full_staged" and classify_path(4, 0) == "host_only" and classify_path(4, 1) == "partial"
    c = SwitchCostModel(alpha=0.5)
    c.observe("host_only", 1.0)
    c.observe("full_staged", 0.2)
    assert c.estimate(0.5) == pytest.approx(0.6)
    c.observe("host_only", 2.0)
    assert c.by_path["host_only"] == pytest.approx(1.5)
