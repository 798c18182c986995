"""Compiled layer parts: ``torch.compile`` (inductor) of the pure math of every layer.

Design note. A step of a small model (SmolLM2-135M: 30 layers of 576 wide) is a few hundred small ops per
forward; the linears are bound by reading the weights, the rest is elementwise work (RMSNorm, RoPE, SiLU x
up, residual adds) and per-op dispatch. Inductor fuses the elementwise chains into a few C++ loops (the
"compile the model" step of vLLM's CPU backend). What is compiled here is *each layer's two pure parts*,
``llama.layer_in`` (input norm, q/k/v, RoPE) and ``llama.layer_out`` (o_proj, residual, post norm, MLP,
residual); the paged KV write and the attention stay eager (they mutate the pool and depend on the step's
plan). RMSNorm and the prepacked bf16 linears enter the graph as opaque ops (``talaria::rms_norm``,
``talaria::packed_linear``): inductor's own RMSNorm reduction rounds differently in bf16 (measured: q/v
of a 64-token prefill off by 1 ulp, greedy tokens diverging after 3 tokens at batch 1), and with the rest
elementwise under ``emulate_precision_casts`` every layer output is bit-identical to eager, so greedy
tokens are too. One compiled function serves all layers (the layer's parameters are graph inputs), with a dynamic
token dimension: two graphs per part, ``T == 1`` and ``T >= 2`` (dynamo specializes size 1), built by a
warm-up at start (:func:`compile_model`, a progress line per phase; inductor caches them on disk, so a
restart is faster). Guards of 30 layers per step would cost more than the fusion saves (measured
~220 us per call), so the calls run with dynamo's ``skip_guard_eval_unsafe`` stance (only the guards
that tell the warmed graphs apart are checked); an input no warmed graph fits is run eagerly (counted in
``CompiledDense.fallbacks``), never recompiled mid-serving. 
Where it pays (measured on this repository's 2-core AVX512/AMX machine under load 6-8, eager vs compiled
interleaved in one process, SmolLM2-135M): without precision emulation, bf16 512-token prefill ~1.3x,
decode steps at batch 1 and 8 0.85-1.05x (the linears are 65-85% of a decode step and the ~60 compiled
calls per step cost about what the fused elementwise work saved); made bit-identical (opaque RMSNorm,
precision emulation) the ``auto`` measurement (decode batch 8 + 256-token prefill) gave bf16 0.82x, fp32
0.93x -- slower. So the engine default is ``compile: off``; ``auto``
compiles, measures a decode step and a prefill step eager vs compiled at start and keeps the compiled
parts only when they are at least ``AUTO_MIN_GAIN`` faster; ``on`` keeps them regardless.

What it mutates: :func:`compile_model` sets ``model.dense`` (``None`` = eager) and, during the warm-up,
writes K/V rows into pages of ``kv`` -- call it only before the engine serves (every page free).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable

import torch

from .batch import AttnBatch, KVCache
from .llama import DenseFns, LlamaForCausalLM, layer_in, layer_out

log = logging.getLogger(__name__)

MODES = ("off", "auto", "on")
AUTO_MIN_GAIN = 1.05  # auto keeps the compiled parts when eager / compiled >= this on the measured steps
# round every intermediate to its eager dtype (bf16) as eager does, so greedy tokens match the eager path
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


class CompiledDense(DenseFns):
    """``layer_in`` / ``layer_out`` compiled; a forward runs them inside :meth:`scope` (the skip-guards
    stance), eagerly on a guard miss. ``warming``: call the compiled functions with full guards (warm-up)."""

    __slots__ = ("fallbacks", "warming")

    def __init__(self) -> None:
        pre_c = torch.compile(layer_in, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)
        post_c = torch.compile(layer_out, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)
        super().__init__(self._guarded(pre_c, layer_in), self._guarded(post_c, layer_out))
        self.fallbacks = 0
        self.warming = False

    def _guarded(self, compiled: Callable, eager: Callable) -> Callable:
        def call(*args):
            if self.warming:
                return compiled(*args)
            try:
                return compiled(*args)
            except RuntimeError as e:  # no warmed graph fits (the stance refuses to recompile)
                if "Recompilation" not in str(e):
                    raise
            self.fallbacks += 1
            return eager(*args)

        return call

    def scope(self):
        if self.warming:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)

    def warm(self, run: Callable[[], None]) -> None:
        """Build the graphs: ``run`` drives forwards through this object with full guards."""
        self.warming = True
        try:
            run()
        finally:
            self.warming = False


def _warm_batches(max_tokens: int) -> list[tuple[int, ...]]:
    """Context lengths of the warm-up forwards: one decode (T = 1), decodes of 2 and 8 sequences, a fresh
    prefill, and a mixed step (decodes + a prefill chunk): every graph and both attention paths."""
    return [(1,), (1, 1), (1,) * 8, (min(64, max_tokens),), (1, 1, min(32, max_tokens))]


def _synthetic_forward(model: LlamaForCausalLM, kv: KVCache, q_lens: tuple[int, ...], device: torch.device) -> None:
    """One forward over fresh sequences with ``q_lens`` new tokens each, 40 tokens of (garbage) context
    behind every single-token query, on consecutive pages from page 0. Writes those pages' K/V rows."""
    P = kv.page_size
    ctx = [q if q > 1 else 40 for q in q_lens]
    tables, slots, ids, pos, page = [], [], [], [], 0
    for q, n in zip(q_lens, ctx):
        pages = list(range(page, page + -(-n // P)))
        page += len(pages)
        tables.append(pages)
        slots += [pages[p // P] * P + p % P for p in range(n - q, n)]
        pos += list(range(n - q, n))
        ids += [(7 * p + 3) % 1000 for p in range(n - q, n)]
    if page * P > kv.k[0].shape[0]:
        raise ValueError("KV pool too small for the compile warm-up")
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    batch = AttnBatch(cu, ctx, tables, torch.tensor(slots, dtype=torch.long, device=device))
    model.forward(torch.tensor(ids, device=device), torch.tensor(pos, device=device), batch, kv)


def _time_forward(model, kv, q_lens, device, dense, reps: int = 3) -> float:
    model.dense = dense
    t = time.perf_counter()
    for _ in range(reps):
        _synthetic_forward(model, kv, q_lens, device)
    return (time.perf_counter() - t) / reps


def measure_gain(model: LlamaForCausalLM, kv: KVCache, device: torch.device, compiled: CompiledDense,
                 max_tokens: int, rounds: int = 5) -> float:
    """Median over ``rounds`` interleaved rounds of eager / compiled time of one decode step of 8 sequences
    plus one prefill forward of ``min(256, max_tokens)`` tokens (> 1: compiled is faster). Leaves
    ``model.dense`` as it found it."""
    prev, shapes = model.dense, [(1,) * 8, (min(256, max_tokens),)]
    ratios = []
    try:
        for _ in range(rounds):
            e = sum(_time_forward(model, kv, s, device, None) for s in shapes)
            c = sum(_time_forward(model, kv, s, device, compiled) for s in shapes)
            ratios.append(e / c)
    finally:
        model.dense = prev
    return statistics.median(ratios)


def compile_model(model: LlamaForCausalLM, kv: KVCache, device: torch.device, mode: str, max_tokens: int,
                  say: Callable[[str], None] = log.info) -> str:
    """Apply ``mode`` (``off``/``auto``/``on``) to ``model``: compile and warm the layer parts, and for
    ``auto`` keep them only if :func:`measure_gain` >= ``AUTO_MIN_GAIN``. Sets ``model.dense``; returns a
    one-line verdict. Must run before the engine serves (see the module note)."""
    if mode not in MODES:
        raise ValueError(f"compile mode must be one of {MODES}, got {mode!r}")
    model.dense = None
    if mode == "off":
        return "compile off"
    if not model.graph_layers:  # other layers than layer_in / layer_out (e.g. Gemma 3): eager
        say(f"compile {mode}: {model.config.architecture} layers run eagerly (not compiled)")
        return f"compile off ({model.config.architecture} layers are not compiled)"
    t0 = time.perf_counter()
    say(f"compiling the layer graphs (torch.compile, inductor; compile={mode}) ...")
    compiled = CompiledDense()
    with torch.inference_mode():
        compiled.warm(lambda: [_warm_shape(model, kv, s, device, compiled) for s in _warm_batches(max_tokens)])
        say(f"compiled in {time.perf_counter() - t0:.1f} s")
        if mode == "on":
            model.dense = compiled
            return f"compile on ({time.perf_counter() - t0:.1f} s)"
        gain = measure_gain(model, kv, device, compiled, max_tokens)
    keep = gain >= AUTO_MIN_GAIN
    model.dense = compiled if keep else None
    verdict = f"compile auto: eager/compiled {gain:.2f} -> {'on' if keep else 'off'} ({time.perf_counter() - t0:.1f} s)"
    say(verdict)
    return verdict


def _warm_shape(model, kv, q_lens, device, compiled) -> None:
    model.dense = compiled
    try:
        _synthetic_forward(model, kv, q_lens, device)
    finally:
        model.dense = None
