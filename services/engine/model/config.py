"""Model configuration parsed from a Hugging Face ``config.json``.

The fields every family shares are parsed here; the architecture-specific ones (``qkv_bias``, ``o_bias``,
``qk_norm``, ``sliding_window``, ``context_cap``, and Gemma 3's ``hidden_act``, ``layer_types``,
``rope_local_theta``, ``attn_scale``, ``final_logit_softcapping``) come from the architecture's parser in the
registry (``registry.py``; the Llama family's in ``llama_family.py``, Gemma 3's in ``gemma3.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # applied to every layer by the model (keys within the last N positions)
    context_cap: int | None = None  # a limit the model cannot serve past (e.g. Qwen's per-layer window)
    hidden_act: str = "silu"  # the MLP's gate activation ("silu", or "gelu_pytorch_tanh" for Gemma)
    # per layer "sliding_attention" (keys within ``sliding_window``) or "full_attention"; empty: every layer
    # the same (windowed iff ``sliding_window``), as the Llama family serves it
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the sliding layers when it differs (Gemma 3); None: rope_theta
    attn_scale: float | None = None  # softmax scale of attention scores; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str | None = None  # "float32" | "float16" | "bfloat16" | None

    @property
    def attention_span(self) -> int:
        """The longest context this model is served with: its positions, or less when its architecture
        parser capped it (a window the model does not apply; the parser warns) -- never full attention
        silently past a window it was trained with."""
        if self.context_cap and self.context_cap < self.max_position_embeddings:
            return self.context_cap
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        cfg_path = p / "config.json" if p.is_dir() else p
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        from .registry import lookup  # lazy: the family modules import this one

        flags = lookup(arch).parse(raw)  # ValueError for an unsupported architecture
        # Some configs nest the text model (multimodal wrappers); we only support flat ones.
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = raw.get("head_dim")
        head_dim = int(head_dim) if head_dim else hidden // heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")

        rope_theta, scaling = _parse_rope(raw)

        act = raw.get("hidden_act", "silu")
        if "hidden_act" not in flags and act not in ("silu", "swish"):  # a family that parses its own activation says so
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")

        eos = raw.get("eos_token_id")
        if eos is None:
            eos_t: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_t = tuple(int(e) for e in eos)
        else:
            eos_t = (int(eos),)

        dtype_raw = raw.get("dtype", raw.get("torch_dtype"))
        dtype = _DTYPE_NAMES.get(str(dtype_raw).replace("torch.", "")) if dtype_raw else None

        max_pos = int(raw.get("max_position_embeddings", 2048))

        return cls(
            architecture=arch,
            model_type=str(raw.get("model_type", "")),
            hidden_size=hidden,
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=max_pos,
            eos_token_id=eos_t,
            bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
            pad_token_id=None if raw.get("pad_token_id") is None else int(raw["pad_token_id"]),
            dtype=dtype,
            **flags,
        )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Rope theta and scaling from either the transformers-5 ``rope_parameters`` dict or the legacy
    top-level ``rope_theta`` + ``rope_scaling`` keys."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form: the full-attention layers' (a family with sliding layers parses their base itself, e.g. gemma3.py)
    legacy = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    src: dict[str, Any] = {}
    if isinstance(legacy, dict):
        src.update(legacy)
    if isinstance(params, dict):
        src.update(params)
        theta = params.get("rope_theta", theta)
    if theta is None:
        theta = 10000.0
    rope_type = src.get("rope_type", src.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), RopeScaling()
    if "factor" not in src:
        raise ValueError(f"rope scaling {rope_type!r} requires 'factor'")
    if rope_type == "linear":
        return float(theta), RopeScaling(rope_type="linear", factor=float(src["factor"]))
    try:
        return float(theta), RopeScaling(
            rope_type="llama3",
            factor=float(src["factor"]),
            low_freq_factor=float(src["low_freq_factor"]),
            high_freq_factor=float(src["high_freq_factor"]),
            original_max_position_embeddings=int(src["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling is missing {e.args[0]!r}") from None
