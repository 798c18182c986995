"""The Llama family in the architecture registry (see ``registry.py``): Llama, Mistral, Qwen2 and Qwen3
all run on :class:`~services.engine.model.llama.LlamaForCausalLM`; what differs is parsed here into
``ModelConfig`` flags.

* Llama: q/k/v and o bias iff ``attention_bias``; no window.
* Mistral: no attention bias; ``sliding_window`` applies to every layer and *is applied* by the model
  (attention masked to the last ``sliding_window`` positions, query included: key ``j`` is visible to
  query ``i`` iff ``i - window < j <= i``, as transformers' ``sliding_window_overlay``). Mistral-v0.1
  (4096 of 32768) is served with its full context.
* Qwen2: q/k/v bias, no o bias. Qwen3: per-head q/k RMSNorm. Their window is per layer
  (``use_sliding_window`` + ``max_window_layers``), which the model does not implement: when it is on and
  shorter than the positions, the context is capped to the window with a warning (full attention equals
  the windowed one while the context fits).

Mutates: the registry, once, at import.
"""

from __future__ import annotations

import logging
from typing import Any

from talaria.kv_layout import Family

from .llama import LlamaForCausalLM
from .registry import Architecture, KVShape, register

log = logging.getLogger(__name__)


def mha_kv_shape(config) -> KVShape:
    """Paired K/V slabs ``[kv_heads, head_dim]`` per layer and position (MHA / GQA / MQA)."""
    return KVShape(Family.MHA, config.num_hidden_layers, (config.num_key_value_heads, config.head_dim))


def _window(raw: dict[str, Any]) -> int | None:
    w = raw.get("sliding_window")
    max_pos = int(raw.get("max_position_embeddings", 2048))
    return int(w) if w and int(w) < max_pos else None  # a window as long as the positions changes nothing


def _llama(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _mistral(raw: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": False, "o_bias": False, "sliding_window": _window(raw)}


def _qwen_window_cap(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    w = _window(raw) if raw.get("use_sliding_window", False) else None
    if w is None:
        return {}
    log.warning(
        "%s: per-layer sliding_window %d < max_position_embeddings %s is not implemented, so the context "
        "is capped to %d tokens", arch, w, raw.get("max_position_embeddings"), w,
    )
    return {"context_cap": w}


def _qwen2(raw: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False, **_qwen_window_cap(raw, "Qwen2ForCausalLM")}


def _qwen3(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, **_qwen_window_cap(raw, "Qwen3ForCausalLM")}


for _name, _parse in (
    ("LlamaForCausalLM", _llama),
    ("MistralForCausalLM", _mistral),
    ("Qwen2ForCausalLM", _qwen2),
    ("Qwen3ForCausalLM", _qwen3),
):
    register(Architecture(_name, LlamaForCausalLM, _parse, mha_kv_shape))
