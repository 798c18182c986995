"""Scheduler + block manager with a fake model: exact assertions on what each step schedules."""

import pytest

from services.engine.kv.manager import CopyOp, KVManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus
from services.engine.types import SamplingParams


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0  # strictly increasing: every touch is distinguishable
        return self.t


def make(num_pages=16, page_size=4, max_num_seqs=4, budget=8, **kw):
    kv = KVManager(num_pages, page_size, clock=Clock(), **kw)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def seq(rid, n, start=0, session=""):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=100), session)


def run_step(s, token=7, forward_ok=False):
    """Schedule, then 'sample' token for every sequence that asked; return the summary. ``forward_ok``: say the
    forward completed, as the executor does (its pages may then be published for waiting calls)."""
    out = s.schedule()
    if forward_ok:
        s.forward_done()
    for sc in out.scheduled:
        if sc.sample:
            sc.seq.append_token(token)
    s.check_integrity()
    return out


def test_chunked_prefill_and_decode_first():
    s = make(budget=8)
    a, b = seq("a", 10), seq("b", 5, start=100)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert out.summary() == [("a", 8)]
    assert [sc.sample for sc in out.scheduled] == [False]
    assert a.pages == [0, 1, 2]  # whole prompt allocated at admission
    out = run_step(s)
    assert out.summary() == [("a", 2), ("b", 5)]
    assert [sc.start for sc in out.scheduled] == [8, 0]
    assert [sc.sample for sc in out.scheduled] == [True, True]  # b fits the 6 tokens left
    assert b.num_computed_tokens == 5
    out = run_step(s)
    assert out.summary() == [("a", 1), ("b", 1)]
    assert [sc.start for sc in out.scheduled] == [10, 5]


def test_decodes_scheduled_before_prefill_and_budget():
    s = make(budget=4)
    a = seq("a", 3)
    s.add(a)
    assert run_step(s).summary() == [("a", 3)]
    s.add(seq("b", 10, start=50))
    out = run_step(s)
    assert out.summary() == [("a", 1), ("b", 3)]
    assert out.scheduled[0].is_decode and out.num_batched_tokens == 4


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2, budget=100)
    for i in range(3):
        s.add(seq(f"r{i}", 2, start=10 * i))
    out = run_step(s)
    assert out.summary() == [("r0", 2), ("r1", 2)]
    assert s.num_waiting == 1
    s.finish(s.running[0])
    out = run_step(s)
    assert out.summary() == [("r1", 1), ("r2", 2)]


def test_admission_waits_for_pages_fcfs():
    s = make(num_pages=4, page_size=4, budget=100)
    s.add(seq("big", 12))  # 3 pages
    s.add(seq("small", 8, start=50))  # 2 pages: must wait, head-of-line FCFS
    s.add(seq("tiny", 1, start=90))
    out = run_step(s)
    assert out.summary() == [("big", 12)]
    assert s.num_waiting == 2


def test_prefix_hit_from_radix_and_copy_on_write():
    s = make(num_pages=16, page_size=4, budget=100)
    a = seq("a", 8)
    s.add(a)
    run_step(s)
    s.finish(a)  # computed 8 tokens = 2 full pages go into the radix cache
    assert len(s.kv.radix) == 2 and s.kv.num_free_pages == 14
    b = seq("b", 10)  # same first 8 tokens
    s.add(b)
    out = run_step(s)
    assert out.summary() == [("b", 2)] and out.scheduled[0].start == 8
    assert b.num_cached_tokens == 8 and b.pages[:2] == [0, 1]
    assert not out.copies
    s.finish(b)
    c = seq("c", 8)  # whole prompt cached: recompute the last token in a private copy of page 1
    s.add(c)
    out = run_step(s)
    assert out.summary() == [("c", 1)] and out.scheduled[0].start == 7
    assert c.num_cached_tokens == 7
    assert c.pages[0] == 0 and c.pages[1] != 1
    assert out.copies == [CopyOp(src=1, dst=c.pages[1], num_rows=3)]
    s.schedule()  # next step: copy source reference released
    s.check_integrity()


