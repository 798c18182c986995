"""The engine service in-process on a real nats-server and real tiny models (no router, no LocalStack):
heartbeats that a long step cannot starve (issue 18 #9, issue 12 #4), switch records in order from the
first subscriber's point of view (issue 18 #13), and calls whose requester is gone (issue 18 #3)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from services.engine.cold.engine import ColdEngine
from services.engine.executor import Engine
from services.engine.service import EngineService
from talaria.config import EngineConfig, StackConfig
from talaria.natsutil import EmbeddedNats, connect
from talaria.subjects import PROBE_HEADER, Subjects
from talaria.v1 import engine_pb2 as pb

SUBJ = Subjects("talaria")


@pytest.fixture(scope="module")
def nats_url():
    with EmbeddedNats() as n:
        yield n.url


class Running:
    """An EngineService running in its own thread and event loop (as in its process)."""

    def __init__(self, service: EngineService, url: str) -> None:
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._up = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(url)), daemon=True)
        self._thread.start()

    async def _main(self, url: str) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._up.set()
        await self.service.run(self._stop, url)

    def __enter__(self) -> "Running":
        assert self._up.wait(60), "engine service loop did not start"
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


class SlowStepEngine(Engine):
    """A real engine whose steps take ``step_s`` (a long forward), holding the step lock like a real one."""

    step_s = 0.0
    in_step = threading.Event()

    def step(self):
        with self._step_lock:
            if self.step_s:
                self.in_step.set()
                time.sleep(self.step_s)
            return super().step()


async def until_serving(nc, instance: str) -> None:
    """Wait until the instance answers on its control subject (its subscriptions are in place)."""
    req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_RESUME).SerializeToString()
    for _ in range(120):
        try:
            await nc.request(SUBJ.control(instance), req, timeout=0.5)
            return
        except Exception:  # noqa: BLE001 - not subscribed yet
            await asyncio.sleep(0.1)
    raise AssertionError(f"{instance} never answered")


def gen(model: str, max_tokens: int = 4, **kw) -> pb.GenerateRequest:
    sp = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(schema_version=1, request_id=uuid.uuid4().hex, model=model, text="hello there", sampling=sp, **kw)


async def test_heartbeats_keep_their_period_through_a_long_step_and_a_blocking_control(synth_models, nats_url):
    eng = SlowStepEngine(synth_models["tiny-llama"], page_size=4, num_pages=64)
    cfg = EngineConfig(id="hb0", models=["tiny-llama"], heartbeat_period_s=0.1)
    with Running(EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0), nats_url):
        nc = await connect(nats_url, "test")
        beats = await nc.subscribe(SUBJ.heartbeat("hb0"))
        try:
            await until_serving(nc, "hb0")
            eng.step_s = 4.0
            inbox = nc.new_inbox()
            chunks = await nc.subscribe(inbox)
            await nc.publish(SUBJ.generate("hb0"), gen("tiny-llama", 1).SerializeToString(), reply=inbox)
            assert await asyncio.to_thread(eng.in_step.wait, 30)
            t0 = time.time()
            # FLUSH_CACHE waits for the running step; it must not hold up anything else meanwhile
            control = asyncio.ensure_future(nc.request(SUBJ.control("hb0"), pb.ControlRequest(schema_version=1, op=pb.CONTROL_FLUSH_CACHE).SerializeToString(), timeout=60))
            while time.time() < t0 + 3.0:
                await asyncio.sleep(0.1)
            eng.step_s = 0.0
            assert pb.ControlReply.FromString((await control).data).ok
            sent: list[float] = []
            while not sent or sent[-1] < t0 + 3.0:  # beats go on; read those sent up to the end of the window
                sent.append(pb.InstanceSnapshot.FromString((await beats.next_msg(30)).data).sent_unix)
            during = [t for t in sent if t0 + 0.5 <= t <= t0 + 3.0]
            # ~25 are due in those 2.5 s; with the beats on the service loop, none went out
            assert len(during) >= 5, f"{len(during)} heartbeats sent during a 4 s step (all sent: {len(sent)})"
            assert pb.TokenChunk.FromString((await chunks.next_msg(30)).data).accepted
        finally:
            await nc.close()


async def test_first_switch_record_a_subscriber_sees_is_the_switch_it_asked_for(synth_models, nats_url):
    models = ("tiny-llama", "tiny-qwen2")
    ce = ColdEngine({m: synth_models[m] for m in models}, page_size=4, kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    cfg = EngineConfig(id="sw0", pool="cold", models=list(models), heartbeat_period_s=0.1)
    with Running(EngineService(StackConfig(), cfg, ce, drain_timeout_s=1.0), nats_url):
        nc = await connect(nats_url, "test")
        try:
            await until_serving(nc, "sw0")
            assert ce.pool() is ce  # the cold engine is its own model pool
            switches = await nc.subscribe(SUBJ.switch("sw0"))  # a subscriber that joins a serving instance
            req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_OPEN_MODEL, model=models[1])
            assert pb.ControlReply.FromString((await nc.request(SUBJ.control("sw0"), req.SerializeToString(), timeout=60)).data).ok
            rec = pb.SwitchRecord.FromString((await switches.next_msg(30)).data)
            # before the fix the initial activation ('', tiny-llama), made before the service connected,
            # was published at the first step — i.e. to whoever subscribed before the first call
            assert (rec.from_model, rec.to_model) == models
        finally:
            await nc.close()


async def test_a_hot_instance_has_no_model_pool_and_refuses_open_and_close(synth_models, nats_url):
    """The hot engine implements api.Executor only: pool() is None (the cold engine is its own pool), so the
    service answers open/close with the "unsupported" refusal and the heartbeat carries no switch records."""
    eng = Engine(synth_models["tiny-llama"], page_size=4, num_pages=64)
    assert eng.pool() is None
    cfg = EngineConfig(id="hot0", models=["tiny-llama"], heartbeat_period_s=0.1)
    with Running(EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0), nats_url):
        nc = await connect(nats_url, "test")
        try:
            await until_serving(nc, "hot0")
            for op in (pb.CONTROL_OPEN_MODEL, pb.CONTROL_CLOSE_MODEL):
                req = pb.ControlRequest(schema_version=1, op=op, model="tiny-llama")
                rep = pb.ControlReply.FromString((await nc.request(SUBJ.control("hot0"), req.SerializeToString(), timeout=30)).data)
                assert not rep.ok and rep.error.code == "unsupported" and rep.error.http_status == 400, rep.error
                assert rep.snapshot.instance_id == "hot0" and not rep.snapshot.switches
            inbox = nc.new_inbox()
            chunks = await nc.subscribe(inbox)
            await nc.publish(SUBJ.generate("hot0"), gen("tiny-llama", 1).SerializeToString(), reply=inbox)
            assert pb.TokenChunk.FromString((await chunks.next_msg(30)).data).accepted  # still serving
        finally:
            await nc.close()


async def test_a_call_whose_requester_is_gone_is_aborted(synth_models, nats_url):
    eng = SlowStepEngine(synth_models["tiny-llama"], page_size=4, num_pages=512)
    eng.step_s = 0.05  # 1000 tokens would take a minute at least
    cfg = EngineConfig(id="rq0", models=["tiny-llama"], heartbeat_period_s=0.2)
    svc = EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0, requester_probe_s=0.5)
    try:
        with Running(svc, nats_url):
            nc = await connect(nats_url, "test")
            router = await connect(nats_url, "router")  # the requester: it will die mid-call
            try:
                await until_serving(nc, "rq0")
                inbox = router.new_inbox()
                chunks = await router.subscribe(inbox)
                req = gen("tiny-llama", 1000)
                await router.publish(SUBJ.generate("rq0"), req.SerializeToString(), reply=inbox)
                assert pb.TokenChunk.FromString((await chunks.next_msg(30)).data).accepted
                msg = await chunks.next_msg(30)
                while msg.headers and PROBE_HEADER in msg.headers:  # a probe of a live inbox is not a chunk
                    msg = await chunks.next_msg(30)
                assert pb.TokenChunk.FromString(msg.data).token_ids
                await router.close()  # the router dies: no cancel is ever sent
                for _ in range(300):
                    if not eng.has_unfinished():
                        break
                    await asyncio.sleep(0.1)
                assert not eng.has_unfinished(), "the engine kept generating for a requester that is gone"
                assert svc.counters["aborted"] == 1
            finally:
                await nc.close()
    finally:
        eng.step_s = 0.0


async def test_a_call_its_router_dropped_is_aborted_and_a_live_one_is_not(synth_models, nats_url):
    """Issue 20 §5: the router reads every reply inbox through one subscription (``InboxMux``), so a call
    it dropped without a cancel still has NATS interest; the mux answers the engine's probe ``gone`` and
    the engine aborts the call, while a call the router still reads (probed too) runs to its end."""
    from services.router.engine_client import EngineCall, InboxMux

    eng = SlowStepEngine(synth_models["tiny-llama"], page_size=4, num_pages=512)
    eng.step_s = 0.05
    cfg = EngineConfig(id="mx0", models=["tiny-llama"], heartbeat_period_s=0.2)
    svc = EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0, requester_probe_s=0.3)
    try:
        with Running(svc, nats_url):
            nc = await connect(nats_url, "test")
            router = await connect(nats_url, "router")
            try:
                await until_serving(nc, "mx0")
                mux = InboxMux(router, SUBJ.inbox_prefix("r0"))
                live = EngineCall(mux, SUBJ, "mx0", gen("tiny-llama", 30))  # ~1.5 s: probed several times
                dropped = EngineCall(mux, SUBJ, "mx0", gen("tiny-llama", 1000))
                await live.start()
                await dropped.start()
                assert live.inbox != dropped.inbox and len(mux) == 2
                assert (await live.wait_accepted(30, lambda: True)).accepted
                assert (await dropped.wait_accepted(30, lambda: True)).accepted
                await dropped.close()  # the router drops it: no cancel is sent, the mux still subscribes
                tokens = []
                async for c in live.chunks(30, lambda: True):
                    tokens += c.token_ids
                assert len(tokens) == 30, "a call the router still reads was cut short"
                for _ in range(100):
                    if not eng.has_unfinished():
                        break
                    await asyncio.sleep(0.1)
                assert not eng.has_unfinished(), "the engine kept generating a call its router dropped"
                assert svc.counters["aborted"] == 1  # the dropped call, not the live one
                assert mux.stray >= 1  # the dropped call's chunks after close() were dropped, not delivered
                await live.close()
                assert len(mux) == 0
            finally:
                await router.close()
                await nc.close()
    finally:
        eng.step_s = 0.0


async def test_a_full_engine_still_answers_413_for_a_prompt_that_can_never_fit(synth_models, nats_url):
    """Issue 18 #4: with its queue full the engine answered 429 before it looked at the prompt, so a client that
    retries 429 looped forever on a prompt over the context. Over the context is 413 first; a fitting call
    is still 429 while the queue is full."""
    eng = SlowStepEngine(synth_models["tiny-llama"], page_size=4, num_pages=512)
    eng.step_s = 0.05
    cfg = EngineConfig(id="full0", models=["tiny-llama"], heartbeat_period_s=0.2, max_queue=1, max_num_seqs=1)
    try:
        with Running(EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0), nats_url):
            nc = await connect(nats_url, "test")
            try:
                await until_serving(nc, "full0")
                for _ in range(2):  # one running, one queued: the engine is full
                    inbox = nc.new_inbox()
                    sub = await nc.subscribe(inbox)
                    await nc.publish(SUBJ.generate("full0"), gen("tiny-llama", 1000).SerializeToString(), reply=inbox)
                    assert pb.TokenChunk.FromString((await sub.next_msg(30)).data).accepted
                    await sub.unsubscribe()

                async def answer(req: pb.GenerateRequest) -> pb.TokenChunk:
                    msg = await nc.request(SUBJ.generate("full0"), req.SerializeToString(), timeout=30)
                    return pb.TokenChunk.FromString(msg.data)

                huge = gen("tiny-llama", 4)
                huge.text = "hello world " * 5000
                c = await answer(huge)
                assert c.error.http_status == 413 and c.error.code == "context_length_exceeded", c.error
                c = await answer(gen("tiny-llama", 4))
                assert c.error.http_status == 429 and c.error.code == "overloaded", c.error
            finally:
                await nc.close()
    finally:
        eng.step_s = 0.0


async def test_a_non_streaming_call_gets_its_first_token_then_the_rest_in_one_chunk(synth_models, nats_url):
    """Issue 20 #5: GenerateRequest.stream=False (the router reads only the whole answer) -> the first
    token goes out at once (TTFT observable), the others are merged into the finished chunk, logprobs
    included, on the executor thread (their steps do not wake the loop); the tokens equal a streaming
    call's, which gets its tokens as they come."""
    eng = Engine(synth_models["tiny-llama"], page_size=4, num_pages=128)
    cfg = EngineConfig(id="ns0", models=["tiny-llama"], heartbeat_period_s=5.0)
    svc = EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0)
    with Running(svc, nats_url):
        nc = await connect(nats_url, "test")
        try:
            await until_serving(nc, "ns0")

            async def call(stream: bool) -> list[pb.TokenChunk]:
                req = gen("tiny-llama", 12, stream=stream)
                req.sampling.logprobs = 1
                return await _stream(nc, "ns0", req)

            held = await call(False)
            # its steps after the first token were merged on the executor thread, never woke the loop (a step
            # or two may run before the loop marks the call held)
            assert svc._hold.merged >= 8, svc._hold.merged
            before = svc._hold.merged
            streamed = await call(True)
            assert svc._hold.merged == before  # a streaming call's reader gets its tokens as they come
            tokens = lambda cs: [t for c in cs for t in c.token_ids]  # noqa: E731
            assert tokens(held) == tokens(streamed) and len(tokens(held)) == 12
            assert [len(c.token_ids) for c in held] == [0, 1, 11] and [c.seq for c in held] == [0, 1, 2]
            assert sum(len(c.logprobs) for c in held) == 12 and held[-1].usage.completion_tokens == 12
            assert len(streamed) > 3  # accepted + a chunk per step (or per lagging run of steps)
        finally:
            await nc.close()


