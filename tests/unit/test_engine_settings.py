"""``services/engine/settings.EngineSettings``: one engine's settings, built once from its config entry and
handed to the hot engine and to every cold-engine shell."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine.settings import EngineSettings
from talaria.config import EngineConfig, StackConfig
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture

# every engine setting of the config at a value other than its default
CFG = dict(id="e", models=["tiny-llama"], device="cpu:0", dtype="float32", page_size=8, kv_cache_mb=3, max_num_seqs=5,
           max_num_batched_tokens=64, lone_prefill_tokens=100, session_cache_entries=7, packed_weights=False,
           decode_gemm="off", compile="auto", paged_decode="off", fused_ops="off", prefill_attention="off",
           small_step_threads=1, cuda_graphs="off", cuda_graph_max_context=256, max_model_len=128, deterministic=True)
NOT_FROM_CONFIG = {"num_pages", "session_cache_pages"}  # tests and tools set these; no config field


def test_from_config_reads_every_engine_setting():
    """A new field of EngineSettings that ``from_config`` does not fill is caught here: with every config
    value off its default, only the fields that have no config entry keep theirs."""
    s = EngineSettings.from_config(EngineConfig(**CFG), intra_op_threads=3)
    default = EngineSettings()
    kept = {f.name for f in dataclasses.fields(EngineSettings) if getattr(s, f.name) == getattr(default, f.name)}
    assert kept == NOT_FROM_CONFIG
    assert (s.dtype, s.kv_cache_bytes, s.compile_mode, s.intra_op_threads) == (torch.float32, 3 << 20, "auto", 3)
    assert (s.page_size, s.lone_prefill_tokens, s.cuda_graph_max_context, s.max_model_len) == (8, 100, 256, 128)


def test_settings_are_frozen_and_overrides_are_checked():
    s = EngineSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.page_size = 4  # type: ignore[misc]
    assert s.with_overrides(page_size=4).page_size == 4 and s.page_size == 16
    assert s.with_overrides() is s
    with pytest.raises(TypeError):
        s.with_overrides(pagesize=4)  # a misspelt setting is an error, not a silent default


def test_an_engine_refuses_an_unknown_setting(synth_models):
    from services.engine.executor import Engine

    with pytest.raises(TypeError):
        Engine(synth_models["tiny-llama"], page_sizee=4)


def test_a_cold_shell_takes_the_runtime_settings_and_not_the_hot_only_ones():
    hot = EngineSettings.from_config(EngineConfig(**CFG), intra_op_threads=None)
    shell = hot.for_shell(intra_op_threads=2)
    assert shell.intra_op_threads == 2
    assert (shell.packed_weights, shell.compile_mode, shell.cuda_graphs, shell.max_model_len) == (False, "off", "off", None)
    assert (shell.num_pages, shell.kv_cache_bytes) == (None, None)  # the arena's KV view fixes the pool
    same = ("device", "dtype", "page_size", "max_num_seqs", "max_num_batched_tokens", "lone_prefill_tokens",
            "session_cache_entries", "paged_decode", "fused_ops", "prefill_attention", "small_step_threads", "deterministic")
    assert all(getattr(shell, f) == getattr(hot, f) for f in same)


def test_build_engine_hands_the_config_entry_to_the_engine_once(synth_models):
    """The process entry builds the hot engine from ``EngineSettings.from_config`` (no setting spelled out
    there), and the settings reach the parts: the scheduler's budgets, the runner's pool and threads."""
    from services.engine.main import build_engine, torch_threads
    from services.engine.types import SamplingParams

    stack = StackConfig(models_dir=str(synth_models["tiny-llama"].parent))
    cfg = EngineConfig(id="h", models=["tiny-llama"], dtype="float32", page_size=4, kv_cache_mb=1, max_num_seqs=3,
                       lone_prefill_tokens=96, torch_threads=1, tune_allocator=False, small_step_threads=1)
    eng = build_engine(stack, cfg)
    assert eng.settings == EngineSettings.from_config(cfg, torch_threads(cfg))
    assert (eng.scheduler.max_num_seqs, eng.scheduler.lone_prefill_tokens, eng.page_size) == (3, 96, 4)
    assert (eng.runner.intra_op_threads, eng.runner.small_step_threads) == (1, 1)
    page_bytes = 2 * eng.config.num_hidden_layers * 4 * eng.config.num_key_value_heads * eng.config.head_dim * 4
    assert eng.num_pages == (1 << 20) // page_bytes
    assert len(eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]) == 3
