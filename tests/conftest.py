"""Shared pytest fixtures (add yours below)."""

from __future__ import annotations

from pathlib import Path

import pytest

# Models synthesized once per test session (the tokenizer is trained once and shared). ``small-llama`` is
# left out to keep the session fast; synthesize it explicitly in benchmarks.
SYNTH_TEST_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
SYNTH_TEST_SEED = 0


@pytest.fixture(scope="session")
def paged_decode_built() -> bool:
    """Build (or load from torch's extension cache) the CPU paged decode kernel once, before any engine
    starts: a first build takes tens of seconds and must not land inside a timed test or a subprocess
    engine's start deadline. False if it cannot build (engines then use gather + SDPA)."""
    from services.engine.model.paged_attn import load_kernel

    return load_kernel() is not None


@pytest.fixture(scope="session")
def synth_models(tmp_path_factory: pytest.TempPathFactory, paged_decode_built: bool) -> dict[str, Path]:
    """name -> checkpoint directory of the tiny synthesized models (seed 0)."""
    from talaria.models import synthesize

    out = tmp_path_factory.mktemp("synth-models")
    paths = synthesize(out, seed=SYNTH_TEST_SEED, names=SYNTH_TEST_MODELS)
    return {p.name: p for p in paths}
