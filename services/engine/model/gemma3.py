"""The Gemma 3 text family (``Gemma3ForCausalLM``, e.g. Gemma 3 270M) in the architecture registry, over the
same flat batch and paged KV as the Llama family (``llama.py``, ``batch.py``).

Design note
-----------
What differs from Llama, each mirroring transformers' ``modeling_gemma3`` (the parity reference):

* **Norms** are ``(1 + w) * x / rms(x)``, computed in float32 and rounded once (:class:`GemmaRMSNorm`; the
  checkpoint stores ``w``, zero-centred). A layer has four: ``input_layernorm`` before attention,
  ``post_attention_layernorm`` on the attention output *before* the residual add, and
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP the same way (sandwich norms).
* **QK-norm**: per-head ``q_norm`` / ``k_norm`` (Gemma norms over ``head_dim``) before RoPE.
* **Attention scale** ``query_pre_attn_scalar ** -0.5`` (``ModelConfig.attn_scale``), head dim 256 on 270M.
* **Sliding-window layers**: ``layer_types[l]`` is ``sliding_attention`` (key ``j`` visible to the query at
  ``i`` iff ``i - window < j <= i``, transformers' ``sliding_window_overlay``) or ``full_attention`` (every 6th
  layer on Gemma 3). A forward builds two attention plans (``llama._AttnPlan``): one windowed, one full,
  each layer reading its own (one plan when no context in the step is longer than the window: they are
  then the same). The paged decode kernel shows a windowed layer only its last ``window`` keys; the prefill
  paths read keys from the first one any new row can see (``llama._window_starts``) and mask the rest. The KV pool keeps every position of every layer (the KV manager owns pages
  and prefix caching needs them), so a windowed layer's older pages are kept but never read.
* **Two RoPE bases**: ``rope_local_theta`` (10k) on sliding layers, ``rope_theta`` (1M, with its scaling) on
  full ones; two cos/sin tables.
* **Scaled embeddings**: ``embed_tokens(ids) * sqrt(hidden)``, the factor rounded to the weights' dtype
  first as transformers does; the tied ``lm_head`` reads the unscaled table.
* **GeGLU**: ``down(gelu_tanh(gate(x)) * up(x))``.
* **Final logit softcapping** ``cap * tanh(logits / cap)`` when the config sets one (Gemma 3 does not).

Reused from ``llama.py``: the fused / prepacked projections (``fuse_projections``, ``pack_weights``, with the
decode-step GEMM), the attention paths (``Attention.attend_all``: the paged decode kernel -- AVX-512 body for
head dim 256 -- rows / packed / padded prefill; the AMX prefill kernel is head dim 64 only, so prefill takes
ATen's flash kernel) and RoPE. On a CPU the norms and GeGLU run as fused C++ ops in Gemma's rounding
(``fused_ops.py``: ``gemma_rms_norm``, ``gelu_tanh_mul``; eager ones otherwise).
The layers are not ``layer_in`` / ``layer_out``, so ``graph_layers`` is False: no torch.compile of the layer
parts and no CUDA-graph decode (they run eagerly).

Side effects are the Llama model's: the forward writes the new tokens' K/V of every layer at
``batch.slot_mapping`` and nothing else.

Mutates: the registry, once, at import (``Gemma3ForCausalLM`` registration).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .batch import AttnBatch, KVCache
from .config import ModelConfig, RopeScaling
from .fused_ops import FusedOps
from .llama import Attention, LlamaForCausalLM, MLP, _AttnPlan, rope_inv_freq, rope_lookup
from .packed import linear
from .prefill_attn import applies as prefill_applies
from .llama_family import mha_kv_shape
from .registry import Architecture, register

SLIDING = "sliding_attention"
FULL = "full_attention"


class GemmaRMSNorm(nn.Module):
    """``(x / rms(x)) * (1 + w)`` in float32, rounded to ``x``'s dtype once (transformers' ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.ops: FusedOps | None = None  # the fused CPU op (fused_ops.py), set by Gemma3ForCausalLM.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.stride(-1) == 1:  # q/k norms get a column slice of the fused projection
            if (out := self.ops.gemma_rms_norm(x.contiguous(), self.weight, self.eps)) is not None:
                return out
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """The Llama attention with Gemma norms on q and k (always) and ``attn_scale``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GeGLU(MLP):
    """``down(gelu_tanh(gate(x)) * up(x))`` over the (fused, packed) projections of ``llama.MLP``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        gate_up = linear(x, self.gate_up_packed, self.gate_up_weight, self.gate_up_bias)
        act = self.ops.gelu_tanh_mul(gate_up) if self.ops is not None else None
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        return linear(act, self.down_packed, self.down_proj.weight, self.down_proj.bias)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = GemmaAttention(cfg)
        self.mlp = GeGLU(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, layer_k, layer_v, plan) -> torch.Tensor:
        """One layer (sandwich norms around attention and MLP); writes this layer's new K/V (``attend_all``)."""
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(h), cos, sin)
        h = h + self.post_attention_layernorm(attn.out(attn.attend_all(q, k, v, layer_k, layer_v, plan)))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class _Gemma3Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = layer_types(cfg)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, types[l] == SLIDING) for l in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def layer_types(cfg: ModelConfig) -> tuple[str, ...]:
    """Each layer's attention type; a config without ``layer_types`` is full attention everywhere."""
    return cfg.layer_types or (FULL,) * cfg.num_hidden_layers


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model (see the module note). Parameter names are the checkpoint's; no buffers (the cold
    pool binds every parameter onto arena memory, ``substrate/bank.py``)."""

    graph_layers = False

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = _Gemma3Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq_cpu = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        local = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
        self._inv_freq_local = rope_inv_freq(config.head_dim, local, RopeScaling())
        self._rope_table: dict = {}
        self._rope_table_local: dict = {}
        self.lm_head_packed = None
        self.dense = None  # never set: graph_layers is False
        self.paged_decode = None
        self.prefill_attention = None
        self.fused_ops: FusedOps | None = None
        self.window = config.sliding_window if any(t == SLIDING for t in layer_types(config)) else None

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """The fused CPU ops (fused_ops.py) in Gemma's forms: RoPE for the attention modules, the ``(1 + w)``
        norm for every norm, GELU-tanh * up for the MLPs (or take them away with None); mutates those modules'
        ``ops`` and ``self.fused_ops``."""
        self.fused_ops = ops
        for m in self.modules():
            if isinstance(m, (Attention, GemmaRMSNorm, GeGLU)):
                m.ops = ops

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch, kv: KVCache) -> torch.Tensor:
        """Run the flat batch; return final-normed hidden states ``[T, hidden]``. Writes each new token's K/V
        into ``kv`` at ``batch.slot_mapping`` (every layer) and nothing else."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError("input_ids and positions must be 1-D tensors of equal length")
        if len(kv.k) != self.config.num_hidden_layers:
            raise ValueError(f"KV cache has {len(kv.k)} layers, model has {self.config.num_hidden_layers}")
        dev = self.model.embed_tokens.weight.device
        input_ids, positions = input_ids.to(dev), positions.to(dev)
        weights = self.model.embed_tokens.weight.dtype
        kernel = self.paged_decode if dev.type == "cpu" and kv.k[0].dtype == weights else None
        prefill = self.prefill_attention if kv.k[0].dtype == weights and prefill_applies(dev, weights, self.config.head_dim) else None
        max_pos = max(batch.context_lens, default=1) - 1
        full = _AttnPlan(batch, kv.page_size, input_ids.shape[0], dev, None, kernel, prefill)
        # a windowed plan differs only when some context in the step is longer than the window
        local = full if self.window is None or max_pos < self.window else _AttnPlan(
            batch, kv.page_size, input_ids.shape[0], dev, self.window, kernel, prefill)
        return self.run_planned(input_ids, positions, full, kv, max_pos, local)

    def run_planned(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: _AttnPlan, kv: KVCache,
                    max_pos: int, local_plan: _AttnPlan | None = None) -> torch.Tensor:
        """The layers over prepared plans: ``plan`` for full-attention layers, ``local_plan`` (default
        ``plan``) for sliding ones. Writes the new tokens' K/V; returns the final-normed hidden states."""
        local_plan = local_plan or plan
        h = self.model.embed_tokens(input_ids)
        h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        cos, sin = rope_lookup(self._rope_table, self._inv_freq_cpu, positions, h.dtype, max_pos,
                               self.config.max_position_embeddings)
        lcos, lsin = rope_lookup(self._rope_table_local, self._inv_freq_local, positions, h.dtype, max_pos,
                                 self.config.max_position_embeddings)
        gate = self.layer_gate
        for l, layer in enumerate(self.model.layers):
            if gate is not None:
                gate(l)
            if layer.sliding:
                h = layer(h, lcos, lsin, kv.k[l], kv.v[l], local_plan)
            else:
                h = layer(h, cos, sin, kv.k[l], kv.v[l], plan)
        if gate is not None:
            gate(len(self.model.layers))
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32 logits, soft-capped when the config says so."""
        logits = linear(hidden, self.lm_head_packed, self.lm_head.weight, None).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _parse(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's ``config.json`` (transformers-5 ``rope_parameters`` per layer type, or the legacy
    ``rope_local_base_freq``) -> its ``ModelConfig`` fields. ValueError for what the model cannot serve."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma3ForCausalLM: unsupported activation {act!r} (only gelu_pytorch_tanh)")
    if raw.get("attn_logit_softcapping"):
        raise ValueError("Gemma3ForCausalLM: attn_logit_softcapping is not implemented")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM: bidirectional attention is not served (a decoder only)")
    n = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if not types:  # older configs: every sliding_window_pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = [FULL if (l + 1) % pattern == 0 else SLIDING for l in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"Gemma3ForCausalLM: layer_types must be {n} of {SLIDING!r} / {FULL!r}, got {types}")
    window = raw.get("sliding_window")
    if SLIDING in types and not window:
        raise ValueError("Gemma3ForCausalLM: sliding layers need sliding_window")
    params = raw.get("rope_parameters")
    local = raw.get("rope_local_base_freq", 10000.0)
    if isinstance(params, dict) and isinstance(params.get(SLIDING), dict):
        local_params = params[SLIDING]
        if (local_params.get("rope_type") or "default") != "default":
            raise ValueError(f"Gemma3ForCausalLM: sliding-layer rope type {local_params.get('rope_type')!r} is not supported")
        local = local_params.get("rope_theta", local)
    scalar = raw.get("query_pre_attn_scalar")
    cap = raw.get("final_logit_softcapping")
    return {
        "qkv_bias": bool(raw.get("attention_bias", False)),
        "o_bias": bool(raw.get("attention_bias", False)),
        "qk_norm": True,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_types": tuple(types),
        "sliding_window": int(window) if window else None,
        "rope_local_theta": float(local),
        "attn_scale": float(scalar) ** -0.5 if scalar else None,
        "final_logit_softcapping": float(cap) if cap else None,
    }


register(Architecture("Gemma3ForCausalLM", Gemma3ForCausalLM, _parse, mha_kv_shape))