def test_session_entry_reuses_partial_page_in_place():
    s = make(num_pages=16, page_size=4, budget=100)
    a = seq("a", 6, session="S")
    s.add(a)
    run_step(s, token=40)  # prefill 6, sample 40
    run_step(s, token=41)  # decode 40, sample 41
    s.finish(a)
    entry = s.kv.sessions.peek("S")
    assert entry.token_ids == [0, 1, 2, 3, 4, 5, 40]  # 41 has no KV
    assert len(entry.pages) == 2 and len(s.kv.radix) == 1
    b = Sequence("b", [0, 1, 2, 3, 4, 5, 40, 41, 9, 9], SamplingParams(), "S")
    s.add(b)
    out = run_step(s)
    assert out.summary() == [("b", 3)] and not out.copies
    assert b.pages[:2] == entry.pages  # partial page taken over exclusively
    assert b.num_cached_tokens == 7
    assert "S" not in s.kv.sessions  # consumed


def test_session_partial_page_shared_is_copied():
    s = make(num_pages=16, page_size=4, budget=100)
    a = seq("a", 9, session="S")
    s.add(a)
    run_step(s)
    s.finish(a)  # committed 9 tokens: 2 full pages (also in radix) + partial
    b = Sequence("b", list(range(6)) + [77, 78], SamplingParams(), "S")
    s.add(b)
    out = run_step(s)
    assert b.num_cached_tokens == 6
    assert len(out.copies) == 1 and out.copies[0].num_rows == 2  # page 1 is shared with the radix cache
    assert out.summary() == [("b", 2)]


def test_decode_pressure_evicts_cache_then_preempts_newest():
    s = make(num_pages=4, page_size=4, budget=100)
    old = seq("old", 7)
    s.add(old)
    run_step(s)
    s.finish(old)  # 1 full page cached in radix (refcount only from the tree)
    assert s.kv.num_free_pages == 3
    a, b = seq("a", 4, start=100), seq("b", 4, start=200)
    s.add(a)
    s.add(b)
    assert run_step(s).summary() == [("a", 4), ("b", 4)]
    assert s.kv.num_free_pages == 1
    # both need a new page for their 5th token: 'a' takes the free one; 'b' evicts the radix page
    out = run_step(s)
    assert out.summary() == [("a", 1), ("b", 1)] and not out.preempted
    assert len(s.kv.radix) == 0
    run_step(s), run_step(s), run_step(s)  # tokens 6..8 fit in the second pages
    # 9th token: no page, nothing to evict -> preempt the newest (b); a continues
    out = run_step(s)
    assert out.preempted == ["b"] and out.summary() == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.pages == [] and b.num_computed_tokens == 0
    assert b.token_ids == list(range(200, 204)) + [7] * 5  # generated tokens kept for recompute
    s.finish(a)
    out = run_step(s)
    assert out.summary() == [("b", 9)] and out.scheduled[0].sample


def test_preempt_self_when_newest():
    s = make(num_pages=3, page_size=4, budget=100)
    a = seq("a", 4)
    s.add(a)
    run_step(s)
    b = seq("b", 4, start=10)
    s.add(b)
    assert run_step(s).summary() == [("a", 1), ("b", 4)]
    assert a.pages == [0, 1] and b.pages == [2]
    out = run_step(s)  # b's 5th token needs a page; b is the newest: it preempts itself
    assert out.summary() == [("a", 1)] and out.preempted == ["b"]
    assert list(s.waiting) == [b] and s.kv.num_free_pages == 1


def test_abort_waiting_and_running_release_pages():
    s = make(num_pages=8, page_size=4, budget=100)
    a, b = seq("a", 5), seq("b", 5, start=50)
    s.add(a)
    run_step(s)
    s.add(b)
    s.finish(b, cache=False)
    s.finish(a, cache=False)
    assert not s.has_unfinished() and s.kv.num_free_pages == 8


def test_flush_and_hit_rate():
    s = make()
    a = seq("a", 8)
    s.add(a)
    run_step(s)
    s.finish(a)
    b = seq("b", 8)
    s.add(b)
    run_step(s)
    assert s.kv.hit_rate == pytest.approx(7 / 16)
    s.finish(b)
    s.schedule()
    assert s.kv.flush() == 2 and s.kv.num_free_pages == 16


def make_lone(lone, budget=8, **kw):
    s = make(budget=budget, **kw)
    s.lone_prefill_tokens = lone
    return s


