"""The slot scheduler's cost model learns the restore cost per token from real host KV restores (issue 19 #4,
issue 12 #2: the adapter reported every restore as ``restore_tokens=0``, so the prior never moved). A real
a ColdEngine with the slot scheduler (cold/slotted.py), a real in-process kvstore over Mooncake TCP, tiny models on CPU."""

from __future__ import annotations

import pytest

from services.engine.host_kv import HostKV
from services.engine.slots import CostModel, CostProfile, SlotPolicy
from services.engine.cold.engine import ColdEngine
from services.engine.cold.slotted import SlotSwitching
from services.engine.types import EngineRequest, SamplingParams
from services.kvstore.client import KvStoreClient
from tests.unit.host_kv_fixtures import mooncake, run_calls, store  # noqa: F401 - fixtures

A, B = "tiny-llama", "tiny-qwen2"
PRIOR = 123.0  # seconds per token: no real restore costs that, so a learned value cannot equal it
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_restore_cost_is_learned_from_real_restores(synth_models, store, mooncake):
    costs = CostModel(CostProfile(prefill_per_token=1e-9, decode_step=1e-9, restore_per_token=PRIOR), alpha=1.0)
    ce = ColdEngine(
        {m: synth_models[m] for m in (A, B)}, switching=SlotSwitching(SlotPolicy(ttft_s=5.0, tpot_s=0.5), costs), page_size=4,
        kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024,
    )
    ce.attach_host_kv_factory(lambda port: HostKV(port, KvStoreClient(store.address, timeout_s=2.0), mooncake=mooncake, mode="always", staging_bytes=1 << 20))
    run_calls(ce, [EngineRequest("warm-a", list(range(100, 160)), GREEDY, model=A)])  # first steps pay one-off costs
    prompt = list(range(10, 70))
    first = run_calls(ce, [EngineRequest("t1", prompt, GREEDY, session_id="s", model=A)])  # measures A's prefill
    run_calls(ce, [EngineRequest("other", list(range(5, 30)), GREEDY, model=B)])  # switches away: A's device KV is gone
    turn2 = prompt + first["t1:tokens"] + [3, 4, 5, 6]
    second = run_calls(ce, [EngineRequest("t2", turn2, GREEDY, session_id="s", model=A)])
    assert second["t2"].usage.restored_tokens > 0, "the second turn was not restored from the host store"
    learned = ce.switching.slots.costs.restore_per_token(A)
    hk = ce.shell(A).host_kv
    # restores run off the executor thread (issue 19 #3): the cost model learns each real restore's own
    # measured transfer seconds per token, the same measurement the heartbeat reports
    assert hk.restore_per_token.samples == 1 and learned > 0
    assert learned != PRIOR and learned == pytest.approx(hk.restore_per_token.value), (learned, hk.restore_per_token.value)


def test_first_prefill_after_a_switch_counts_only_the_tokens_not_restored(synth_models, store, mooncake):
    """Streaming hot-swap sizes its startup prefix from the compute of the first forward after a switch
    (``first_prefill_tokens``, a lower bound: the slot may admit one call): a waiting return whose session the
    host store holds computes only its new tokens, not its whole context (counting the context made k* too
    short; the simulator showed the stalls)."""
    ce = ColdEngine({m: synth_models[m] for m in (A, B)}, switching=SlotSwitching(SlotPolicy(ttft_s=5.0, tpot_s=0.5)), page_size=4,
                           kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    ce.attach_host_kv_factory(lambda port: HostKV(port, KvStoreClient(store.address, timeout_s=2.0), mooncake=mooncake, mode="always", staging_bytes=1 << 20))
    prompt = list(range(10, 70))
    first = run_calls(ce, [EngineRequest("t1", prompt, GREEDY, session_id="s", model=A)])
    run_calls(ce, [EngineRequest("other", list(range(5, 30)), GREEDY, model=B)])  # A's device KV is gone, its host copy stays
    turn2 = prompt + first["t1:tokens"] + [3, 4, 5, 6]
    ce.add_request(EngineRequest("t2", turn2, GREEDY, session_id="s", model=A))
    ce.add_request(EngineRequest("new", list(range(200, 230)), GREEDY, session_id="n", model=A))
    ce._drain_intake()  # the step's intake only: both wait in A's queue, B stays active (no switch decided)
    assert ce.active == B and len(ce.queues.waiting(A)) == 2
    got = ce.first_prefill_tokens(A)
    # the smallest first forward: the return's suffix (<= 12 tokens), not its context (68) nor the new call (30)
    assert 0 < got <= len(turn2) - len(prompt) + 4, got
