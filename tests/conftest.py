"""Shared pytest fixtures (add yours below)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.workloads.traces import ENV_VAR, MINISWE, MOONCAKE, Trace, TraceNotFound, trace_path

# The public trace files (bench/workloads/traces.py) are not in the repository. This project's development
# machines keep them in /work/shared/data: there the tests read them from that directory unless
# TALARIA_TRACES_DIR already names one; elsewhere the tests that need them skip, naming the variable.
_DEV_TRACES = Path("/work/shared/data")
if ENV_VAR not in os.environ and _DEV_TRACES.is_dir():
    os.environ[ENV_VAR] = str(_DEV_TRACES)


def _trace_or_skip(trace: Trace) -> Path:
    try:
        return trace_path(trace)
    except TraceNotFound:
        pytest.skip(f"{trace.name} not found: set {ENV_VAR} to a directory holding it (data/traces/README.md)")


@pytest.fixture
def miniswe_trace() -> Path:
    """The mini-swe-agent trace as the resolver finds it (``$TALARIA_TRACES_DIR`` or data/traces/); skips if absent."""
    return _trace_or_skip(MINISWE)


@pytest.fixture
def mooncake_trace() -> Path:
    """The Mooncake trace as the resolver finds it (``$TALARIA_TRACES_DIR`` or data/traces/); skips if absent."""
    return _trace_or_skip(MOONCAKE)

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
