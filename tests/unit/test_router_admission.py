"""The gateway's admission state machine (issue 18 items 4-5, issue 19 item 7): start-now fallback, the
overload policy, the context limit and retries, under a manual clock (no NATS, no HTTP)."""

from __future__ import annotations

import pytest

from services.router.gateway import Gateway, OverloadPolicy, PoolSpec
from services.router.leases import LeaseTable
from services.router.policy import PolicyParams
from services.router.profiles import ShapeBook
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from talaria.v1 import engine_pb2 as pb

CTX = 4096


def snap(iid, seq, clock, waiting=0, running=0, prefill=1e-3, period=0.5, model="m"):
    s = pb.InstanceSnapshot(instance_id=iid, epoch=1, seq=seq, heartbeat_period_s=period, num_waiting=waiting, num_running=running, sent_unix=clock.now())
    s.models.append(pb.ModelState(model=model, loaded=True, active=True, max_context=CTX))
    s.profile.CopyFrom(pb.CostProfile(prefill_per_token=prefill, decode_step=0.01))
    return s


def gateway(clock, slots=4, ids=("a",), budget=60.0):
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
    pools = {i: PoolSpec("hot", ("m",), 16, max_num_seqs=slots) for i in ids}
    return Gateway(PolicyParams(admission_budget_s=budget), reg, SessionTable(clock), LeaseTable(), clock.now, tau_s=0, pools=pools, shapes=ShapeBook())


def test_idle_instance_takes_a_call_its_prediction_calls_slow():
    """Issue 18 item 5: a 4,030-token prompt to an idle engine predicted at ~121 s TTFT (> 60 s budget) is
    forwarded ("start-now") with the prediction reported as a deadline risk, not answered 429."""
    clock = ManualClock(100.0)
    gw = gateway(clock)
    gw.on_snapshot(snap("a", 1, clock, prefill=0.03))
    r = gw.request("s", "m", 4030, 16)
    d, _ = gw.decide(r)
    assert d.reason == "overload"  # the policy's own verdict is unchanged
    step = gw.admission(r, OverloadPolicy("reject")).next()
    assert (step.kind, step.decision.instance_id, step.decision.reason) == ("forward", "a", "start-now")
    assert step.deadline_risk_s == pytest.approx(d.costs[0].predicted_ttft_s) and step.deadline_risk_s > 60
    assert gw.stats["admitted_start_now"] == 1 and gw.stats["deadline_risk"] == 1


def test_least_loaded_with_a_free_slot_starts_now_a_queue_ahead_does_not():
    clock = ManualClock(100.0)
    gw = gateway(clock, slots=4, ids=("a", "b"))
    gw.on_snapshot(snap("a", 1, clock, running=3, prefill=0.03))
    gw.on_snapshot(snap("b", 1, clock, running=1, prefill=0.03))
    step = gw.admission(gw.request("s", "m", 4030, 16), OverloadPolicy("reject")).next()
    assert (step.kind, step.decision.instance_id) == ("forward", "b")
    # every slot taken or a queue ahead: a real overload, 429 with the policy's Retry-After
    gw.on_snapshot(snap("a", 2, clock, running=4, prefill=0.03))
    gw.on_snapshot(snap("b", 2, clock, running=1, waiting=2, prefill=0.03))
    step = gw.admission(gw.request("s2", "m", 4030, 16), OverloadPolicy("reject")).next()
    assert (step.kind, step.status, step.code) == ("reject", 429, "overloaded")
    assert step.retry_after_s >= 1.0 and gw.stats["overload_rejected"] == 1
    # the message says why each instance refused it (an operator reading a 429 sees which check and by how much)
    assert "a: predicted TTFT" in step.message and "b: predicted TTFT" in step.message and "over the 60 s budget" in step.message


def test_in_flight_overlay_counts_against_the_free_slots():
    clock = ManualClock(100.0)
    gw = gateway(clock, slots=2)
    gw.on_snapshot(snap("a", 1, clock, prefill=0.03))
    kinds = []
    for i in range(3):
        r = gw.request(f"s{i}", "m", 4030, 16)
        step = gw.admission(r, OverloadPolicy("reject")).next()
        kinds.append(step.kind)
        if step.kind == "forward":
            gw.commit(r, step.decision)
    assert kinds == ["forward", "forward", "reject"]


def test_over_the_context_is_never_429():
    """Issue 18 item 4: a busy model and a prompt over its context. Token ids are exact: 413 here. Text is
    estimated: forwarded to the least loaded instance, whose tokenizer answers 413."""
    clock = ManualClock(100.0)
    gw = gateway(clock, slots=1)
    gw.on_snapshot(snap("a", 1, clock, running=1, waiting=5))
    exact = gw.admission(gw.request("", "m", CTX + 10, 16), OverloadPolicy("reject"), prompt_exact=True).next()
    assert (exact.kind, exact.status, exact.code, exact.param) == ("reject", 413, "context_length_exceeded", "prompt")
    assert exact.retry_after_s == 0
    text = gw.admission(gw.request("", "m", 90_000, 16), OverloadPolicy("queue", queue_max=0)).next()
    assert (text.kind, text.decision.instance_id, text.decision.reason) == ("forward", "a", "start-now")


