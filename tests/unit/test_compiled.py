"""Compiled layer parts (services/engine/model/compiled.py): same greedy tokens as eager, config validated.

One engine per architecture is compiled here (``compile_mode="on"``: a warm-up of ~10-60 s each on a small CPU,
cached on disk by inductor; the only compiles in the suite: every other engine runs eager, the config default)."""

from __future__ import annotations

import random

import pydantic
import pytest
import torch

from services.engine.executor import Engine
from services.engine.model.compiled import CompiledDense, compile_model
from services.engine.model.llama import layer_in, layer_out
from services.engine.model.packed import can_pack
from services.engine.types import SamplingParams
from talaria.config import EngineConfig


def test_compile_mode_is_validated():
    with pytest.raises(pydantic.ValidationError, match="compile"):
        EngineConfig(id="e", models=["m"], compile="sometimes")
    assert EngineConfig(id="e", models=["m"]).compile == "off"
    with pytest.raises(ValueError, match="compile mode"):
        compile_model(None, None, torch.device("cpu"), "sometimes", 512)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_compiled_engine_gives_eager_greedy_tokens(synth_models, name):
    if not can_pack(torch.device("cpu"), torch.bfloat16):  # inductor would lower the plain bf16 linears its own way
        pytest.skip("bit-identity holds with prepacked oneDNN linears (opaque in the graph); this CPU has no oneDNN bf16 path")
    # bf16 on CPU: the production path (fused q/k/v with one RoPE, prepacked linears as the opaque op);
    # tiny-qwen3: per-head q/k RMSNorm inside the compiled part
    # fused_ops off: the compiled parts run the eager ops in the graph, and eager is the reference here
    eng = Engine(synth_models[name], dtype=torch.bfloat16, compile_mode="on", max_num_batched_tokens=64, fused_ops="off")
    dense = eng.model.dense
    assert isinstance(dense, CompiledDense) and eng.runner.compile_verdict.startswith("compile on")
    rng = random.Random(3)
    # lengths over the 64-token budget: chunked prefills run in the same steps as other sequences' decodes
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (1, 5, 40, 90, 17, 130)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
    compiled = eng.generate(prompts, sp)
    assert dense.fallbacks == 0  # every step ran a warmed graph
    eng.model.dense = None
    eng.flush_cache()
    eager = eng.generate(prompts, sp)
    assert compiled == eager
    assert all(len(t) == 12 for t in compiled)
    # stronger than the tokens: every layer part bit-identical to eager (a 1-ulp rounding difference would
    # only show in the tokens on a near-tie)
    m, g = eng.model, torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for T in (1, 64, 2048):
            h = torch.randn(T, m.config.hidden_size, generator=g).to(torch.bfloat16) * 4
            cos, sin = m._rope(torch.arange(T) + 30, torch.bfloat16, T + 30)  # 2048 rows: 1-ulp flips are rare per row
            o = torch.randn(T, m.config.q_size, generator=g).to(torch.bfloat16)
            for layer in m.model.layers:
                for a, b in zip(layer_in(layer, h, cos, sin), dense.pre(layer, h, cos, sin)):
                    assert torch.equal(a, b)
                assert torch.equal(layer_out(layer, h, o), dense.post(layer, h, o))