async def _stream(nc, instance: str, req: pb.GenerateRequest, on_chunk=None) -> list[pb.TokenChunk]:
    """One call on ``instance``: its chunks (keepalives and probes left out) up to the finished one;
    ``on_chunk(chunk)`` sees each as it arrives."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(SUBJ.generate(instance), req.SerializeToString(), reply=inbox)
    got: list[pb.TokenChunk] = []
    while not got or not got[-1].finished:
        msg = await sub.next_msg(30)
        if msg.headers and PROBE_HEADER in msg.headers:
            continue
        c = pb.TokenChunk.FromString(msg.data)
        if not c.keepalive:
            got.append(c)
            if on_chunk is not None:
                on_chunk(c)
    await sub.unsubscribe()
    return got


async def test_a_stream_interval_holds_tokens_after_the_first_and_never_the_last(synth_models, nats_url):
    """Issue 20 #5: with ``stream_interval_ms`` longer than the whole call, a streaming call gets its first
    token at once and every other token with the finished chunk, in order, logprobs included: the tokens
    equal those of an engine without the interval, which sends a chunk per step."""
    calls = {}
    for iid, interval in (("si0", 0.0), ("si1", 10_000.0)):
        eng = Engine(synth_models["tiny-llama"], page_size=4, num_pages=128)
        cfg = EngineConfig(id=iid, models=["tiny-llama"], heartbeat_period_s=5.0, stream_interval_ms=interval)
        with Running(EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0), nats_url):
            nc = await connect(nats_url, "test")
            try:
                await until_serving(nc, iid)
                req = gen("tiny-llama", 12, stream=True)
                req.sampling.logprobs = 1
                calls[iid] = await _stream(nc, iid, req)
            finally:
                await nc.close()
    tokens = lambda cs: [t for c in cs for t in c.token_ids]  # noqa: E731
    plain, held = calls["si0"], calls["si1"]
    assert tokens(plain) == tokens(held) and len(tokens(held)) == 12
    assert len(plain) > 3  # accepted + a chunk per step (or per lagging run of steps)
    assert [len(c.token_ids) for c in held] == [0, 1, 11] and [c.seq for c in held] == [0, 1, 2]
    assert sum(len(c.logprobs) for c in held) == 12 and held[-1].usage.completion_tokens == 12


class ThirdStepSlow(Engine):
    """A real engine whose third step (the second decode step after prefill) takes ``slow_s`` longer."""

    slow_s = 3.0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps = 0
        self.slow_done = threading.Event()

    def step(self):
        self.steps += 1
        if self.steps != 3:
            return super().step()
        time.sleep(self.slow_s)
        out = super().step()
        self.slow_done.set()
        return out


async def test_held_stream_tokens_go_out_when_the_interval_ends_even_without_a_step(synth_models, nats_url):
    """Issue 20 #5: a held token is sent by the interval's timer, not by the next step: token 2 (held, the
    interval is 0.3 s) reaches the reader while step 3 is still running (3 s)."""
    eng = ThirdStepSlow(synth_models["tiny-llama"], page_size=4, num_pages=128)
    cfg = EngineConfig(id="si2", models=["tiny-llama"], heartbeat_period_s=5.0, stream_interval_ms=300.0)
    seen: list[tuple[int, bool]] = []  # (tokens so far, step 3 done) per chunk
    with Running(EngineService(StackConfig(), cfg, eng, drain_timeout_s=1.0), nats_url):
        nc = await connect(nats_url, "test")
        try:
            await until_serving(nc, "si2")
            got = await _stream(nc, "si2", gen("tiny-llama", 4, stream=True),
                                on_chunk=lambda c: seen.append(((seen[-1][0] if seen else 0) + len(c.token_ids), eng.slow_done.is_set())))
        finally:
            await nc.close()
    assert sum(len(c.token_ids) for c in got) == 4 and [c.seq for c in got] == list(range(len(got)))
    assert (2, False) in seen, seen  # tokens 1-2 delivered before the slow step ended


async def test_a_retention_hint_on_nats_holds_the_cold_slot_for_the_return(synth_models, nats_url):
    """The router's ``RetentionHint`` (subject ``retention``, with the session's model) reaches the slotted cold
    engine, which holds model A's slot for the session's expected return instead of switching to B's waiting
    call (slots/hold.py); the return is served in A's slot and only then does the instance switch to B."""
    from services.engine.slots import CostModel, CostProfile, SlotPolicy
    from services.engine.cold.slotted import SlotSwitching

    a, b = "tiny-llama", "tiny-qwen2"
    slow = CostProfile(prefill_per_token=1e-3, decode_step=0.01, restore_per_token=1e-5,
                       switch_by_path={"full_staged": 2.0, "partial": 4.0, "host_only": 8.0})  # the paper's regime
    ce = ColdEngine({m: synth_models[m] for m in (a, b)}, switching=SlotSwitching(SlotPolicy(ttft_s=20.0, tpot_s=1.0), CostModel(slow)),
                           page_size=4, kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    cfg = EngineConfig(id="ho0", pool="cold", models=[a, b], heartbeat_period_s=0.2)
    with Running(EngineService(StackConfig(), cfg, ce, drain_timeout_s=1.0), nats_url):
        nc = await connect(nats_url, "test")
        try:
            await until_serving(nc, "ho0")
            switches = await nc.subscribe(SUBJ.switch("ho0"))

            async def call(model: str, session: str) -> tuple[float, float]:
                inbox = nc.new_inbox()
                sub = await nc.subscribe(inbox)
                sent = time.time()
                await nc.publish(SUBJ.generate("ho0"), gen(model, 3, session_id=session).SerializeToString(), reply=inbox)
                while not pb.TokenChunk.FromString((await sub.next_msg(60)).data).finished:
                    pass
                await sub.unsubscribe()
                return sent, time.time()

            _, done = await call(a, "s")
            assert ce.active == a
            hint = pb.RetentionHint(schema_version=1, session_id="s", model=a, lease_id="x", t_done_unix=done, gap_mu=0.0, gap_sigma=0.3, window_s=20.0)
            await nc.publish(SUBJ.retention("ho0"), hint.SerializeToString())
            await nc.flush()
            for _ in range(1000):  # the hint is in the engine's book before B's call arrives
                if ce.retention.leased():
                    break
                await asyncio.sleep(0.01)
            other = asyncio.ensure_future(call(b, "t"))
            for _ in range(300):  # B waits: A's slot is held for s (expected back in ~1 s)
                if ce.switching.slots.totals["holds"]:
                    break
                await asyncio.sleep(0.01)
            assert ce.switching.slots.totals["holds"] == 1 and ce.active == a and not other.done()
            returned, _ = await call(a, "s")  # s returns: served in A's held slot
            await asyncio.wait_for(other, 60)
            rec = pb.SwitchRecord.FromString((await switches.next_msg(30)).data)
            assert (rec.from_model, rec.to_model) == (a, b) and rec.started_unix >= returned  # the switch came after the return
        finally:
            await nc.close()
