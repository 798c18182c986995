"""Decode CUDA graphs (services/engine/model/cuda_graphs.py, issue 20 §4): the bucketed static body a graph
records -- padding rows that repeat row 0, block tables padded to the context bucket, the in-graph mask and
sliding window -- gives the same hidden states as ``forward`` and the same greedy tokens inside the engine.
On this CPU the body runs eagerly (``capture=False``); tests/unit/test_cuda.py replays captured graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine.executor import Engine
from services.engine.model.batch import AttnBatch
from services.engine.model.cuda_graphs import DecodeGraphs
from services.engine.model.loader import allocate_kv_cache, load_model
from services.engine.types import SamplingParams

PAGE = 4


def _fill(model, kv, tables, lens, seed):
    """Prefill each sequence's first ``lens[i] - 1`` tokens into its pages; returns the next token ids."""
    g = torch.Generator().manual_seed(seed)
    nxt = []
    for table, n in zip(tables, lens):
        ids = torch.randint(3, 200, (n,), generator=g)
        pos = torch.arange(n - 1)
        slots = torch.tensor(table)[pos // PAGE] * PAGE + pos % PAGE
        model(ids[:-1], pos, AttnBatch([0, n - 1], [n - 1], [table], slots), kv)
        nxt.append(int(ids[-1]))
    return nxt


def _decode_inputs(tables, lens, nxt):
    pos = [n - 1 for n in lens]
    slots = [t[p // PAGE] * PAGE + p % PAGE for t, p in zip(tables, pos)]
    ivs = torch.tensor(nxt + pos + slots, dtype=torch.int64)
    return ivs, AttnBatch(list(range(len(lens) + 1)), list(lens), [list(t) for t in tables], ivs[2 * len(lens):])


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("lens", [[9], [3, 17, 9], [21, 5, 12, 8, 2]])
def test_bucketed_body_equals_forward(synth_models, lens, window):
    model, cfg = load_model(synth_models["tiny-llama"], device="cpu", dtype=torch.float32)
    model.config = dataclasses.replace(cfg, sliding_window=window)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(lens))]
    kv_ref = allocate_kv_cache(cfg, 8 * len(lens), PAGE)
    nxt = _fill(model, kv_ref, tables, lens, seed=len(lens))
    kv = allocate_kv_cache(cfg, 8 * len(lens), PAGE)
    for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
        a.copy_(b)
    ivs, batch = _decode_inputs(tables, lens, nxt)
    ref = model(ivs[: len(lens)], ivs[len(lens): 2 * len(lens)], batch, kv_ref)
    graphs = DecodeGraphs(model, kv, max_batch=8, max_context=32, capture=False, context_buckets=(8, 16))
    bucket = graphs.bucket_for(batch, len(lens))
    assert bucket.batch >= len(lens) and bucket.pages * PAGE >= max(lens)
    assert bucket.batch > len(lens) or len(lens) == 1  # 3 and 5 sequences replay padded buckets (4, 8)
    got = graphs.run(bucket, ivs, batch)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):  # the padding rows wrote nothing else
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # rounding of a larger matmul; a stray write is O(1)


def test_steps_that_run_eagerly(synth_models):
    model, cfg = load_model(synth_models["tiny-llama"], device="cpu", dtype=torch.float32)
    graphs = DecodeGraphs(model, allocate_kv_cache(cfg, 64, PAGE), max_batch=4, max_context=32, capture=False,
                          context_buckets=(8,))
    assert graphs.batch_buckets == [1, 2, 4] and graphs.page_buckets == [2, 8]
    pages = [list(range(8))] * 5
    dec = lambda lens: AttnBatch(list(range(len(lens) + 1)), lens, pages[: len(lens)], torch.zeros(len(lens), dtype=torch.long))
    assert graphs.bucket_for(dec([5, 30]), 2) is not None
    assert graphs.bucket_for(dec([5, 33]), 2) is None  # longer than the largest context bucket
    assert graphs.bucket_for(dec([5] * 5), 5) is None  # more sequences than captured
    assert graphs.bucket_for(AttnBatch([0, 3], [7], pages[:1], torch.zeros(3, dtype=torch.long)), 3) is None  # prefill
    model.layer_gate = lambda layer: None  # streaming hot-swap gates the layers
    assert graphs.bucket_for(dec([5]), 1) is None
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, allocate_kv_cache(cfg, 8, PAGE), max_batch=4)


def test_engine_greedy_tokens_through_the_bucketed_body(synth_models):
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 23, 11)]
    kw = dict(device="cpu", dtype=torch.float32, page_size=PAGE, num_pages=64, max_num_batched_tokens=16)
    eager = Engine(synth_models["tiny-qwen3"], **kw)
    assert eager.runner.decode_graphs is None  # auto on a CPU: nothing to capture
    ref = eager.generate(prompts, sp)
    ours = Engine(synth_models["tiny-qwen3"], **kw)
    ours.runner.decode_graphs = DecodeGraphs(ours.model, ours.kv_cache, max_batch=4, max_context=64, capture=False,
                                      context_buckets=(16,))
    assert ours.generate(prompts, sp) == ref
    assert ours.runner.decode_graphs.replays >= 10  # the decode steps went through the bucketed body
    ours.check_integrity()
    with pytest.raises(ValueError, match="cuda_graphs"):
        Engine(synth_models["tiny-qwen3"], cuda_graphs="on", **kw)
