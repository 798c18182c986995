"""issue 19 #5: a checkpoint whose sliding window is shorter than its positions (Mistral-v0.1: 4096 of 32768)
gets its window applied (attention masked to the last ``sliding_window`` positions), not full attention;
a window the model does not implement (Qwen's per-layer one) caps the context, with a warning."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from services.engine.executor import Engine
from services.engine.model.config import ModelConfig
from services.engine.types import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 12


@pytest.fixture(scope="module")
def windowed_mistral(synth_models, tmp_path_factory):
    dst = tmp_path_factory.mktemp("windowed") / "windowed-mistral"
    shutil.copytree(synth_models["tiny-mistral"], dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(sliding_window=WINDOW, max_position_embeddings=4096)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (30, 5, 19, 41)]


@pytest.mark.parametrize("layout", ["auto", "padded", "packed"])
def test_window_is_applied_and_greedy_tokens_equal_transformers(windowed_mistral, layout, monkeypatch):
    """Prompts longer than the window, chunked (8-token budget: packed and padded prefill groups mixed
    with decodes) and batched, against transformers' windowed greedy generate() one prompt at a time; each
    prefill layout forced too (a padded group of several sequences whose chunks start past their windows
    reads a column slice of the slot table)."""
    from services.engine.model import llama

    monkeypatch.setattr(llama, "PREFILL_LAYOUT", layout)
    cfg = ModelConfig.from_dir(windowed_mistral)
    assert cfg.sliding_window == WINDOW and cfg.attention_span == 4096
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(windowed_mistral), dtype=torch.float32).eval()
    n_new = 12
    refs = []
    with torch.no_grad():
        for p in _prompts():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    for budget in (8, 256):  # chunked + mixed, and every prompt in one step
        eng = Engine(windowed_mistral, dtype=torch.float32, page_size=4, num_pages=128, max_num_batched_tokens=budget)
        assert eng.max_context == 128 * 4  # the pool, not the window, bounds the context
        assert eng.generate(_prompts(), sp) == refs
    # the window matters: the same checkpoint with full attention answers differently
    full = ModelConfig.from_dict({**json.loads((windowed_mistral / "config.json").read_text()), "sliding_window": None})
    assert full.sliding_window is None
    eng.model.config = full
    try:
        assert eng.generate(_prompts(), sp) != refs
    finally:
        eng.model.config = cfg


def test_qwen_per_layer_window_caps_the_context_with_a_warning(caplog):
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512}
    with caplog.at_level(logging.WARNING, logger="services.engine.model.llama_family"):
        cfg = ModelConfig.from_dict(dict(base, sliding_window=48, use_sliding_window=True))
    assert cfg.attention_span == 48 and cfg.sliding_window is None
    assert any("sliding_window 48" in r.getMessage() for r in caplog.records)


def test_no_window_or_a_window_as_long_as_the_positions_changes_nothing():
    base = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512}
    assert ModelConfig.from_dict(dict(base)).attention_span == 512
    assert ModelConfig.from_dict(dict(base, sliding_window=512)).sliding_window is None
    qwen = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False)
    assert ModelConfig.from_dict(qwen).attention_span == 512  # window declared but off


def test_registry_names_every_family_and_refuses_others():
    from services.engine.model.llama import LlamaForCausalLM
    from services.engine.model.registry import lookup, supported
    from talaria.models.importer import SUPPORTED_ARCHITECTURES

    assert supported() == tuple(sorted(SUPPORTED_ARCHITECTURES))  # what `talaria models import` accepts is servable
    arch = lookup("MistralForCausalLM")
    assert arch.model_class is LlamaForCausalLM
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100})
    kv = arch.kv_shape(cfg)
    assert kv.pool_shape(32) == (2, 3, 32, 2, 16) and kv.page_bytes(4, 2) == 2 * 3 * 4 * 2 * 16 * 2
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        lookup("GPT2LMHeadModel")


def test_a_windowed_prefill_group_reads_only_the_keys_its_rows_can_see():
    """A chunk of new rows after a long cached context reads, per windowed layer, the keys from the one its
    earliest row sees on (``_window_starts``), not the whole context; the mask still hides the rest."""
    from services.engine.model.llama import _padded_group, _prefill_group, _window_starts

    page, window = 4, 12
    tables = [list(range(0, 12)), list(range(12, 24))]  # 48 positions each
    cu, ctx = [0, 4, 10], [44, 30]  # 4 new rows after 40 cached; 6 new after 24
    assert _window_starts([4, 6], ctx, window) == [44 - 4 - window + 1, 30 - 6 - window + 1] == [29, 13]
    assert _window_starts([4, 6], ctx, None) == [0, 0] and _window_starts([30], [30], window) == [0]  # a fresh prompt: all
    cpu = torch.device("cpu")
    g = _prefill_group([0, 1], cu, ctx, tables, page, cpu, window)
    assert g.slots.numel() == (44 - 29) + (30 - 13)  # 15 + 17 keys, not 44 + 30
    assert g.mask is not None and g.mask.shape == (10, 32)
    assert g.slots[:15].tolist() == list(range(29, 44))  # sequence 0's keys 29..43 (table = identity pages)
    one = _prefill_group([0], cu, ctx, tables, page, cpu, window)
    assert one.slots.shape[-1] == 15 and one.mask.shape[-1] == 15
    pad = _padded_group([0, 1], [4, 6], ctx, cu, tables, page, cpu, window, first_key=13)  # keys before every row's first
    assert pad.slots.shape == (2, 44 - 13) and pad.mask.shape == (2, 1, 6, 44 - 13)
    assert pad.slots[0, 0].item() == 13 and not pad.mask[0, 0, 0, : 29 - 13].any() and pad.mask[0, 0, 0, 29 - 13]
    assert _prefill_group([0, 1], cu, ctx, tables, page, cpu, None).slots.numel() in (44 + 30, 2 * 44)  # no window: every key


def test_windowed_prefill_groups_attend_as_the_whole_context_does():
    """The key slice changes nothing but the work: a padded group of two sequences (its slot table cut to a
    column slice), a packed one and the same groups over the whole context give the same attention."""
    from services.engine.model.llama import Attention, _packed_group, _padded_group

    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 64,
                                 "max_position_embeddings": 256})
    attn = Attention(cfg)
    g = torch.Generator().manual_seed(3)
    page, window, cpu = 4, 12, torch.device("cpu")
    tables = [list(range(0, 12)), list(range(12, 24))]
    cu, ctx, q_lens = [0, 4, 10], [44, 30], [4, 6]
    layer_k = torch.randn(24 * page, 2, 16, generator=g)
    layer_v = torch.randn(24 * page, 2, 16, generator=g)
    q = torch.randn(10, 4, 16, generator=g)
    out = {}
    for name, grp in {
        "padded, sliced": _padded_group([0, 1], q_lens, ctx, cu, tables, page, cpu, window, first_key=13),
        "padded, whole": _padded_group([0, 1], q_lens, ctx, cu, tables, page, cpu, window),
        "packed, sliced": _packed_group([0, 1], q_lens, ctx, cu, tables, page, cpu, window, starts=[29, 13]),
        "packed, whole": _packed_group([0, 1], q_lens, ctx, cu, tables, page, cpu, window),
    }.items():
        o = torch.empty_like(q)
        o.index_copy_(0, grp.q_index, attn._attend(q, layer_k, layer_v, grp, whole=False))
        out[name] = o
    for name, o in out.items():
        torch.testing.assert_close(o, out["packed, whole"], rtol=1e-5, atol=1e-6, msg=name)
