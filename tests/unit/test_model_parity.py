"""Parity of the native paged-KV model with Hugging Face transformers on synthesized checkpoints.

Tolerances (fp32 throughout): logits may differ by at most ``ATOL + RTOL * |ref|`` elementwise with
ATOL = 1e-4, RTOL = 1e-5 (the only differences are summation order in matmul/attention kernels).
"""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.model.batch import AttnBatch
from services.engine.model.config import ModelConfig
from services.engine.model.loader import allocate_kv_cache, load_model

transformers = pytest.importorskip("transformers")

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
ATOL, RTOL = 1e-4, 1e-5
PAGE = 16

_cache: dict[str, tuple] = {}


def _models(synth_models, name):
    if name not in _cache:
        path = synth_models[name]
        ours, cfg = load_model(path, dtype=torch.float32)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        _cache[name] = (ours, cfg, hf)
    return _cache[name]


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def _slots(pages: list[int], start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return torch.tensor(pages, dtype=torch.long)[pos // PAGE] * PAGE + pos % PAGE


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def _run(model, kv, chunks):
    """chunks: list of (ids, start_pos, pages, ctx_len) for one flat batch; returns hidden [T, H]."""
    ids = torch.cat([c[0] for c in chunks])
    positions = torch.cat([torch.arange(c[1], c[1] + len(c[0])) for c in chunks])
    return model(ids, positions, _batch_of(chunks), kv)


def _batch_of(chunks) -> AttnBatch:
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + len(c[0]))
    return AttnBatch(
        cu_q=cu,
        context_lens=[c[3] for c in chunks],
        block_tables=[c[2] for c in chunks],
        slot_mapping=torch.cat([_slots(c[2], c[1], c[1] + len(c[0])) for c in chunks]),
    )


@pytest.mark.parametrize("name", ARCHS)
def test_full_prompt_logits_match_hf(synth_models, name):
    ours, cfg, hf = _models(synth_models, name)
    ids = _prompt(150, seed=1)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    kv = allocate_kv_cache(cfg, num_pages=16, page_size=PAGE)
    pages = list(range(15, 5, -1))  # 10 pages, reversed order
    hidden = _run(ours, kv, [(ids, 0, pages, len(ids))])
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    _assert_close(logits, ref)
    # Guard against a trivially "passing" comparison: the model must not be degenerate.
    assert ref.argmax(-1).unique().numel() > 20


@pytest.mark.parametrize("name", ARCHS)
def test_chunked_prefill_over_shuffled_pages(synth_models, name):
    ours, cfg, _ = _models(synth_models, name)
    ids = _prompt(100, seed=2)
    kv1 = allocate_kv_cache(cfg, num_pages=12, page_size=PAGE)
    one_shot = ours.compute_logits(_run(ours, kv1, [(ids, 0, list(range(7)), 100)]))

    pages = list(range(12))
    random.Random(0).shuffle(pages)
    pages = pages[:7]  # non-contiguous, out of order
    kv2 = allocate_kv_cache(cfg, num_pages=12, page_size=PAGE)
    bounds = [0, 23, 61, 100]  # chunk boundaries not aligned to pages
    last = None
    for a, b in zip(bounds, bounds[1:]):
        h = _run(ours, kv2, [(ids[a:b], a, pages[: (b + PAGE - 1) // PAGE], b)])
        last = ours.compute_logits(h)
        _assert_close(last, one_shot[a:b])
    _assert_close(last[-1], one_shot[-1])
    # The cache contents must be identical too (same tokens, same positions).
    slots1, slots2 = _slots(list(range(7)), 0, 100), _slots(pages, 0, 100)
    for l in range(cfg.num_hidden_layers):
        _assert_close(kv2.k[l][slots2], kv1.k[l][slots1])
        _assert_close(kv2.v[l][slots2], kv1.v[l][slots1])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_mixed_batch_equals_individual_runs(synth_models, name):
    ours, cfg, _ = _models(synth_models, name)
    a, b, c = _prompt(37, 3), _prompt(5, 4), _prompt(70, 5)

    # Individually (fresh cache each).
    solo = []
    for ids in (a, b, c):
        kv = allocate_kv_cache(cfg, num_pages=8, page_size=PAGE)
        solo.append(ours.compute_logits(_run(ours, kv, [(ids, 0, list(range(8))[: (len(ids) + PAGE - 1) // PAGE], len(ids))])))

    # One flat batch: a as a fresh prefill; b already has 3 tokens cached (decode-like continuation);
    # c is the second chunk of a prefill whose first 40 tokens are cached.
    kv = allocate_kv_cache(cfg, num_pages=16, page_size=PAGE)
    pa, pb, pc = [9, 2, 14], [5], [0, 11, 3, 7, 12]
    _run(ours, kv, [(b[:3], 0, pb, 3), (c[:40], 0, pc[:3], 40)])
    h = _run(ours, kv, [(a, 0, pa, 37), (b[3:], 3, pb, 5), (c[40:], 40, pc, 70)])
    logits = ours.compute_logits(h)
    _assert_close(logits[:37], solo[0])
    _assert_close(logits[37:39], solo[1][3:])
    _assert_close(logits[39:], solo[2][40:])


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_continuation_matches_hf_generate(synth_models, name):
    ours, cfg, hf = _models(synth_models, name)
    ids = _prompt(12, seed=6)
    n_new = 20
    with torch.no_grad():
        ref = hf.generate(ids[None], do_sample=False, max_new_tokens=n_new, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()

    kv = allocate_kv_cache(cfg, num_pages=8, page_size=PAGE)
    pages = [6, 1, 4]
    out: list[int] = []
    h = _run(ours, kv, [(ids, 0, pages, len(ids))])
    pos = len(ids)
    for _ in range(n_new):
        tok = int(ours.compute_logits(h[-1:]).argmax(-1))
        out.append(tok)
        h = _run(ours, kv, [(torch.tensor([tok]), pos, pages, pos + 1)])
        pos += 1
    assert out == ref
    assert len(set(out)) > 3, "random model collapsed; synthesizer init is degenerate"


def test_forward_writes_only_slot_mapping(synth_models):
    ours, cfg, _ = _models(synth_models, "tiny-llama")
    kv = allocate_kv_cache(cfg, num_pages=4, page_size=PAGE)
    for t in kv.k + kv.v:
        t.fill_(7.0)
    ids = _prompt(20, seed=7)
    _run(ours, kv, [(ids[:10], 0, [2, 0], 10)])  # first chunk only: a fake "cached" prefix
    before = [t.clone() for t in kv.k + kv.v]
    slots = _slots([2, 0], 10, 20)
    _run(ours, kv, [(ids[10:], 10, [2, 0], 20)])
    untouched = torch.ones(4 * PAGE, dtype=torch.bool)
    untouched[slots] = False
    for t0, t1 in zip(before, kv.k + kv.v):
        assert torch.equal(t0[untouched], t1[untouched])
        assert not torch.equal(t0[slots], t1[slots])


def test_kv_cache_is_one_tensor_with_views(synth_models):
    cfg = ModelConfig.from_dir(synth_models["tiny-qwen3"])
    kv = allocate_kv_cache(cfg, num_pages=3, page_size=8)
    assert len(kv.k) == len(kv.v) == cfg.num_hidden_layers and kv.page_size == 8
    assert kv.k[0].shape == (24, cfg.num_key_value_heads, cfg.head_dim)
    base = kv.k[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in kv.k + kv.v)
    ptrs = {t.data_ptr() for t in kv.k + kv.v}
    assert len(ptrs) == 2 * cfg.num_hidden_layers


# ------------------------------------------------------------------------------------ config / loader


def _base_cfg(**over):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 100,
    }
    cfg.update(over)
    return cfg


def test_config_parsing_variants():
    c = ModelConfig.from_dict(_base_cfg(eos_token_id=[5, 7], dtype="bfloat16"))
    assert c.head_dim == 16 and c.eos_token_id == (5, 7) and c.dtype == "bfloat16" and c.rope_theta == 10000.0
    c = ModelConfig.from_dict(_base_cfg(eos_token_id=3, torch_dtype="float16", head_dim=32))
    assert c.head_dim == 32 and c.eos_token_id == (3,) and c.dtype == "float16"
    # transformers-5 style rope_parameters
    c = ModelConfig.from_dict(_base_cfg(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert c.rope_theta == 5e5 and c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 8.0
    c = ModelConfig.from_dict(_base_cfg(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 4.0}))
    assert c.rope_theta == 1e6 and c.rope_scaling.rope_type == "linear"
    c = ModelConfig.from_dict(_base_cfg(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert c.qkv_bias and not c.o_bias and not c.qk_norm
    c = ModelConfig.from_dict(_base_cfg(architectures=["Qwen3ForCausalLM"], model_type="qwen3"))
    assert c.qk_norm and not c.qkv_bias


def test_config_rejects_unsupported():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict(_base_cfg(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(_base_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="low_freq_factor"):
        ModelConfig.from_dict(_base_cfg(rope_scaling={"rope_type": "llama3", "factor": 4.0}))


def _copy_ckpt(src, dst, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loader_errors_name_the_tensor(synth_models, tmp_path):
    src = synth_models["tiny-llama"]
    d = _copy_ckpt(src, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d)
    d = _copy_ckpt(src, tmp_path / "extra", lambda t: t.update({"model.layers.9.foo": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.9\.foo"):
        load_model(d)

    def bad_shape(t):
        t["model.norm.weight"] = torch.ones(7)

    d = _copy_ckpt(src, tmp_path / "shape", bad_shape)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(7,\)"):
        load_model(d)


def test_loader_sharded_and_tied(synth_models, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = synth_models["tiny-qwen2"]  # tied embeddings: no lm_head.weight in the file
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname))
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model, cfg = load_model(d)
    ref, _ = load_model(src)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    bf, _ = load_model(src, dtype=torch.bfloat16)
    assert bf.model.embed_tokens.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------- batched attention, fused projections, bf16


def _count_sdpa(monkeypatch) -> list[int]:
    """Count calls of F.scaled_dot_product_attention made by the model."""
    from services.engine.model import llama

    calls = [0]
    real = llama.F.scaled_dot_product_attention

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", counting)
    return calls


def _count_flash(monkeypatch) -> list[int]:
    """Count calls of the CPU flash kernel with log-sum-exp (``rows`` groups) made by the model."""
    from services.engine.model import llama

    calls = [0]
    real = llama._FLASH_LSE
    assert real is not None

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(llama, "_FLASH_LSE", counting)
    return calls


@pytest.mark.parametrize("layout", ["auto", "packed", "padded"])
@pytest.mark.parametrize("name", ARCHS)
def test_mixed_step_attention_calls_per_layer_and_exact(synth_models, name, layout, monkeypatch):
    """Decodes + several prefill chunks (fresh, cached-prefix continuation, 1-token chunk) in ONE forward,
    every row equal to running that sequence alone. Attention calls per layer: packed / padded, two (the
    single-token group + one masked multi-token call); auto on a CPU, the single-token call + the ``rows``
    group's flash calls (one per fresh prompt, two per chunk after a prefix), no mask."""
    from services.engine.model import llama

    monkeypatch.setattr(llama, "PREFILL_LAYOUT", layout)
    ours, cfg, _ = _models(synth_models, name)
    seqs = [_prompt(n, 20 + i) for i, n in enumerate((29, 41, 18, 33, 7))]
    cached = [0, 20, 17, 32, 0]  # tokens already in the cache before the mixed step
    tables = [[3, 17, 9], [0, 21, 5], [12, 2], [7, 19, 14], [23]]
    solo = []
    for ids, pages in zip(seqs, tables):
        kv = allocate_kv_cache(cfg, num_pages=24, page_size=PAGE)
        solo.append(ours.compute_logits(_run(ours, kv, [(ids, 0, pages, len(ids))])))
    kv = allocate_kv_cache(cfg, num_pages=24, page_size=PAGE)
    _run(ours, kv, [(ids[:c], 0, pages, c) for ids, c, pages in zip(seqs, cached, tables) if c])
    calls, flash = _count_sdpa(monkeypatch), _count_flash(monkeypatch)
    # seq 2 and 3 decode (1 new token: 17->18, 32->33), 0 and 4 are fresh prefills, 1 continues a prefix
    h = _run(ours, kv, [(ids[c:], c, pages, len(ids)) for ids, c, pages in zip(seqs, cached, tables)])
    if layout == "auto":
        assert (calls[0], flash[0]) == (cfg.num_hidden_layers, (1 + 2 + 1) * cfg.num_hidden_layers)
    else:
        assert (calls[0], flash[0]) == (2 * cfg.num_hidden_layers, 0)
    logits = ours.compute_logits(h)
    row = 0
    for ids, c, ref in zip(seqs, cached, solo):
        n = len(ids) - c
        _assert_close(logits[row : row + n], ref[c:])
        row += n


@pytest.mark.parametrize("name", ARCHS)
def test_lone_chunk_after_its_prefix_is_two_unmasked_flash_calls_and_exact(synth_models, name, monkeypatch):
    """A lone multi-token chunk after its prefix (a session's suffix after a prefix hit; the later chunks of
    a long prompt) on a CPU: two flash calls per layer (the prefix unmasked, its own keys causal) merged by
    log-sum-exp, no SDPA call, no mask; logits equal to one pass over the whole prompt, with and without
    a prefix that is not page aligned."""
    from services.engine.model import llama

    ours, cfg, _ = _models(synth_models, name)
    ids, pages = _prompt(45, 3), [5, 0, 9]
    whole = ours.compute_logits(_run(ours, allocate_kv_cache(cfg, num_pages=12, page_size=PAGE), [(ids, 0, pages, 45)]))
    for cut in (16, 23, 44 - 1):
        kv = allocate_kv_cache(cfg, num_pages=12, page_size=PAGE)
        _run(ours, kv, [(ids[:cut], 0, pages, cut)])
        plan = llama._AttnPlan(_batch_of([(ids[cut:], cut, pages, 45)]), PAGE, 45 - cut, torch.device("cpu"))
        assert [g.kind for g in plan.groups] == ["rows"] and plan.groups[0].rows == ((45 - cut, 45),)
        sdpa, flash = _count_sdpa(monkeypatch), _count_flash(monkeypatch)
        h = _run(ours, kv, [(ids[cut:], cut, pages, 45)])
        monkeypatch.undo()
        assert (sdpa[0], flash[0]) == (0, 2 * cfg.num_hidden_layers)
        _assert_close(ours.compute_logits(h), whole[cut:])


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_pure_decode_and_lone_prefill_are_one_call_per_layer(synth_models, layout, monkeypatch):
    from services.engine.model import llama

    monkeypatch.setattr(llama, "PREFILL_LAYOUT", layout)
    ours, cfg, _ = _models(synth_models, "tiny-llama")
    kv = allocate_kv_cache(cfg, num_pages=8, page_size=PAGE)
    calls = _count_sdpa(monkeypatch)
    two = [(_prompt(20, 1), 0, [0, 1], 20), (_prompt(9, 2), 0, [2], 9)]
    h = _run(ours, kv, two)
    assert calls[0] == cfg.num_hidden_layers  # two prefills: one packed or padded call
    alone = [ours.compute_logits(_run(ours, allocate_kv_cache(cfg, 8, PAGE), [c])) for c in two]
    _assert_close(ours.compute_logits(h), torch.cat(alone))
    calls[0] = 0
    _run(ours, kv, [(_prompt(1, 3), 20, [0, 1], 21), (_prompt(1, 4), 9, [2], 10)])
    assert calls[0] == cfg.num_hidden_layers  # two decodes: one padded call


def test_fused_projections_are_views_of_the_checkpoint_parameters(synth_models):
    ours, cfg, _ = _models(synth_models, "tiny-qwen2")  # qkv bias: the bias is fused too
    attn, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    assert attn.qkv_weight is not None and attn.qkv_bias is not None and mlp.gate_up_weight is not None
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.bias.data_ptr() == attn.qkv_bias.data_ptr() + (cfg.q_size + cfg.kv_size) * 4
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[cfg.intermediate_size :].data_ptr()
    unfused, _ = load_model(synth_models["tiny-qwen2"], dtype=torch.float32, fuse=False)
    assert unfused.model.layers[0].self_attn.qkv_weight is None
    ids = _prompt(40, 9)
    a = ours.compute_logits(_run(ours, allocate_kv_cache(cfg, 8, PAGE), [(ids, 0, [0, 1, 2], 40)]))
    b = unfused.compute_logits(_run(unfused, allocate_kv_cache(cfg, 8, PAGE), [(ids, 0, [0, 1, 2], 40)]))
    _assert_close(a, b)


# bf16 weights, activations and KV against the fp32 model: the largest logit error (logit units) and the
# fraction of positions whose top-1 token agrees. Measured on these random tiny models: max error
# 0.026-0.052, top-1 agreement 0.94-0.99 (random weights have many near ties; real checkpoints agree more).
BF16_MAX_ABS = 0.1
BF16_TOP1 = 0.9


@pytest.mark.parametrize("name", ARCHS)
def test_bf16_within_tolerance_of_fp32(synth_models, name):
    ours, cfg, _ = _models(synth_models, name)
    low, _ = load_model(synth_models[name], dtype=torch.bfloat16)
    assert next(low.parameters()).dtype == torch.bfloat16
    ids = _prompt(150, seed=1)
    pages = list(range(10))
    ref = ours.compute_logits(_run(ours, allocate_kv_cache(cfg, 10, PAGE), [(ids, 0, pages, 150)]))
    kv = allocate_kv_cache(cfg, 10, PAGE, dtype=torch.bfloat16)
    got = low.compute_logits(_run(low, kv, [(ids[:100], 0, pages, 100)]))  # chunked: KV read back in bf16
    got = torch.cat([got, low.compute_logits(_run(low, kv, [(ids[100:], 100, pages, 150)]))])
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= BF16_MAX_ABS
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= BF16_TOP1


@pytest.mark.parametrize("name", ARCHS)
def test_engine_batched_greedy_equals_hf_generate(synth_models, name):
    """The whole engine (scheduler, chunked prefill mixed with decodes, batched attention, sampler) against
    transformers' greedy generate() run one prompt at a time."""
    from services.engine.executor import Engine
    from services.engine.types import SamplingParams

    _, _, hf = _models(synth_models, name)
    prompts = [_prompt(n, 40 + n).tolist() for n in (5, 23, 11, 37)]
    n_new = 10
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    # a 16-token budget: prompts are chunked across steps and share steps with other sequences' decodes
    engine = Engine(synth_models[name], dtype=torch.float32, page_size=4, num_pages=128, max_num_batched_tokens=16)
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True))
    assert got == refs
    engine.check_integrity()


def test_auto_dtype_follows_the_cpu_flags():
    from services.engine.model.loader import auto_dtype, cpu_has_bf16, engine_dtype

    with_bf16 = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n"
    without = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert cpu_has_bf16(with_bf16) and not cpu_has_bf16(without) and not cpu_has_bf16("")
    assert auto_dtype("cpu", with_bf16) == torch.bfloat16
    assert auto_dtype("cpu", without) == torch.float32
    assert engine_dtype("float32", "cpu") == torch.float32 and engine_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError):
        engine_dtype("int8", "cpu")


def test_engine_config_defaults_auto_dtype_and_all_cores():
    import os

    from services.engine.main import torch_threads
    from talaria.config import EngineConfig

    cfg = EngineConfig(id="e0", models=["m"])
    assert cfg.dtype == "auto"
    assert torch_threads(cfg) == len(os.sched_getaffinity(0))
    assert torch_threads(EngineConfig(id="e0", models=["m"], torch_threads=1, dtype="float32")) == 1


def test_packed_prefill_splits_into_bounded_groups_and_stays_exact(synth_models, monkeypatch):
    """A bound on the packed mask (MAX_PACKED_SCORES) splits the prefill sequences into several packed
    calls; results are unchanged. (The packed layout: on a CPU, ``auto`` takes per-sequence flash calls.)"""
    from services.engine.model import llama

    monkeypatch.setattr(llama, "PREFILL_LAYOUT", "packed")
    ours, cfg, _ = _models(synth_models, "tiny-llama")
    seqs = [_prompt(n, 60 + n) for n in (30, 20, 25)]
    tables = [[0, 1], [2, 3], [4, 5]]
    chunks = [(ids, 0, pages, len(ids)) for ids, pages in zip(seqs, tables)]
    one = ours.compute_logits(_run(ours, allocate_kv_cache(cfg, 8, PAGE), chunks))
    assert llama._split_packed([0, 1, 2], [30, 20, 25], [30, 20, 25]) == [[0, 1, 2]]
    monkeypatch.setattr(llama, "MAX_PACKED_SCORES", 50 * 50)  # seq 0+1 fit (50 x 50), seq 2 does not
    assert llama._split_packed([0, 1, 2], [30, 20, 25], [30, 20, 25]) == [[0, 1], [2]]
    calls = _count_sdpa(monkeypatch)
    split = ours.compute_logits(_run(ours, allocate_kv_cache(cfg, 8, PAGE), chunks))
    assert calls[0] == 2 * cfg.num_hidden_layers
    _assert_close(split, one)


def test_equal_fresh_prompts_take_the_padded_causal_layout(synth_models, monkeypatch):
    """Several fresh prompts of one length (a batch of new calls): one padded call with plain causal
    attention, no mask; exact against running each alone."""
    from services.engine.model import llama

    ours, cfg, _ = _models(synth_models, "tiny-qwen3")
    chunks = [(_prompt(24, 70 + i), 0, [2 * i, 2 * i + 1], 24) for i in range(3)]
    plan = llama._AttnPlan(AttnBatch([0, 24, 48, 72], [24] * 3, [c[2] for c in chunks], torch.zeros(72, dtype=torch.long)),
                           PAGE, 72, torch.device("cpu"))
    assert plan.single is not None and plan.single.kind == "padded" and plan.single.mask is None
    h = _run(ours, allocate_kv_cache(cfg, 8, PAGE), chunks)
    alone = [ours.compute_logits(_run(ours, allocate_kv_cache(cfg, 8, PAGE), [c])) for c in chunks]
    _assert_close(ours.compute_logits(h), torch.cat(alone))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_packed_weights_match_the_unpacked_model(synth_models, name):
    """model/packed.py: prepacked oneDNN linears (q/k/v + o, gate/up + down, lm_head; qwen2: with the
    q/k/v bias) give the logits of the plain bf16 model, for a mixed prefill + decode batch. Measured
    bit-identical on AVX512-BF16; the bound allows another oneDNN kernel's summation order."""
    from services.engine.model.packed import can_pack

    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN on this torch build")
    plain, cfg = load_model(synth_models[name], dtype=torch.bfloat16)
    packed, _ = load_model(synth_models[name], dtype=torch.bfloat16)
    packed.pack_weights()
    assert packed.is_packed and packed.model.layers[0].mlp.down_packed is not None and not plain.is_packed
    a, b = _prompt(37, 3), _prompt(1, 4)
    outs = []
    for m in (plain, packed):
        kv = allocate_kv_cache(cfg, 8, PAGE, dtype=torch.bfloat16)
        first = m.compute_logits(_run(m, kv, [(a, 0, [0, 1, 2], 37)]))
        mixed = m.compute_logits(_run(m, kv, [(b, 37, [0, 1, 2], 38), (a[:20], 0, [4, 5], 20)]))
        outs.append(torch.cat([first, mixed]))
    torch.testing.assert_close(outs[1], outs[0], atol=0.05, rtol=0.0)
    assert torch.equal(outs[1].argmax(-1), outs[0].argmax(-1))


def test_bf16_without_onednns_bf16_path_runs_unpacked_and_refuses_explicit_packing(synth_models, monkeypatch):
    """On a CPU without oneDNN's bf16 path (AVX2 only: its weight reorder raises) a bf16 engine runs unpacked by
    default, and an explicit ``packed_weights: true`` is refused at start with the reason, not oneDNN's error."""
    import services.engine.model_runner as mr
    from services.engine.executor import Engine

    monkeypatch.setattr(mr, "can_pack", lambda device, dtype: False)
    assert not Engine(synth_models["tiny-llama"], dtype=torch.bfloat16, num_pages=16).model.is_packed
    with pytest.raises(ValueError, match="oneDNN's bf16 path"):
        Engine(synth_models["tiny-llama"], dtype=torch.bfloat16, num_pages=16, packed_weights=True)
