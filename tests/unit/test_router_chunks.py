"""issue 20 #5: the router's reader takes every chunk already queued and yields the in-order ones merged
(one JSON / SSE event for several tokens when it lags); a reader that keeps up sees them unchanged."""

from __future__ import annotations

import asyncio

from services.router.engine_client import EngineCall, merge_chunks
from talaria.subjects import Subjects
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb


def _tok(seq: int, t: int, **kw) -> pb.TokenChunk:
    return pb.TokenChunk(seq=seq, token_ids=[t], text=f"<{t}>", logprobs=[pb.TokenLogprob(token_id=t)], **kw)


def _call() -> EngineCall:
    return EngineCall(None, Subjects("t"), "e0", pb.GenerateRequest(request_id="x"))


def _read(call: EngineCall, feed) -> list[pb.TokenChunk]:
    async def go():
        out = []
        async for c in call.chunks(5.0, lambda: True):
            out.append(pb.TokenChunk.FromString(c.SerializeToString()))
            feed(call, len(out))
        return out

    return asyncio.run(go())


def test_queued_chunks_come_merged_in_seq_order_with_the_terminal_fields_of_the_last():
    call = _call()
    usage = cpb.Usage(prompt_tokens=3, completion_tokens=4)
    for c in (_tok(2, 12), _tok(1, 11), pb.TokenChunk(keepalive=True), _tok(3, 13),
              _tok(4, 14, finished=True, finish_reason="length", usage=usage, ttft_seconds=0.5,
                   attribution=cpb.CallAttribution(prefill_s=0.25, decode_s=0.5))):
        call._queue.put_nowait(c)  # the reader lagged: four token chunks (out of order) and a keepalive wait
    (c,) = _read(call, lambda *_: None)
    assert list(c.token_ids) == [11, 12, 13, 14] and c.text == "<11><12><13><14>" and len(c.logprobs) == 4
    assert (c.seq, c.finished, c.finish_reason, c.usage.completion_tokens, c.ttft_seconds) == (4, True, "length", 4, 0.5)
    # the engine's time split rides on the finished chunk: merged away, the call record had prefill_s 0
    # (test_telemetry's time-split test, 1 run in ~40)
    assert (c.attribution.prefill_s, c.attribution.decode_s) == (0.25, 0.5)
    assert call.finished and call.keepalives == 1


def test_a_reader_that_keeps_up_sees_every_chunk_and_an_error_comes_alone_after_the_tokens():
    call = _call()
    call._queue.put_nowait(_tok(1, 11))
    feeds = {1: [_tok(2, 12), _tok(3, 0, error=cpb.Error(code="engine_error", message="boom"))]}

    def feed(c: EngineCall, n: int) -> None:
        for x in feeds.get(n, []):
            c._queue.put_nowait(x)

    got = _read(call, feed)
    assert [list(c.token_ids) for c in got] == [[11], [12], [0]]
    assert got[-1].error.code == "engine_error" and not got[1].HasField("error")


def test_merge_of_one_chunk_is_that_chunk():
    c = _tok(1, 5)
    assert merge_chunks([c]) is c


def test_a_no_responders_marker_already_queued_is_engine_unavailable_not_a_crash():
    """NATS restarting: its no-responders status can be queued before the reader asks for the first chunk;
    the fast path must turn it into EngineUnavailable (retry / 503), not hand None on (it was a 500)."""
    import pytest

    from services.router.engine_client import EngineUnavailable

    call = _call()
    call._queue.put_nowait(None)
    with pytest.raises(EngineUnavailable):
        asyncio.run(call.wait_accepted(5.0, lambda: True))


def test_a_lost_bus_ends_the_call_after_the_chunks_already_here():
    """Issue 47: the router's NATS connection dropped mid-call. The reader gets what had arrived, then
    ``EngineUnavailable(bus=True)`` at once (not after ``idle_timeout``: nothing would ever come)."""
    import pytest

    from services.router.engine_client import EngineUnavailable

    call = _call()
    call.accepted = pb.TokenChunk(accepted=True)
    call._queue.put_nowait(_tok(1, 11))
    call.bus_lost()
    got = []

    async def go():
        async for c in call.chunks(3600.0, lambda: True):
            got.append(list(c.token_ids))

    with pytest.raises(EngineUnavailable) as e:
        asyncio.run(asyncio.wait_for(go(), 10))
    assert got == [[11]] and e.value.bus and e.value.accepted


def test_a_chunk_lost_before_the_last_one_fails_the_call_at_once_not_at_the_silence_timeout():
    import pytest

    from services.router.engine_client import EngineUnavailable

    call = _call()
    for c in (_tok(1, 11), _tok(3, 13), _tok(4, 14, finished=True, finish_reason="length")):  # chunk 2 never arrives
        call._queue.put_nowait(c)

    async def go():
        got = []
        with pytest.raises(EngineUnavailable, match="chunk 2 of the call to e0 was lost") as ei:
            async for c in call.chunks(60.0, lambda: True):  # the silence timeout the call used to wait out
                got.append(list(c.token_ids))
        return got, ei.value

    got, err = asyncio.run(go())  # without the rule: "sent nothing within 60s", a minute later
    assert got == [[11]] and err.accepted  # the tokens before the gap were delivered; the error is mid-stream


def test_a_late_chunk_within_the_grace_is_still_taken_in_order():
    call = _call()
    for c in (_tok(1, 11), _tok(3, 13, finished=True, finish_reason="length")):
        call._queue.put_nowait(c)
    feeds = {1: [_tok(2, 12)]}  # arrives after the reader saw the gap (a publisher that interleaved two chunks)

    def feed(c: EngineCall, n: int) -> None:
        for x in feeds.get(n, []):
            c._queue.put_nowait(x)

    got = _read(call, feed)
    assert [list(c.token_ids) for c in got] == [[11], [12, 13]] and got[-1].finished


def test_chunk_queue_a_cancelled_get_loses_nothing_and_a_timed_out_wait_ends_clean():
    from services.router.engine_client import ChunkQueue

    async def go():
        q = ChunkQueue()
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put_nowait("a")  # completes the waiter ...
        waiting.cancel()  # ... but the reader is cancelled before it resumes
        await asyncio.gather(waiting, return_exceptions=True)
        assert not q.empty() and q.get_nowait() == "a"  # the item stayed queued
        try:
            async with asyncio.timeout(0.01):
                await q.get()
        except TimeoutError:
            pass
        q.put_nowait("b")
        q.put_nowait("c")
        return [await q.get(), await q.get(), q.empty()]

    assert asyncio.run(go()) == ["b", "c", True]
