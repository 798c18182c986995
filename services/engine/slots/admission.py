"""Which queued calls a slot admits: queued prefill at slot open (P) and session-prefill (SP) at decode
boundaries (Talaria §3.4).

P admits, first come first served, the calls of the slot's model that were waiting when the slot opened,
while their predicted cost fits the slot's prefill share (always at least one, so an instance under
overload still makes progress; the rest is *deferred* and counted as shortfall).

A call is SP-eligible when it targets the active model, is a continuation (its session had an earlier call
here), arrived after P, and its prefix is device-resident or host-restorable on this instance (host only
with ``host_kv``). At each opportunity the bounded subset whose prefill + restore time fits the budget left
after protected decode, whose KV fits free device memory, and which respects the batch bounds is admitted,
first-fit in arrival order; the rest waits for a later opportunity or the next slot.

Calls without a usable prefix (``new_sessions``). In the paper only returning sessions join a slot
mid-way; a new session's call, or a return whose prefix is gone, waits for its model's next P, a whole round
away even while its model holds the slot. Measured on the Mooncake replay (30 sessions, 5 repetitions): such
calls waited ~1 s each for their slot against ~45 ms for continuations, about a third of all the time calls
spent waiting. With ``new_sessions`` any call of the active model that arrived after P is a candidate; it
pays for its whole prompt's prefill, which the same budget, memory and benefit-vs-harm checks weigh, so it
joins only where the round wait it saves exceeds the delay it imposes. Off by default (``SlotPolicy.sp_new_sessions``):
the check weighs the calls of other models waiting *now*; a new session admitted just before another model's
sessions arrive lengthens the slot they then wait for (and brings its own returns into it), and in
``tests/unit/test_slots_sp_gain.py``'s constructed regime (slow prefill, eight sessions of another model arriving
5 ms later) that made the mean SCT 3-8 % worse than no SP at all. On 20 random three-model workloads it never
lost to no SP and beat the paper's rule (median 0.98x), and on the bench's Mooncake replay it won (bench README);
a check that also weighs the calls expected to arrive during the slot (as ``hold.py`` does) is what would make
it safe to turn on.

SP that cannot lose. Fitting the budget is not enough: SP prefill runs inside the active
model's slot, so it pushes back every call of *another* model that is waiting for its own slot (§3.4: the
other models' P waits for the switch). A fitting call is admitted only when what it saves exceeds what it
costs others, both predicted from the slot cost model's measured costs (``costs.py``, EWMA of executed
steps and switches): the **benefit** is the round wait the returning call avoids — without SP it waits for
the rest of this slot, every other model's slot (its switch in, its queued prefill, its protected decode)
and the switch back (``SpGain.wait_saved_s``, computed by the scheduler); the **harm** is the call's SP cost
(prefill + restore, plus the decode iterations it adds to an undrainable slot) times the calls of other
models waiting (``SpGain.waiting_others``), plus its prefill + restore time for every call of the active
model still decoding (``SpGain.decoding_same``): chunked prefill puts the SP call's prefill chunks into the
steps those calls decode in, so each of them finishes that much later (on a CPU a 512-token chunk
turns a ~10 ms decode step into ~0.5 s). ``harm > benefit`` defers the call with reason ``no_gain``; it
then joins the next P of its model, exactly as without SP, so SP can only move a call earlier when that
pays. With no other model waiting and nothing of its own model decoding the harm is 0 and SP admits as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .costs import CostModel
from .types import CallView, SpVerdict


@dataclass(frozen=True, slots=True)
class SpGain:
    """What SP at this opportunity is worth (predicted from measured costs by the scheduler)."""

    wait_saved_s: float  # round wait a returning call avoids: the time until its model's next slot opens
    waiting_others: int  # calls of other models waiting for their slots (each delayed by an SP call's cost)
    decoding_same: int = 0  # calls of the active model decoding now (each delayed by the SP call's prefill steps)

    def verdict(self, cost_s: float, step_s: float | None = None) -> tuple[bool, float, float]:
        """(pays, benefit, harm) of one SP call costing ``cost_s`` (its prefill + restore, plus any decode
        iterations it adds to the slot), of which ``step_s`` (default ``cost_s``) runs in the decoding calls'
        steps: pays when the harm is 0 or the benefit exceeds it."""
        harm = cost_s * self.waiting_others + (cost_s if step_s is None else step_s) * self.decoding_same
        return harm <= 0.0 or self.wait_saved_s > harm, self.wait_saved_s, harm


@dataclass(frozen=True, slots=True)
class SpLimits:
    max_batch: int = 8  # calls per SP batch
    max_tokens: int = 4096  # prefill + restore tokens per SP batch


def sp_ineligible_reason(c: CallView, *, active: str | None, p_opened: float, sp: bool, host_kv: bool,
                         new_sessions: bool = False) -> str | None:
    """None when ``c`` is SP-eligible, else the reason it is not (checked in this order). ``new_sessions``:
    a call without a usable prefix is eligible too (module note); it is priced with its whole prefill."""
    if not sp:
        return "sp_off"
    if c.model != active:
        return "wrong_model"
    if not new_sessions and (not c.continuation or not c.session_id):
        return "new_session"
    if c.arrival <= p_opened:
        return "arrived_before_p"
    if new_sessions:
        return None  # costs.call prices what it needs: its device prefix, a host restore, or a full prefill
    if c.prefix_state == "missing" or c.prefix_tokens <= 0:
        return "prefix_missing"
    if c.prefix_state == "host" and not host_kv:
        return "host_kv_off"
    return None


def select_sp(
    eligible: Sequence[CallView],
    *,
    budget_s: float,
    free_kv_tokens: int | None,
    costs: CostModel,
    host_kv: bool,
    limits: SpLimits,
    drain_iters: int | None = None,
    t_decode: float = 0.0,
    gain: SpGain | None = None,
) -> list[SpVerdict]:
    """First-fit in arrival order under the time budget, device memory and batch bounds; with ``gain``, a
    call that fits is admitted only when its benefit exceeds its harm (else ``no_gain``; module docstring).

    ``drain_iters``: for an executor that cannot park calls at a switch, the decode iterations the slot
    already has to run; a call needing more (``max_tokens``) also costs the extra iterations it adds to
    the drain (the longest call of the batch sets it). None: calls can be parked, no extension."""
    out: list[SpVerdict] = []
    used_s, used_tokens, used_kv, n = 0.0, 0, 0, 0
    horizon = drain_iters or 0
    for c in sorted(eligible, key=lambda c: (c.arrival, c.request_id)):
        cc = costs.call(c, host_kv)
        work = cc.prefill_tokens + cc.restore_tokens
        ext = max(0, c.max_tokens - horizon) if drain_iters is not None else 0
        cost = cc.seconds + ext * t_decode
        if n >= limits.max_batch or used_tokens + work > limits.max_tokens:
            out.append(SpVerdict(c.request_id, False, "batch_limit", cost))
        elif used_s + cost > budget_s:
            out.append(SpVerdict(c.request_id, False, "budget", cost))
        elif free_kv_tokens is not None and used_kv + cc.kv_tokens > free_kv_tokens:
            out.append(SpVerdict(c.request_id, False, "memory", cost))
        elif gain is not None and not (g := gain.verdict(cost, cc.seconds))[0]:
            out.append(SpVerdict(c.request_id, False, "no_gain", cost, g[1], g[2]))
        else:
            b, h = gain.verdict(cost, cc.seconds)[1:] if gain is not None else (0.0, 0.0)
            out.append(SpVerdict(c.request_id, True, "admitted", cost, b, h))
            used_s += cost
            used_tokens += work
            used_kv += cc.kv_tokens
            horizon += ext
            n += 1
    return out


def select_p(queued: Sequence[CallView], *, budget_s: float, costs: CostModel, host_kv: bool) -> tuple[list[CallView], list[CallView], float, float]:
    """P admission: FCFS while the predicted cost fits ``budget_s`` (at least one call).
    Returns (admitted, deferred, admitted seconds, deferred seconds)."""
    admitted: list[CallView] = []
    deferred: list[CallView] = []
    used = over = 0.0
    for c in queued:
        s = costs.call(c, host_kv).seconds
        if not deferred and (not admitted or used + s <= budget_s):
            admitted.append(c)
            used += s
        else:
            deferred.append(c)
            over += s
    return admitted, deferred, used, over