def test_text_that_can_never_fit_is_413_before_it_is_sent():
    """Issue 47: a text prompt whose lower bound (bytes over the tokenizer's most bytes per token) is over the
    context is 413 at the router, idle instance or not, naming the field; one the bound lets through (its
    estimate may be over, the engine decides) is forwarded; without a reported bound nothing changes."""
    clock = ManualClock(100.0)
    gw = gateway(clock)
    s = snap("a", 1, clock)
    s.models[0].max_token_bytes = 100
    gw.on_snapshot(s)
    never = gw.admission(gw.request("", "m", 1_200_000, 16), OverloadPolicy("reject"), prompt_bytes=4_800_000, prompt_param="messages").next()
    assert (never.kind, never.status, never.code, never.param) == ("reject", 413, "context_length_exceeded", "messages")
    assert "at least 48000 tokens" in never.message and "100 bytes per token" in never.message
    maybe = gw.admission(gw.request("", "m", 100_000, 16), OverloadPolicy("reject"), prompt_bytes=400_000).next()
    assert maybe.kind == "forward"  # 4,000 tokens at least: the engine's tokenizer decides
    unknown = gateway(clock)
    unknown.on_snapshot(snap("a", 1, clock))
    assert unknown.admission(unknown.request("", "m", 1_200_000, 16), OverloadPolicy("reject"), prompt_bytes=4_800_000).next().kind == "forward"


def test_queue_waits_on_the_injected_clock_then_429_and_leaves_the_queue():
    clock = ManualClock(100.0)
    gw = gateway(clock, slots=1)
    gw.on_snapshot(snap("a", 1, clock, running=1, waiting=1, prefill=0.03, period=100.0))
    pol = OverloadPolicy("queue", queue_max=1, queue_timeout_s=2.0, poll_s=0.5)
    adm = gw.admission(gw.request("s", "m", 4030, 16), pol)
    waits = []
    while (step := adm.next()).kind == "wait":
        waits.append(step.wait_s)
        assert gw.queued == 1
        other = gw.admission(gw.request("o", "m", 4030, 16), pol).next()  # the queue holds one
        assert (other.kind, other.status) == ("reject", 429) and "full" in other.message
        clock.advance(step.wait_s)
    assert waits == [0.5, 0.5, 0.5, 0.5]
    assert (step.kind, step.status, step.code) == ("reject", 429, "overloaded") and "within 2s" in step.message
    assert gw.queued == 0 and gw.stats["overload_queue_timeouts"] == 1


def test_a_queued_call_leaves_the_queue_when_an_instance_frees_up():
    clock = ManualClock(100.0)
    gw = gateway(clock, slots=1)
    gw.on_snapshot(snap("a", 1, clock, running=1, waiting=1, prefill=0.03))
    adm = gw.admission(gw.request("s", "m", 4030, 16), OverloadPolicy("queue", queue_timeout_s=10.0))
    assert adm.next().kind == "wait" and gw.queued == 1
    clock.advance(0.05)
    gw.on_snapshot(snap("a", 2, clock, prefill=0.03))  # idle now
    step = adm.next()
    assert (step.kind, step.decision.instance_id) == ("forward", "a") and gw.queued == 0
    adm.close()
    assert gw.queued == 0


def test_retries_exclude_instances_that_did_not_accept_then_503():
    clock = ManualClock(100.0)
    gw = gateway(clock, ids=("a", "b", "c", "d"))
    for i in "abcd":
        gw.on_snapshot(snap(i, 1, clock))
    adm = gw.admission(gw.request("s", "m", 100, 16), OverloadPolicy(max_attempts=3))
    seen = []
    while (step := adm.next()).kind == "forward":
        seen.append(step.decision.instance_id)
        adm.failed(step.decision.instance_id, "did not accept")
    assert len(seen) == 3 and len(set(seen)) == 3
    assert (step.status, step.code) == (503, "engine_unavailable") and step.retry_after_s == 1.0


def test_unknown_model_is_404_known_but_unhealthy_is_503():
    clock = ManualClock(100.0)
    gw = gateway(clock)
    gw.on_snapshot(snap("a", 1, clock, period=0.5))
    step = gw.admission(gw.request("s", "nope", 10, 4), OverloadPolicy()).next()
    assert (step.kind, step.status, step.code, step.param) == ("reject", 404, "model_not_found", "model")
    clock.advance(60)  # heartbeats stopped
    step = gw.admission(gw.request("s", "m", 10, 4), OverloadPolicy()).next()
    assert (step.status, step.code) == (503, "no_healthy_instance")


