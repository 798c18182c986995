"""The engine's token path: step outputs already queued are folded into one output per call."""

from __future__ import annotations

import asyncio

from services.engine.streaming import coalesce_outputs, next_coalesced
from services.engine.types import FinishReason, RequestOutput, Usage


def test_coalesce_merges_per_request_in_order_and_keeps_the_terminal_fields():
    usage = Usage(5, 3, 0)
    steps = [
        [RequestOutput("a", [1], "x"), RequestOutput("b", [7], "p")],
        [RequestOutput("b", [8], "q"), RequestOutput("a", [2], "y")],
        [RequestOutput("a", [3], "z", True, FinishReason.LENGTH, usage), RequestOutput("c", [9], "")],
    ]
    out = coalesce_outputs(steps)
    assert [o.request_id for o in out] == ["a", "b", "c"]
    a, b, c = out
    assert (a.new_token_ids, a.new_text, a.finished, a.finish_reason, a.usage) == ([1, 2, 3], "xyz", True, FinishReason.LENGTH, usage)
    assert (b.new_token_ids, b.new_text, b.finished) == ([7, 8], "pq", False)
    assert (c.new_token_ids, c.new_text) == ([9], "")
    assert steps[0][0].new_token_ids == [1]  # inputs untouched


def test_an_empty_output_queued_after_a_finished_one_does_not_unfinish_it():
    """The engine's stream-interval timer queues an empty output for a call; when the call's finished output
    is queued before it and both are folded, the call stays finished (it hung the stream: seen in bench router)."""
    usage = Usage(5, 2, 0)
    steps = [[RequestOutput("a", [1], "x")], [RequestOutput("a", [2], "y", True, FinishReason.LENGTH, usage)], [RequestOutput("a", [], "")]]
    (a,) = coalesce_outputs(steps)
    assert (a.new_token_ids, a.new_text, a.finished, a.finish_reason, a.usage) == ([1, 2], "xy", True, FinishReason.LENGTH, usage)
    (b,) = coalesce_outputs([[RequestOutput("b", [1], "x")], [RequestOutput("b", [], "")]])  # timer after a held token
    assert (b.new_token_ids, b.new_text, b.finished) == ([1], "x", False)


def test_next_coalesced_takes_everything_queued_but_never_waits_for_more():
    async def scenario():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait([RequestOutput("a", [1], "x")])
        outs, steps = await next_coalesced(q)  # reader keeps up: one step, passed through as is
        assert steps == 1 and outs[0].new_token_ids == [1]
        for t in (2, 3, 4):  # reader lagged three steps behind
            q.put_nowait([RequestOutput("a", [t], str(t))])
        outs, steps = await next_coalesced(q)
        assert steps == 3 and len(outs) == 1 and outs[0].new_token_ids == [2, 3, 4] and outs[0].new_text == "234"
        assert q.empty()
        waiter = asyncio.ensure_future(next_coalesced(q))
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing queued: it waits for the next step
        q.put_nowait([RequestOutput("a", [5], "")])
        outs, steps = await asyncio.wait_for(waiter, 10)
        assert steps == 1 and outs[0].new_token_ids == [5]

    asyncio.run(scenario())


def test_coalesce_keeps_every_steps_logprobs():
    """A lagging publisher folds steps: the log-probability entries of every folded step stay, one per token
    (they were dropped, so a streamed logprobs list came out shorter than the tokens on a loaded machine)."""
    a = RequestOutput("r", [1], "a", logprobs=[(1, -0.1, [])])
    b = RequestOutput("r", [2, 3], "bc", logprobs=[(2, -0.2, []), (3, -0.3, [])])
    (m,) = coalesce_outputs([[a], [b]])
    assert m.new_token_ids == [1, 2, 3] and [e[0] for e in m.logprobs] == [1, 2, 3]
    (plain,) = coalesce_outputs([[RequestOutput("r", [1], "a")], [RequestOutput("r", [2], "b")]])
    assert plain.logprobs is None


def test_coalesce_concatenates_logprobs_in_step_order():
    lp = lambda t: (t, -0.5, [(t, -0.5)])  # noqa: E731
    out = coalesce_outputs([[RequestOutput("a", [1], "x", logprobs=[lp(1)])], [RequestOutput("a", [2], "y", logprobs=[lp(2)])],
                            [RequestOutput("b", [3], "z")]])
    assert out[0].logprobs == [lp(1), lp(2)] and out[1].logprobs is None


def test_executor_hold_merges_a_held_call_until_it_finishes_and_passes_the_others():
    from services.engine.streaming import ExecutorHold

    h = ExecutorHold()
    assert [o.request_id for o in h.filter([RequestOutput("a", [1], "x"), RequestOutput("b", [7], "p")])] == ["a", "b"]
    h.hold("a")
    out = h.filter([RequestOutput("a", [2], "y", logprobs=[(2, -0.2, [])]), RequestOutput("b", [8], "q")])
    assert [o.request_id for o in out] == ["b"] and h.merged == 1  # a's step kept off the loop
    assert h.filter([RequestOutput("a", [3], "z", logprobs=[(3, -0.3, [])])]) == [] and h.merged == 2
    usage = Usage(4, 4, 0)
    (a,) = h.filter([RequestOutput("a", [4], "w", True, FinishReason.LENGTH, usage, logprobs=[(4, -0.4, [])])])
    assert (a.new_token_ids, a.new_text, a.finished, a.usage) == ([2, 3, 4], "yzw", True, usage)  # in step order
    assert [e[0] for e in a.logprobs] == [2, 3, 4]
    h.release("a")
    assert h.filter([]) == []  # nothing left behind


def test_executor_hold_a_released_call_gets_what_was_held_in_order():
    """The loop forgets a call (abort, deadline, failure) and releases it: what the executor held goes out
    with its next output, merged in order, or on its own at the next step; nothing is lost or reordered."""
    from services.engine.streaming import ExecutorHold

    h = ExecutorHold()
    h.hold("a")
    h.hold("c")
    assert h.filter([RequestOutput("a", [1], "x"), RequestOutput("c", [5], "e")]) == []
    h.release("a")
    (a,) = h.filter([RequestOutput("a", [2], "y", True, FinishReason.ABORT)])
    assert (a.new_token_ids, a.new_text, a.finished) == ([1, 2], "xy", True)
    h.release("c")  # no further output of c comes: it still goes out at the next step
    (c,) = h.filter([])
    assert (c.request_id, c.new_token_ids) == ("c", [5])
    assert h.filter([RequestOutput("c", [6], "f")])[0].new_token_ids == [6]  # no longer held
