"""The engine's malloc tuning (services/engine/allocator_tuning.py): the activations of repeated prefill steps
come back from the heap instead of fresh pages. Counted (minor page faults), not timed; each case runs in its
own interpreter because the settings are process-wide, and the steps run on a worker thread as in the
engine service."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROG = r"""
import json, random, resource, sys, threading
import torch
torch.set_num_threads(1)
if sys.argv[2] == "tuned":
    from services.engine.allocator_tuning import tune_allocator
    assert tune_allocator()
from services.engine.executor import Engine
from services.engine.types import EngineRequest, SamplingParams
eng = Engine(sys.argv[1], max_num_seqs=2, max_num_batched_tokens=2048, kv_cache_bytes=64 << 20)
rng = random.Random(0)
out = {}
def prefill(tag):
    eng.flush_cache()
    eng.add_request(EngineRequest(tag, [rng.randrange(5, 4000) for _ in range(2000)], SamplingParams(temperature=0.0, max_tokens=1)))
    while not any(o.finished for o in eng.step()):
        pass
def work():
    for i in range(2):
        prefill(f"warm{i}")
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(4):
        prefill(f"run{i}")
    out["faults"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 4
t = threading.Thread(target=work); t.start(); t.join()
print(json.dumps(out))
"""


def _faults(model_dir, mode: str) -> float:
    r = subprocess.run([sys.executable, "-c", PROG, str(model_dir), mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["faults"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt and ru_minflt are Linux facts")
def test_tuned_heap_serves_prefill_activations_without_faulting_fresh_pages(synth_models):
    default, tuned = _faults(synth_models["tiny-llama"], "default"), _faults(synth_models["tiny-llama"], "tuned")
    # a 2,000-token prefill of tiny-llama allocates ~2-4 MB activations per op: glibc's defaults mmap and
    # unmap them (thousands of faults per step); tuned, the heap keeps them. Measured per prefill: 4,476 vs 250
    # (18x) in an environment without triton; 2,211 vs 375 (5.9x) with triton installed (xgrammar's dependency;
    # torch registers triton-backed ops when it is importable, and the default run then faults half as often,
    # the tuned one a little more: which allocation moves glibc's threshold was not traced). The claim is "the
    # heap keeps them": far below one fault per activation page, and a fourfold cut at least where glibc's
    # defaults fault. Those defaults adapt (glibc raises its mmap threshold to the size of an mmapped chunk it
    # frees), so in some runs they keep the activations in the heap too: 752 faults per prefill in one of three
    # runs here (2026-12-07), 1,002 and 7,406 in others, so no ratio to them holds in every run: the tuned heap is held
    # to its own bound, under the fewest faults the defaults showed (tuned 125-375 measured).
    assert tuned < 700, (tuned, default)
    print(f"faults per prefill: default {default:.0f}, tuned {tuned:.0f}")
