"""Shared pytest fixtures (add yours below)."""

from __future__ import annotations

from pathlib import Path

import pytest

# Models synthesized once per test session (the tokenizer is trained once and shared). ``small-llama`` is
# left out to keep the session fast; synthesize it explicitly in benchmarks.
SYNTH_TEST_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
SYNTH_TEST_SEED = 0


@pytest.fixture(scope="session")
def synth_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> checkpoint directory of the tiny synthesized models (seed 0)."""
    from talaria.models import synthesize

    out = tmp_path_factory.mktemp("synth-models")
    paths = synthesize(out, seed=SYNTH_TEST_SEED, names=SYNTH_TEST_MODELS)
    return {p.name: p for p in paths}
