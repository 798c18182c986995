"""The hot engine's KV pool sized to the machine when ``engine.kv_cache_mb`` is not set (services/engine/memory.py)."""

from __future__ import annotations

import pytest

from services.engine.memory import CPU_CAP_BYTES, CPU_FLOOR_BYTES, cpu_kv_budget, mem_available_bytes
from talaria.config import EngineConfig

GiB = 1 << 30


@pytest.mark.parametrize(
    ("available", "budget"),
    [
        (24 * GiB, CPU_CAP_BYTES),  # this machine: a quarter would be 6 GiB, capped at 4
        (8 * GiB, 2 * GiB),  # a quarter
        (800 << 20, CPU_FLOOR_BYTES),  # small host: a quarter is under the old 256 MiB default, which it keeps
        (300 << 20, 150 << 20),  # tiny host: never more than half of what is available
        (None, CPU_FLOOR_BYTES),  # unknown: the old fixed default
    ],
)
def test_cpu_budget_is_a_quarter_of_available_memory_within_floor_and_cap(available, budget):
    assert cpu_kv_budget(available) == budget


def test_mem_available_reads_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   12345678 kB\n")
    assert mem_available_bytes(str(f)) == 12345678 * 1024
    assert mem_available_bytes(str(tmp_path / "absent")) > 0  # falls back to physical memory


def test_kv_cache_mb_defaults_to_machine_sized_and_an_explicit_value_wins():
    assert EngineConfig(id="e", models=["m"]).kv_cache_mb is None
    assert EngineConfig(id="e", models=["m"], kv_cache_mb=64).kv_cache_mb == 64
    with pytest.raises(ValueError):
        EngineConfig(id="e", models=["m"], kv_cache_mb=0)


def test_engine_without_a_size_caps_the_machine_budget_at_max_num_seqs_contexts(synth_models):
    """A small model never reserves the machine-sized budget: at most ``max_num_seqs`` full contexts."""
    from services.engine.executor import Engine
    from services.engine.kv.manager import cdiv

    eng = Engine(synth_models["tiny-llama"], max_num_seqs=2, page_size=16)
    assert eng.num_pages == 2 * cdiv(eng.config.attention_span, 16)
    explicit = Engine(synth_models["tiny-llama"], max_num_seqs=2, page_size=16, kv_cache_bytes=1 << 20)
    assert explicit.num_pages < eng.num_pages  # an explicit size is taken as given