def test_a_step_without_decodes_prefills_a_long_prompt_in_one_chunk():
    s = make_lone(24, num_pages=32)
    a, b = seq("a", 20), seq("b", 6, start=100)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert out.summary() == [("a", 20)] and out.num_batched_tokens == 20  # a alone; its 20 > 8 leaves no budget
    out = run_step(s)  # a decodes now: b gets the normal budget left (8 - 1)
    assert out.summary() == [("a", 1), ("b", 6)]
    off = make_lone(0, num_pages=32)
    off.add(seq("a", 20))
    assert run_step(off).summary() == [("a", 8)]


def test_lone_prefill_limit_caps_the_chunk_and_short_prompts_leave_the_normal_budget():
    s = make_lone(12, num_pages=32)
    s.add(seq("a", 20))
    assert run_step(s).summary() == [("a", 12)]  # capped at lone_prefill_tokens
    t = make_lone(12, num_pages=32)
    t.add(seq("a", 3))
    t.add(seq("b", 20, start=100))
    assert run_step(t).summary() == [("a", 3), ("b", 5)]  # a fits the normal budget: b gets the rest of it


def test_a_partial_prefill_continues_with_the_lone_limit_once_nothing_decodes():
    s = make_lone(0, num_pages=32)
    a = seq("a", 20)
    s.add(a)
    assert run_step(s).summary() == [("a", 8)]
    s.lone_prefill_tokens = 16
    assert run_step(s).summary() == [("a", 12)]  # the rest of a's prompt in one step


def test_lone_prefill_tokens_must_not_be_negative():
    with pytest.raises(ValueError):
        Scheduler(KVManager(4, 4, clock=Clock()), lone_prefill_tokens=-1)


def run_and_publish(s, token=7):
    return run_step(s, token, forward_ok=True)


def test_a_call_sharing_a_prefix_being_computed_waits_for_it_and_reuses_it():
    """Issue 42 item 2: calls arriving together behind one system prompt compute it once. ``b`` shares ``a``'s
    first three pages; while ``a`` computes them ``b`` is deferred (``c``, unrelated and behind it, goes
    ahead); once ``a``'s forward published them, ``b`` is admitted with the three pages as a cache hit."""
    s = make(num_pages=32, budget=64)
    a = seq("a", 14)
    b = Sequence("b", list(range(12)) + [500, 501, 502], SamplingParams(max_tokens=100))
    c = seq("c", 6, start=200)
    for x in (a, b, c):
        s.add(x)
    out = run_and_publish(s)
    assert out.summary() == [("a", 14), ("c", 6)]
    assert b.status is SequenceStatus.WAITING and not b.pages
    assert len(s.kv.radix) == 0  # published at the next schedule, while b waits
    out = run_and_publish(s)
    assert len(s.kv.radix) >= 3
    assert out.summary() == [("a", 1), ("c", 1), ("b", 3)]
    assert b.num_cached_tokens == 12 and b.pages[:3] == a.pages[:3]
    assert s.kv.num_hit_tokens == 12


def test_a_deferred_call_is_not_held_by_a_preempted_or_finished_leader():
    s = make(num_pages=32, budget=64)
    a, b = seq("a", 14), seq("b", 13)  # b shares a's first three pages
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.summary() == [("a", 14)] and b.status is SequenceStatus.WAITING
    s.forward_failed(out)  # a's forward raised: nothing of it is ever published, and b no longer waits for it
    out = s.schedule()
    s.forward_done()
    assert out.summary() == [("b", 13)] and b.num_cached_tokens == 0 and len(s.kv.radix) == 0  # computes it itself
    s.finish(a, cache=False)  # its call is failed
    for sc in out.scheduled:
        sc.seq.append_token(7)
    s.schedule()
    s.forward_done()
    s.check_integrity()
    s.add(seq("c", 13))  # a later call with b's prompt: b's pages are published as c waits, then reused
    out = s.schedule()
    assert len(s.kv.radix) == 3 and out.summary()[-1] == ("c", 1)  # c: 12 tokens hit, its last recomputed


def test_without_publishing_the_scheduler_never_matches_unwritten_pages():
    """Pages of a step whose forward has not run (or failed) are never matched: they are not in the radix
    cache until the executor said the forward completed (``forward_done``), and the call sharing them stays
    deferred meanwhile."""
    s = make(num_pages=32, budget=64)
    a, b = seq("a", 14), seq("b", 13)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)  # no publish: b still waits
    assert b.status is SequenceStatus.WAITING and len(s.kv.radix) == 0
