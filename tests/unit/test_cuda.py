"""The engine on a CUDA device (issue 20 §4). Marked ``cuda``: skipped without a GPU; ``bench/device-check``
runs them on a lent GPU machine. Until that has run, the CUDA path is untested.

Same contracts as on the CPU: fp32 logits match transformers on the same device (TF32 off), greedy
engine tokens batched == unbatched == transformers, bf16 within the CPU bf16 tolerance of fp32, and the
paged KV written in place on the device.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.model.batch import AttnBatch
from services.engine.model.loader import allocate_kv_cache, auto_dtype, load_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run bench/device-check on one)"),
]
transformers = pytest.importorskip("transformers")

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
DEV = "cuda:0"
PAGE = 16


@pytest.fixture(autouse=True)
def no_tf32():
    prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def _forward(model, kv, ids, start, pages, ctx):
    pos = torch.arange(start, start + len(ids))
    slots = torch.tensor(pages)[pos // PAGE] * PAGE + pos % PAGE
    batch = AttnBatch([0, len(ids)], [ctx], [pages], slots.to(DEV))
    return model.compute_logits(model(ids.to(DEV), pos.to(DEV), batch, kv))


@pytest.mark.parametrize("name", ARCHS)
def test_cuda_logits_match_hf_on_the_same_device(synth_models, name):
    ours, cfg = load_model(synth_models[name], device=DEV, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(synth_models[name]), dtype=torch.float32).to(DEV).eval()
    ids = _prompt(150, 1)
    with torch.no_grad():
        ref = hf(ids[None].to(DEV)).logits[0].float()
    kv = allocate_kv_cache(cfg, 16, PAGE, device=DEV)
    assert kv.k[0].device.type == "cuda"
    got = _forward(ours, kv, ids, 0, list(range(15, 5, -1)), 150)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("name", ARCHS)
def test_cuda_engine_greedy_batched_equals_unbatched_equals_hf(synth_models, name):
    from services.engine.executor import Engine
    from services.engine.types import SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(synth_models[name]), dtype=torch.float32).to(DEV).eval()
    prompts = [_prompt(n, 40 + n).tolist() for n in (5, 23, 11, 37)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=DEV), do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    batched = Engine(synth_models[name], device=DEV, dtype=torch.float32, page_size=4, num_pages=128, max_num_batched_tokens=16)
    assert batched.generate(prompts, sp) == refs
    assert batched.runner.decode_graphs is not None and batched.runner.decode_graphs.replays > 0  # decode replayed CUDA graphs
    single = Engine(synth_models[name], device=DEV, dtype=torch.float32, page_size=4, num_pages=128)
    assert [single.generate([p], sp)[0] for p in prompts] == refs
    batched.check_integrity()


def test_cuda_bf16_within_tolerance_and_auto_dtype(synth_models):
    assert auto_dtype(DEV) in (torch.bfloat16, torch.float16)
    ids = _prompt(150, 1)
    full, cfg = load_model(synth_models["tiny-llama"], device=DEV, dtype=torch.float32)
    low, _ = load_model(synth_models["tiny-llama"], device=DEV, dtype=torch.bfloat16)
    ref = _forward(full, allocate_kv_cache(cfg, 10, PAGE, device=DEV), ids, 0, list(range(10)), 150)
    got = _forward(low, allocate_kv_cache(cfg, 10, PAGE, device=DEV, dtype=torch.bfloat16), ids, 0, list(range(10)), 150)
    assert (got - ref).abs().max().item() <= 0.1  # the CPU bound, test_model_parity.BF16_MAX_ABS
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def test_cuda_decode_graphs_equal_eager_steps_across_buckets(synth_models):
    """Captured decode graphs (model/cuda_graphs.py) vs the same engine eager: padded batch buckets (3 and 5
    sequences), contexts growing past the graphs' 80-token limit (those steps eager again), same tokens."""
    from services.engine.executor import Engine
    from services.engine.types import SamplingParams

    prompts = [_prompt(n, 70 + n).tolist() for n in (5, 23, 11, 37, 50)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(device=DEV, dtype=torch.float32, page_size=4, num_pages=256, max_num_batched_tokens=64, max_num_seqs=8)
    eager = Engine(synth_models["tiny-qwen2"], cuda_graphs="off", **kw)
    assert eager.runner.decode_graphs is None
    graphs = Engine(synth_models["tiny-qwen2"], cuda_graph_max_context=80, **kw)
    assert graphs.runner.decode_graphs.captured and graphs.runner.decode_graphs.max_context == 80
    for batch in (prompts[:3], prompts):
        assert graphs.generate(batch, sp) == eager.generate(batch, sp)
    assert graphs.runner.decode_graphs.replays > 0
    graphs.check_integrity()


def test_cuda_restore_from_host_equals_uninterrupted(synth_models):
    """Session KV checkpointed from the CUDA pool to a real kvstore over Mooncake, evicted, and restored
    (host_kv.py: one device->host copy per checkpoint part, one host->device copy per restore part) gives
    the tokens of an engine that kept the KV on the device."""
    from services.engine.executor import Engine
    from services.kvstore.server import KvStoreServer
    from services.kvstore.transfer import MooncakeEndpoint
    from talaria.config import KvStoreConfig
    from tests.unit.test_host_kv import PAGE as KV_PAGE, prompt_for, tier, two_turns

    def engine():
        return Engine(synth_models["tiny-qwen3"], device=DEV, dtype=torch.float32, page_size=KV_PAGE, num_pages=128)

    ref = engine()
    p = prompt_for(ref, 20)
    expected = two_turns(ref, p)[:2]
    store, mc = KvStoreServer(KvStoreConfig(capacity_mb=64, slab_kb=4)), MooncakeEndpoint()
    store.start()
    try:
        e = engine()
        hk = tier(e, store.address, mc, staging_bytes=64 << 10)  # several parts per checkpoint and restore

        def evict():
            assert e.drain_checkpoints(timeout=10)
            assert e.flush_cache() > 0

        out1, out2, usage = two_turns(e, p, evict, session="cuda")
        assert (out1, out2) == expected
        assert hk.counters["restores"] == 1 and usage.cached_tokens >= (len(p) // KV_PAGE) * KV_PAGE
        hk.close()
    finally:
        mc.close()
        store.stop()
