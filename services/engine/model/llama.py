"""Native PyTorch implementation of the Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Design notes
------------
* One class, :class:`LlamaForCausalLM`, covers the four architectures through :class:`ModelConfig` flags
  (q/k/v bias for Qwen2, per-head q/k RMSNorm for Qwen3). Module/parameter names mirror the Hugging Face
  checkpoint names, so loading is a 1:1 copy.
* ``forward`` runs a *flat* batch (see :mod:`services.engine.model.batch`). All linear layers, norms and
  RoPE run on the whole ``[T, ...]`` flat batch; only attention loops over sequences.
* Side effects: for every layer ``l`` the model writes the new tokens' K (after RoPE) and V into
  ``kv.k[l]`` / ``kv.v[l]`` at the rows in ``batch.slot_mapping``. Nothing else is mutated: no page is
  allocated, no other slot is written, and model parameters are read-only.
* Attention of sequence ``i``: its context K/V (``context_lens[i]`` tokens) is gathered from its pages with
  one precomputed slot-index tensor (built once per forward, reused by every layer); its new queries are the
  last ``q_len`` positions of that context, so the causal mask is ``key <= context_len - q_len + query``.
* RoPE positions come from the caller (``positions``), never inferred from the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .batch import AttnBatch, KVCache
from .config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32, CPU), with linear/llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        factor = scaling.factor
        lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
        old_ctx = scaling.original_max_position_embeddings
        low_freq_wavelen = old_ctx / lo
        high_freq_wavelen = old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif scaling.rope_type != "default":
        raise ValueError(f"unsupported rope type {scaling.rope_type!r}")
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D] (non-interleaved "rotate half" layout, as in HF checkpoints)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_k: torch.Tensor,
        layer_v: torch.Tensor,
        plan: "_AttnPlan",
    ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        # The only mutation: new K/V into their slots.
        layer_k.index_copy_(0, plan.slot_mapping, k.to(layer_k.dtype))
        layer_v.index_copy_(0, plan.slot_mapping, v.to(layer_v.dtype))

        gqa = self.num_heads != self.num_kv_heads
        if plan.decode_slots is not None:
            # Pure decode step of several sequences: one padded gather and one attention call for the
            # whole batch (padding masked out) instead of a Python loop over sequences.
            B, L = plan.decode_slots.shape
            kc = layer_k.index_select(0, plan.decode_slots.view(-1)).view(B, L, self.num_kv_heads, self.head_dim).to(q.dtype)
            vc = layer_v.index_select(0, plan.decode_slots.view(-1)).view(B, L, self.num_kv_heads, self.head_dim).to(q.dtype)
            o = F.scaled_dot_product_attention(
                q.view(B, self.num_heads, 1, self.head_dim), kc.transpose(1, 2), vc.transpose(1, 2),
                attn_mask=plan.decode_mask, scale=self.scale, enable_gqa=gqa,
            )
            return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for i, (start, end) in enumerate(plan.q_ranges):
            if end == start:
                continue
            idx = plan.ctx_slots[i]
            ctx_len = idx.shape[0]
            kc = layer_k.index_select(0, idx).to(q.dtype)  # [C, KVH, D]
            vc = layer_v.index_select(0, idx).to(q.dtype)
            qi = q[start:end].transpose(0, 1)  # [H, Q, D]
            o = F.scaled_dot_product_attention(
                qi,
                kc.transpose(0, 1),
                vc.transpose(0, 1),
                attn_mask=plan.masks[i],
                is_causal=plan.masks[i] is None and (end - start) == ctx_len and ctx_len > 1,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[start:end] = o.transpose(0, 1)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, layer_k, layer_v, plan):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, layer_k, layer_v, plan)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _AttnPlan:
    """Per-forward precomputation shared by all layers: slot indices and masks per sequence."""

    __slots__ = ("slot_mapping", "q_ranges", "ctx_slots", "masks", "decode_slots", "decode_mask")

    def __init__(self, batch: AttnBatch, page_size: int, num_tokens: int, device: torch.device) -> None:
        cu = batch.cu_q
        if len(cu) != batch.num_seqs + 1 or cu[0] != 0 or cu[-1] != num_tokens:
            raise ValueError(f"cu_q {cu} inconsistent with {batch.num_seqs} sequences and {num_tokens} tokens")
        if batch.slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping shape {tuple(batch.slot_mapping.shape)} != ({num_tokens},)")
        self.slot_mapping = batch.slot_mapping.to(device=device, dtype=torch.long)
        self.q_ranges = [(cu[i], cu[i + 1]) for i in range(batch.num_seqs)]
        offs = torch.arange(page_size, dtype=torch.long)
        self.ctx_slots: list[torch.Tensor] = []
        self.masks: list[torch.Tensor | None] = []
        for i in range(batch.num_seqs):
            ctx = batch.context_lens[i]
            q_len = cu[i + 1] - cu[i]
            if q_len > ctx:
                raise ValueError(f"sequence {i}: {q_len} new tokens exceed context_len {ctx}")
            pages = batch.block_tables[i]
            if len(pages) * page_size < ctx:
                raise ValueError(f"sequence {i}: {len(pages)} pages cannot hold {ctx} tokens")
            slots = (torch.tensor(pages, dtype=torch.long)[:, None] * page_size + offs).reshape(-1)[:ctx]
            self.ctx_slots.append(slots.to(device))
            if q_len <= 1 or q_len == ctx:
                self.masks.append(None)  # single query sees everything; full prefill uses is_causal
            else:
                qpos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
                self.masks.append(torch.arange(ctx, device=device)[None, :] <= qpos)
        # A step where every sequence decodes one token: padded [B, Lmax] slot table + key mask.
        self.decode_slots: torch.Tensor | None = None
        self.decode_mask: torch.Tensor | None = None
        if batch.num_seqs > 1 and num_tokens == batch.num_seqs:
            lens = [t.shape[0] for t in self.ctx_slots]
            L = max(lens)
            self.decode_slots = torch.nn.utils.rnn.pad_sequence(self.ctx_slots, batch_first=True, padding_value=0)
            self.decode_mask = (torch.arange(L, device=device)[None, :] < torch.tensor(lens, device=device)[:, None])[:, None, None, :]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq_cpu = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        dev = positions.device
        inv = self._inv_freq.get(dev)
        if inv is None:
            inv = self._inv_freq[dev] = self._inv_freq_cpu.to(dev)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttnBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        """Run the flat batch; return final-normed hidden states ``[T, hidden]``.

        Writes each new token's K/V into ``kv`` at ``batch.slot_mapping`` (every layer) and nothing else.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError("input_ids and positions must be 1-D tensors of equal length")
        if len(kv.k) != self.config.num_hidden_layers:
            raise ValueError(f"KV cache has {len(kv.k)} layers, model has {self.config.num_hidden_layers}")
        dev = self.model.embed_tokens.weight.device
        input_ids = input_ids.to(dev)
        positions = positions.to(dev)
        plan = _AttnPlan(batch, kv.page_size, input_ids.shape[0], dev)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(positions, h.dtype)
        for l, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv.k[l], kv.v[l], plan)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32 logits (pass all rows for all-position logits)."""
        return self.lm_head(hidden).float()