def test_a_late_only_instance_still_gets_the_call():
    """A single instance whose snapshot is past the staleness limit (2 periods) but whose heartbeats are within
    the miss limit is healthy: the call goes there (placement "late"), not 503. Once it is silent past the miss
    limit it is suspect, and only then does the call fail with 503 no_healthy_instance."""
    clock = ManualClock(100.0)
    gw = gateway(clock)  # period 0.5 s: stale after 1 s, suspect after 1.5 s
    gw.on_snapshot(snap("a", 1, clock))
    clock.advance(1.2)
    d, _ = gw.decide(gw.request("s", "m", 100, 16))
    assert d.reason == "no-instance" and d.costs[0].reject == "stale"  # the policy's verdict is unchanged
    step = gw.admission(gw.request("s", "m", 100, 16), OverloadPolicy("reject")).next()
    assert (step.kind, step.decision.instance_id, step.decision.reason) == ("forward", "a", "late")
    assert gw.stats["admitted_late"] == 1
    clock.advance(0.5)  # 1.7 s of silence: suspect
    gw.registry.dead_after_s = 20.0  # as the service configures it (engine_dead_after_s): silent, not dead
    adm = gw.admission(gw.request("s2", "m", 100, 16), OverloadPolicy("reject", silence_waits=2))
    steps = [adm.next() for _ in range(3)]  # silent, not dead: it waits for a heartbeat twice, then 503
    assert [s.kind for s in steps] == ["wait", "wait", "reject"] and steps[0].wait_s == OverloadPolicy().poll_s
    assert (steps[2].status, steps[2].code) == (503, "no_healthy_instance") and gw.stats["silence_waits"] == 2


def test_a_call_waits_for_the_heartbeat_of_a_silent_instance_and_then_goes_there():
    """A router whose loop was busy sees its only instance silent past the miss limit while the heartbeats wait
    unread: the call waits (poll_s at a time, bounded) instead of a 503, and goes to the instance once a
    heartbeat is read. A dead instance (gone) or one that refused a call is not waited for."""
    clock = ManualClock(100.0)
    gw = gateway(clock)  # period 0.5 s: suspect after 1.5 s of silence
    gw.registry.dead_after_s = 20.0  # as the service configures it (engine_dead_after_s)
    gw.on_snapshot(snap("a", 1, clock))
    clock.advance(1.7)
    adm = gw.admission(gw.request("s", "m", 100, 16), OverloadPolicy("reject"))
    assert adm.next().kind == "wait"
    gw.on_snapshot(snap("a", 2, clock))  # the heartbeat the busy loop had not read yet
    step = adm.next()
    assert (step.kind, step.decision.instance_id) == ("forward", "a")
    gw.registry.mark_suspect("a", 5.0)  # refused a call: no waiting for it
    step = gw.admission(gw.request("s2", "m", 100, 16), OverloadPolicy("reject")).next()
    assert (step.kind, step.code) == ("reject", "no_healthy_instance")
    clock.advance(25.0)  # silent past engine_dead_after_s: dead, not waited for
    step = gw.admission(gw.request("s3", "m", 100, 16), OverloadPolicy("reject")).next()
    assert (step.kind, step.code) == ("reject", "no_healthy_instance") and gw.stats["silence_waits"] == 1


def test_a_late_instance_is_not_chosen_over_a_fresh_one():
    clock = ManualClock(100.0)
    gw = gateway(clock, ids=("a", "b"))
    gw.on_snapshot(snap("a", 1, clock))
    clock.advance(1.2)
    gw.on_snapshot(snap("b", 1, clock, running=3))
    step = gw.admission(gw.request("s", "m", 100, 16), OverloadPolicy("reject")).next()
    assert (step.kind, step.decision.instance_id) == ("forward", "b") and step.decision.reason != "late"


def test_overload_reasons_name_each_check():
    from services.router.gateway import overload_reasons
    from services.router.policy import Decision, cost_breakdown

    def cb(iid, reject, ttft=0.0, pages=0):
        return cost_breakdown(instance_id=iid, delta_r=1.0, c_kv=0.0, c_act=0.0, queue_s=1.0, kv_source="none", act="active",
                              predicted_ttft_s=ttft, pages_needed=pages, reject=reject)

    d = Decision(None, "full", "overload", costs=(cb("a", "round-admission", ttft=75.25), cb("b", "memory", pages=240), cb("c", "unhealthy")))
    msg = overload_reasons(d, 60.0)
    assert msg == " (a: predicted TTFT 75.2 s over the 60 s budget; b: KV memory, 240 pages needed beyond what its running and queued calls hold)"
    assert overload_reasons(Decision(None, "full", "overload"), 60.0) == ""
