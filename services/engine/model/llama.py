"""Native PyTorch implementation of the Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Design notes
------------
* One class, :class:`LlamaForCausalLM`, covers the four architectures through :class:`ModelConfig` flags
  (q/k/v bias for Qwen2, per-head q/k RMSNorm for Qwen3). Module/parameter names mirror the Hugging Face
  checkpoint names, so loading is a 1:1 copy. The flags are parsed, and the class is found, through the
  architecture registry (``registry.py``; this family registers in ``llama_family.py``).
* Fused projections (:meth:`LlamaForCausalLM.fuse_projections`, called by the loader): q/k/v and gate/up are
  concatenated into one weight each, and the original ``q_proj.weight`` … parameters become *views* into
  the fused tensor, so memory does not grow, parameter names stay checkpoint names, and an in-place copy
  into a named parameter (the cold pool's bank) updates the fused weight too. A model that is not fused
  (e.g. bound onto arena memory by ``substrate.bank.bind_model``) runs the same math with three matmuls.
  A hot CPU engine additionally *packs* them (:meth:`LlamaForCausalLM.pack_weights`, ``packed.py``):
  oneDNN-blocked copies used by the forward instead of ``F.linear`` on the parameters.
* ``forward`` runs a *flat* batch (see :mod:`services.engine.model.batch`). All linear layers, norms and
  RoPE run on the whole ``[T, ...]`` flat batch. Attention is batched too (the
  varlen "packed" prefill of FlashAttention-2 §3 / vLLM's chunked prefill): a step has at most two
  attention groups per layer, whatever its number of sequences (on a CPU, the multi-token group may make
  one or two flash calls per sequence, see *rows* below):

  - *single-token queries* (decodes, and 1-token prefill chunks): on a CPU with the paged decode kernel
    (``paged_attn.py``, ``LlamaForCausalLM.paged_decode``), one call reading the context K/V in place
    through int32 block tables; otherwise one padded ``[B, Lmax]`` gather of their context K/V and one SDPA
    call with a key-padding mask;
  - *multi-token queries* (prefill chunks, mixed in the same forward as the decodes): one gather and
    one SDPA call in whichever layout has the smaller score area: *packed* -- queries ``[Tp]`` against
    the concatenated contexts ``[Sp]`` with a block-diagonal causal mask (query of sequence ``i`` at
    absolute position ``p`` sees key ``j`` iff ``seq(j) == i`` and ``pos(j) <= p``); or *padded* --
    ``[Bp, Qmax]`` queries against ``[Bp, Lmax]`` keys with a per-sequence causal mask (padding rows
    repeat a real query and are dropped). Equal fresh prompts and a lone fresh prompt use ``is_causal``
    with no mask. On a CPU every other group of at most ``MAX_ROW_CALLS`` sequences is *rows*: per
    sequence, a causal flash call over a fresh prompt, or two unmasked flash calls over a chunk after its
    prefix (a session's new suffix after a prefix hit, the later chunks of a long prompt) merged by
    log-sum-exp (``Attention._attend_rows``): no mask, no block computed for another sequence. The packed mask is ``Tp x Sp``: when that would exceed
    ``MAX_PACKED_SCORES`` (large GPU batches), the prefill sequences are split into as few packed
    groups as keep each under the bound, so memory stays bounded.

  Every index and mask is built once per forward in :class:`_AttnPlan` (vectorized, no Python loop per
  layer or per token) and reused by all layers.
* Sliding window (``config.sliding_window``, Mistral): every mask above also hides keys at or before
  ``q_pos - window`` (transformers' ``sliding_window_overlay``: key ``j`` visible iff
  ``q_pos - window < j <= q_pos``); a plain-causal group that spans more than the window gets an explicit
  mask, and a prefill group gathers each sequence's keys only from the first one its earliest new row sees
  (``_window_starts``): Gemma 3 270M, a 232-token return after 3,000 cached tokens 607 -> 359 ms (15 of its
  18 layers windowed at 512; one engine, bf16, 2 threads, 2026-12-07). The pages outside the window stay
  allocated (the KV manager owns them; prefix caching needs them).
* Side effects: for every layer ``l`` the model writes the new tokens' K (after RoPE) and V into
  ``kv.k[l]`` / ``kv.v[l]`` at the rows in ``batch.slot_mapping`` (in place in the paged pool, before the
  layer's attention reads them). Nothing else is mutated: no page is allocated, no other slot is written,
  and model parameters are read-only (the RoPE cos/sin table is a cache filled on first use per
  device/dtype).
* RoPE positions come from the caller (``positions``), never inferred from the cache.
* Deterministic mode (``LlamaForCausalLM.split_keys`` > 0, set by ``Engine(deterministic=True)``): the plan is
  one group, every query of the step -- decode token or prefill row -- a row of the paged decode kernel over
  its own visible keys, split into fixed chunks of ``split_keys`` keys (``_invariant_group``). Each layout
  above computes a query's softmax in an order set by the batch (the decode kernel's split by batch size and
  threads; flash's key blocks, one call vs two merged by log-sum-exp after a cached prefix; masked packed or
  padded calls), so a greedy call's tokens changed with what shared its steps and with its cache state. With
  one per-query order they cannot: together with bf16 linears whose rows do not depend on the row count
  (the decode GEMM in tiles of ``MAX_ROWS`` rows: ``PackedLinear.tiled``) and row-wise norms/RoPE/SiLU, a token's hidden state
  is a function of the tokens before it only -- the same bits alone or batched, with its prompt prefix cached,
  restored or recomputed, decoded or prefilled (with a packed engine's linears tiled: engine README). This is the batch-invariant approach of SGLang's deterministic
  inference and vLLM's batch-invariant mode (fixed split sizes instead of ones chosen per batch).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .batch import AttnBatch, KVCache
from .config import ModelConfig, RopeScaling
from .fused_ops import FusedOps
from .packed import PackedLinear, linear
from .prefill_attn import applies as prefill_applies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: FusedOps | None = None  # fused CPU ops (fused_ops.py), set by LlamaForCausalLM.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # opaque in a compiled graph: inductor's own reduction order differs
            return torch.ops.talaria.rms_norm(x, self.weight, self.eps)
        if self.ops is not None and (out := self.ops.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        return _rms_norm(x, self.weight, self.eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 normalization, cast back, then the weight (the order of the HF reference implementation)
    h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * h.to(x.dtype)


@torch.library.custom_op("talaria::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Eager RMSNorm as one opaque op for torch.compile (model/compiled.py): bit-identical to eager."""
    return _rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


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


def rope_lookup(tables: dict, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, max_pos: int,
                max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, D]`` of ``inv_freq`` at ``positions`` (all ``<= max_pos``), gathered from the table
    ``tables[(device, dtype)]`` of positions ``[0, n)``, built on first use and regrown (doubling) when a longer
    context arrives (mutates ``tables``). float32 angles ``position * inv_freq``, as transformers computes them."""
    key = (positions.device, dtype)
    table = tables.get(key)
    if table is None or table[0].shape[0] <= max_pos:
        n = min(max(4096, 1 << max_pos.bit_length()), max(max_positions, max_pos + 1))
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        table = tables[key] = (emb.cos().to(positions.device, dtype), emb.sin().to(positions.device, dtype))
    cos, sin = table
    return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
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
        self.qkv_weight: torch.Tensor | None = None  # set by fuse(); q/k/v weights are then views into it
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_packed: PackedLinear | None = None  # set by pack() (model/packed.py)
        self.o_packed: PackedLinear | None = None
        self.ops: FusedOps | None = None  # fused CPU ops (fused_ops.py), set by LlamaForCausalLM.use_fused_ops

    def fuse(self) -> None:
        """Concatenate q/k/v into one weight (and bias); rebind the three parameters as views into it."""
        self.qkv_weight, self.qkv_bias = _fuse_linears((self.q_proj, self.k_proj, self.v_proj))

    def pack(self, gemm=None) -> None:
        """Prepack the fused q/k/v and o weights (model/packed.py; ``gemm``: the decode-step kernel or None);
        needs ``fuse()`` first."""
        self.qkv_packed = PackedLinear(self.qkv_weight, self.qkv_bias, gemm=gemm)
        self.o_packed = PackedLinear(self.o_proj.weight, self.o_proj.bias, gemm=gemm)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = linear(x, self.qkv_packed, self.qkv_weight, self.qkv_bias)
        return qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k and v ``[T, KVH, D]`` of the normed input ``x`` (RoPE and q/k norms applied).
        Pure: reads the parameters only (the part of the layer ``compiled.py`` may compile)."""
        T = x.shape[0]
        if self.qkv_weight is not None and self.q_norm is None:
            # q and k are adjacent columns of the fused projection: one RoPE over both (same math per element)
            qkv = linear(x, self.qkv_packed, self.qkv_weight, self.qkv_bias)
            qk = self._rope(qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
            return q, k, v
        q, k, v = self._qkv(x)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and (out := self.ops.rope(x, cos, sin)) is not None:
            return out
        return apply_rope(x, cos, sin)

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_k: torch.Tensor,
                   layer_v: torch.Tensor, plan: "_AttnPlan") -> torch.Tensor:
        """Write the new K/V into their slots (the only mutation), then attend every query of the plan;
        returns ``[T, H * D]`` (before ``o_proj``)."""
        T = q.shape[0]
        layer_k.index_copy_(0, plan.slot_mapping, k.to(layer_k.dtype))
        layer_v.index_copy_(0, plan.slot_mapping, v.to(layer_v.dtype))
        if plan.single is not None:  # one group covers the whole flat batch, in order
            o = self._attend(q, layer_k, layer_v, plan.single, whole=True)
        else:
            o = torch.empty_like(q)
            for g in plan.groups:
                o.index_copy_(0, g.q_index, self._attend(q, layer_k, layer_v, g, whole=False))
        return o.reshape(T, self.num_heads * self.head_dim)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return linear(o, self.o_packed, self.o_proj.weight, self.o_proj.bias)

    def forward(self, x, cos, sin, layer_k, layer_v, plan: "_AttnPlan") -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.out(self.attend_all(q, k, v, layer_k, layer_v, plan))

    def _attend(self, q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, g: "_Group", whole: bool) -> torch.Tensor:
        """Attention of one query group (see the module notes): ``q`` is the step's ``[T, H, D]`` queries
        (``whole``: the group is all of them, in order); returns the group's ``[Tg, H, D]`` outputs in
        ``g.q_index`` order. Reads the KV pool, writes nothing."""
        gqa = self.num_heads != self.num_kv_heads
        KVH, D = self.num_kv_heads, self.head_dim
        if g.q_src is not None:  # padded layout: [Bp * Qmax] rows gathered (padding repeats a real row)
            q = q.index_select(0, g.q_src)
        elif not whole:
            q = q.index_select(0, g.q_index)
        if g.kind == "padded":
            B, L = g.slots.shape
            Q = q.shape[0] // B
            kc = layer_k.index_select(0, g.slots.view(-1)).view(B, L, KVH, D).transpose(1, 2).to(q.dtype)
            vc = layer_v.index_select(0, g.slots.view(-1)).view(B, L, KVH, D).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                q.view(B, Q, self.num_heads, D).transpose(1, 2), kc, vc, attn_mask=g.mask, is_causal=g.mask is None,
                scale=self.scale, enable_gqa=gqa,
            )
            return o.transpose(1, 2).reshape(B * Q, self.num_heads, D).index_select(0, g.out_pos)
        if g.kind == "kernel":  # the CPU prefill kernel over the pool in place (prefill_attn.py)
            kernel, q_lens, lens = g.paged
            return kernel(q, layer_k, layer_v, g.slots, q_lens, lens, self.scale)
        if g.kind == "decode":
            if g.paged is not None:  # CPU kernel over the pool in place (paged_attn.py); no gather, no mask
                kernel, tables, lens, page_size, window, split = g.paged
                return kernel(q, layer_k, layer_v, tables, lens, page_size, self.scale, window, split)
            B, L = g.slots.shape
            kc = layer_k.index_select(0, g.slots.view(-1)).view(B, L, KVH, D).transpose(1, 2).to(q.dtype)
            vc = layer_v.index_select(0, g.slots.view(-1)).view(B, L, KVH, D).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                q.view(B, self.num_heads, 1, D), kc, vc, attn_mask=g.mask, scale=self.scale, enable_gqa=gqa
            )
            return o.view(B, self.num_heads, D)
        # 4-D [1, heads, S, D]: a 3-D call falls back to SDPA's math kernel on CPU (bmm + softmax + mask
        # checks), measured 10x slower at 512 tokens than the flash kernel a 4-D call gets
        kc = layer_k.index_select(0, g.slots).transpose(0, 1).to(q.dtype)[None]  # [1, KVH, S, D]
        vc = layer_v.index_select(0, g.slots).transpose(0, 1).to(q.dtype)[None]
        if g.kind == "rows":
            return self._attend_rows(q, kc, vc, g.rows)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kc, vc, attn_mask=g.mask, is_causal=g.mask is None, scale=self.scale, enable_gqa=gqa
        )
        return o[0].transpose(0, 1)

    def _attend_rows(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: tuple) -> torch.Tensor:
        """The group's ``[Tg, H, D]`` queries, sequence after sequence (``rows``: new tokens and context length
        of each), against their own contexts, packed in ``[1, KVH, sum(ctx), D]`` keys: per sequence, one
        causal flash call over a fresh prompt, or two over a chunk after ``p`` earlier keys -- those keys all
        visible (no mask) and the chunk's own causal -- merged by their log-sum-exps, the split-softmax
        identity of FlashAttention (Dao et al., NeurIPS'22, §3.1): with ``a = sigmoid(lse_1 - lse_2)``, the
        softmax over both key sets is ``a * o_1 + (1 - a) * o_2``. The one masked call over the packed
        contexts it replaces reads a ``Tg x sum(ctx)`` boolean mask per layer and computes every block, also
        the other sequences' (at one chunk of 512 after 1,536 keys, bf16, 2 threads: 5.8 -> 4.0 ms per
        layer). CPU only (the flash kernel that returns the log-sum-exp). Returns ``[Tg, H, D]``; reads only."""
        flash, outs, qa, ka = _FLASH_LSE, [], 0, 0
        for n_q, n in rows:
            qr = q[qa : qa + n_q].transpose(0, 1)[None]
            kr, vr = kc[:, :, ka : ka + n], vc[:, :, ka : ka + n]
            p = n - n_q
            if p == 0:
                o = flash(qr, kr, vr, 0.0, True, scale=self.scale)[0]
            else:
                o1, l1 = flash(qr, kr[:, :, :p], vr[:, :, :p], 0.0, False, scale=self.scale)
                o2, l2 = flash(qr, kr[:, :, p:], vr[:, :, p:], 0.0, True, scale=self.scale)
                o = torch.lerp(o2.float(), o1.float(), torch.sigmoid(l1 - l2).unsqueeze(-1)).to(q.dtype)
            outs.append(o[0].transpose(0, 1))
            qa, ka = qa + n_q, ka + n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _fuse_linears(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight ``[sum(out), in]`` (and bias) from ``linears``; their parameters become row views of it."""
    weight = torch.cat([m.weight.detach() for m in linears], dim=0)
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears], dim=0) if has_bias else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if has_bias:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()
        self.gate_up_bias: torch.Tensor | None = None
        self.gate_up_packed: PackedLinear | None = None  # set by pack()
        self.down_packed: PackedLinear | None = None
        self.ops: FusedOps | None = None  # fused CPU ops (fused_ops.py), set by LlamaForCausalLM.use_fused_ops

    def fuse(self) -> None:
        """Concatenate gate/up into one weight; rebind both parameters as views into it."""
        self.gate_up_weight, self.gate_up_bias = _fuse_linears((self.gate_proj, self.up_proj))

    def pack(self, gemm=None) -> None:
        """Prepack the fused gate/up and the down weights (model/packed.py; ``gemm``: the decode-step kernel or
        None); needs ``fuse()`` first."""
        self.gate_up_packed = PackedLinear(self.gate_up_weight, self.gate_up_bias, gemm=gemm)
        self.down_packed = PackedLinear(self.down_proj.weight, self.down_proj.bias, gemm=gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up_packed, self.gate_up_weight, self.gate_up_bias)
        act = self.ops.silu_mul(gate_up) if self.ops is not None else None
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return linear(act, self.down_packed, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, layer_k, layer_v, plan, dense: "DenseFns | None" = None):
        """One layer; ``dense`` (default eager) runs its two pure parts, e.g. compiled (``compiled.py``)."""
        pre, post = (layer_in, layer_out) if dense is None else (dense.pre, dense.post)
        q, k, v = pre(self, h, cos, sin)
        return post(self, h, self.self_attn.attend_all(q, k, v, layer_k, layer_v, plan))


def layer_in(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Input norm + q/k/v projection + RoPE of one layer (pure; the first part a compiled step fuses)."""
    return layer.self_attn.project(layer.input_layernorm(h), cos, sin)


def layer_out(layer: DecoderLayer, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """o_proj + residual + post-attention norm + MLP + residual of one layer (pure; the second part)."""
    a = layer.self_attn.out(o)
    norm, ops = layer.post_attention_layernorm, layer.mlp.ops
    fused = ops.add_rms_norm(h, a, norm.weight, norm.eps) if ops is not None else None
    if fused is None:
        h = h + a
        return h + layer.mlp(norm(h))
    h, normed = fused
    return h + layer.mlp(normed)


class DenseFns:
    """The two pure parts of every layer (``layer_in`` / ``layer_out`` or compiled versions of them)."""

    __slots__ = ("pre", "post")

    def __init__(self, pre, post) -> None:
        self.pre, self.post = pre, post

    def scope(self):
        """The context a forward runs its layers in."""
        return contextlib.nullcontext()


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Group:
    """The queries of one attention call (see module notes). ``kind``: ``decode`` (one query per
    sequence, padded keys), ``packed`` (queries and keys concatenated, block-diagonal causal mask),
    ``padded`` (``[Bp, Qmax]`` queries x ``[Bp, Lmax]`` keys, per-sequence causal mask) or ``rows`` (each
    sequence's chunk against its own context, no mask, see ``_attend_rows``; ``slots`` packed as for
    ``packed``) or ``kernel`` (the CPU prefill kernel, AMX or AVX-512 BF16, ``prefill_attn.py``: ``slots`` packed as for ``packed``,
    ``paged`` = ``(kernel, q_lens, ctx_lens)``). ``q_index``: flat
    indices of the group's queries; ``q_src``/``out_pos`` (padded only): the flat query behind each padded
    row, and the padded rows holding the real queries in ``q_index`` order. ``paged`` (decode with the
    CPU kernel only; ``slots``/``mask`` are then None): ``(kernel, int32 block tables [B, pages], int32
    context lengths [B], page_size, window or 0, split_keys: 0 = adaptive, > 0 = the fixed split of the
    deterministic mode)``; in that mode the one group holds every query of the step, prefill rows included."""

    __slots__ = ("kind", "q_index", "slots", "mask", "q_src", "out_pos", "paged", "rows")

    def __init__(self, kind: str, q_index: torch.Tensor, slots: torch.Tensor | None, mask: torch.Tensor | None,
                 q_src: torch.Tensor | None = None, out_pos: torch.Tensor | None = None, paged: tuple | None = None,
                 rows: tuple = ()) -> None:
        self.kind, self.q_index, self.slots, self.mask, self.q_src, self.out_pos = kind, q_index, slots, mask, q_src, out_pos
        self.paged = paged
        self.rows = rows  # kind "rows": (new tokens, context length) per sequence, in order


class _AttnPlan:
    """Per-forward precomputation shared by all layers: KV write slots and the (at most two) query groups.

    ``single`` is set when one group holds every query in flat order (no gather/scatter of queries).
    ``decode_kernel``: the paged decode kernel (``paged_attn.py``) the decode group calls instead of gather
    + SDPA (its int32 tables are built here, once per forward); None = gather + SDPA. ``prefill_kernel``:
    the CPU prefill kernel (``prefill_attn.py``): every multi-token query of the step in one ``kernel`` group
    (one call per layer, no mask, no gather); None = ``_prefill_group``'s layouts.
    """

    __slots__ = ("slot_mapping", "groups", "single")

    def __init__(self, batch: AttnBatch, page_size: int, num_tokens: int, device: torch.device,
                 window: int | None = None, decode_kernel=None, prefill_kernel=None, split_keys: int = 0) -> None:
        cu = batch.cu_q
        B = batch.num_seqs
        if len(cu) != B + 1 or cu[0] != 0 or cu[-1] != num_tokens:
            raise ValueError(f"cu_q {cu} inconsistent with {B} sequences and {num_tokens} tokens")
        if batch.slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping shape {tuple(batch.slot_mapping.shape)} != ({num_tokens},)")
        q_lens = [cu[i + 1] - cu[i] for i in range(B)]
        ctx = batch.context_lens
        for i in range(B):
            if q_lens[i] > ctx[i]:
                raise ValueError(f"sequence {i}: {q_lens[i]} new tokens exceed context_len {ctx[i]}")
            if len(batch.block_tables[i]) * page_size < ctx[i]:
                raise ValueError(f"sequence {i}: {len(batch.block_tables[i])} pages cannot hold {ctx[i]} tokens")
        self.slot_mapping = batch.slot_mapping.to(device=device, dtype=torch.long)
        if split_keys and decode_kernel is not None:  # deterministic: every query a row of the decode kernel
            self.groups = [_invariant_group(q_lens, ctx, batch.block_tables, page_size, device, window, decode_kernel, split_keys)]
            self.single = self.groups[0]
            return
        dec = [i for i in range(B) if q_lens[i] == 1]
        pre = [i for i in range(B) if q_lens[i] > 1]
        self.groups = [_decode_group(dec, cu, ctx, batch.block_tables, page_size, device, window, decode_kernel)] if dec else []
        if pre and prefill_kernel is not None and (window is None or max(ctx[i] for i in pre) <= window):
            self.groups.append(_kernel_group(pre, cu, ctx, batch.block_tables, page_size, device, prefill_kernel))
        else:
            self.groups += [_prefill_group(part, cu, ctx, batch.block_tables, page_size, device, window)
                            for part in _split_packed(pre, q_lens, ctx)]
        self.single = self.groups[0] if len(self.groups) == 1 else None

    @classmethod
    def of_group(cls, slot_mapping: torch.Tensor, group: _Group) -> "_AttnPlan":
        """A plan of one group over the whole flat batch, from tensors the caller owns (the static buffers
        of a captured decode step, ``cuda_graphs.py``)."""
        plan = cls.__new__(cls)
        plan.slot_mapping, plan.groups, plan.single = slot_mapping, [group], group
        return plan


def pad_table(table: list[int], width: int) -> list[int]:
    """The first ``width`` pages of a block table, padded with page 0 (never read: masked or past the length)."""
    head = table[:width]
    return head + [0] * (width - len(head))


def _page_slots(tables: list[list[int]], lens: list[int], page_size: int, device: torch.device, first: int = 0) -> torch.Tensor:
    """Padded ``[n, Lmax - first]`` flat slots of positions ``first .. lens[i] - 1`` of each block table (pad
    slot 0)."""
    L = max(lens)
    width = -(-L // page_size)
    padded = torch.tensor([pad_table(t, width) for t in tables], dtype=torch.long)
    slots = (padded[:, :, None] * page_size + torch.arange(page_size)).reshape(len(tables), -1)[:, first:L].contiguous()
    return slots.to(device)


def _decode_group(rows, cu, ctx, tables, page_size, device, window=None, kernel=None) -> _Group:
    lens = [ctx[i] for i in rows]
    q_index = torch.tensor([cu[i] for i in rows], dtype=torch.long, device=device)
    if kernel is not None:  # int32 block tables [B, pages needed] (pad page 0, never read) + lengths
        width = -(-max(lens) // page_size)
        table = torch.tensor([pad_table(tables[i], width) for i in rows], dtype=torch.int32)
        paged = (kernel, table, torch.tensor(lens, dtype=torch.int32), page_size, window or 0, 0)
        return _Group("decode", q_index, None, None, paged=paged)
    slots = _page_slots([tables[i] for i in rows], lens, page_size, device)
    L = slots.shape[1]
    mask = None
    windowed = window is not None and L > window
    if min(lens) != L or windowed:
        k = torch.arange(L, device=device)[None, :]
        n = torch.tensor(lens, device=device)[:, None]
        mask = k < n
        if windowed:  # the query is at n - 1: keys n - window .. n - 1
            mask &= k >= n - window
        mask = mask[:, None, None, :]
    return _Group("decode", q_index, slots, mask)


def _invariant_group(q_lens, ctx, tables, page_size, device, window, kernel, split_keys) -> _Group:
    """Every query of the flat batch, in order, as one row of the paged decode kernel: the query at position
    ``p`` of sequence ``i`` attends keys ``[0, p]`` (or its window) read in place through ``tables[i]``, in
    fixed chunks of ``split_keys`` keys (``paged_attn.cpp``, ``Split``). A query's attention then depends only
    on its own position and keys: the same bits in a decode step or a prefill chunk, after a cached prefix or
    not, beside any other sequences, with any thread count (the deterministic mode, see the module notes).
    The KV of the step's own tokens is written before attention (``attend_all``), so a chunk's causal part is
    in the pool. Costs a read of the context per query (no reuse across a chunk's queries, as flash has)."""
    T = sum(q_lens)
    width = -(-max(ctx) // page_size)
    table = torch.empty((T, width), dtype=torch.int32)
    lens = torch.empty(T, dtype=torch.int32)
    r = 0
    for i, (n_q, n) in enumerate(zip(q_lens, ctx)):
        table[r : r + n_q] = torch.tensor(pad_table(tables[i], width), dtype=torch.int32)
        lens[r : r + n_q] = torch.arange(n - n_q + 1, n + 1, dtype=torch.int32)
        r += n_q
    q_index = torch.arange(T, dtype=torch.long, device=device)
    return _Group("decode", q_index, None, None, paged=(kernel, table, lens, page_size, window or 0, split_keys))


MAX_ROW_CALLS = 8  # a "rows" group: at most this many sequences (each costs 1-2 flash calls per layer)
MAX_PACKED_SCORES = 1 << 25  # Tp x Sp mask entries of one packed prefill group (32 Mi)


def _split_packed(rows: list[int], q_lens: list[int], ctx: list[int]) -> list[list[int]]:
    """Consecutive runs of ``rows`` whose packed ``sum(q) * sum(ctx)`` stays <= MAX_PACKED_SCORES (a row
    over the bound alone gets its own group)."""
    parts: list[list[int]] = []
    sq = sk = 0
    for i in rows:
        if parts and parts[-1] and (sq + q_lens[i]) * (sk + ctx[i]) > MAX_PACKED_SCORES:
            parts.append([])
            sq = sk = 0
        if not parts:
            parts.append([])
        parts[-1].append(i)
        sq, sk = sq + q_lens[i], sk + ctx[i]
    return parts


PREFILL_LAYOUT = "auto"  # "packed" | "padded" force one layout (tests); "auto": rows on a CPU (_prefill_group), else the smaller score area
# the CPU flash kernel that also returns the log-sum-exp (``_attend_rows``); None: masked calls instead
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefill_group(rows, cu, ctx, tables, page_size, device, window=None) -> _Group:
    """Multi-token queries of ``rows`` as one group: padded when ``Bp * Qmax * Lmax`` is smaller than the
    packed ``sum(q) * sum(ctx)`` (e.g. several fresh prompts of similar length), packed otherwise."""
    lens = [ctx[i] for i in rows]
    q_lens = [cu[i + 1] - cu[i] for i in rows]
    layout = PREFILL_LAYOUT
    fresh_equal = all(q == n for q, n in zip(q_lens, lens)) and len(set(q_lens)) == 1  # plain causal: no mask
    if (
        layout == "auto" and not fresh_equal and len(rows) <= MAX_ROW_CALLS and device.type == "cpu"
        and (window is None or max(lens) <= window) and _FLASH_LSE is not None
    ):  # chunks after their prefixes, or prompts of different lengths: per-sequence flash calls, no mask
        return _rows_group(rows, q_lens, lens, cu, tables, page_size, device)
    starts = _window_starts(q_lens, lens, window)
    if layout == "auto":
        keys = [n - k0 for n, k0 in zip(lens, starts)]
        layout = "padded" if len(rows) * max(q_lens) * (max(lens) - min(starts)) < sum(q_lens) * sum(keys) else "packed"
    if layout == "padded":
        return _padded_group(rows, q_lens, lens, cu, tables, page_size, device, window, min(starts))
    return _packed_group(rows, q_lens, lens, cu, tables, page_size, device, window, starts)


def _window_starts(q_lens: list[int], lens: list[int], window: int | None) -> list[int]:
    """Per sequence, the first context position any of its new rows can see: under a sliding window the
    earliest row (at ``n - q``) sees keys after ``n - q - window``, and every later row sees less; 0 without
    a window. A prefill group reads keys from there on, not the whole context: a 232-token chunk after 3,000
    cached tokens reads 743 keys per windowed layer instead of 3,232. Pure."""
    if window is None:
        return [0] * len(lens)
    return [max(0, n - q - window + 1) for q, n in zip(q_lens, lens)]


def _padded_group(rows, q_lens, lens, cu, tables, page_size, device, window=None, first_key: int = 0) -> _Group:
    """``first_key``: context positions before it are seen by no row of the group (``_window_starts``) and are
    not read."""
    slots = _page_slots([tables[i] for i in rows], lens, page_size, device, first_key)
    B, L, Q = len(rows), slots.shape[1] + first_key, max(q_lens)
    nq = torch.tensor(q_lens, device=device)
    local = torch.minimum(torch.arange(Q, device=device)[None, :], nq[:, None] - 1)  # pad rows repeat the last query
    q_src = (torch.tensor([cu[i] for i in rows], device=device)[:, None] + local).reshape(-1)
    out_pos = torch.cat([torch.arange(b * Q, b * Q + q, dtype=torch.long) for b, q in enumerate(q_lens)]).to(device)
    q_index = torch.cat([torch.arange(cu[i], cu[i + 1], dtype=torch.long) for i in rows]).to(device)
    mask = None  # every sequence a fresh prompt of the same length (and no window within it): plain causal
    if not all(q == Q and n == Q for q, n in zip(q_lens, lens)) or (window is not None and L > window):
        q_pos = (torch.tensor(lens, device=device) - nq)[:, None] + local  # absolute position of each row
        k = torch.arange(first_key, L, device=device)[None, None, :]
        mask = k <= q_pos[:, :, None]
        if window is not None:
            mask &= k > q_pos[:, :, None] - window
        mask = mask[:, None]
    return _Group("padded", q_index, slots, mask, q_src, out_pos)


def _packed(rows, lens, cu, tables, page_size, device, starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contexts of ``rows`` packed sequence after sequence (their flat slots; from ``starts[i]`` on when
    given), the ``[B, Lmax]`` mask of the padded positions that hold them, and the flat indices of the rows'
    queries."""
    padded = _page_slots([tables[i] for i in rows], lens, page_size, device)
    pos = torch.arange(padded.shape[1], device=device)[None, :]
    valid = pos < torch.tensor(lens, device=device)[:, None]
    if starts is not None and any(starts):
        valid &= pos >= torch.tensor(starts, device=device)[:, None]
    q_index = torch.cat([torch.arange(cu[i], cu[i + 1], dtype=torch.long) for i in rows]).to(device)
    return padded[valid], valid, q_index


def _kernel_group(rows, cu, ctx, tables, page_size, device, kernel) -> _Group:
    lens = [ctx[i] for i in rows]
    q_lens = [cu[i + 1] - cu[i] for i in rows]
    slots, _, q_index = _packed(rows, lens, cu, tables, page_size, device)
    return _Group("kernel", q_index, slots, None, paged=(kernel, q_lens, lens))


def _rows_group(rows, q_lens, lens, cu, tables, page_size, device) -> _Group:
    slots, _, q_index = _packed(rows, lens, cu, tables, page_size, device)
    return _Group("rows", q_index, slots, None, rows=tuple(zip(q_lens, lens)))


def _packed_group(rows, q_lens, lens, cu, tables, page_size, device, window=None, starts: list[int] | None = None) -> _Group:
    """``starts``: per sequence, the context positions before it are seen by none of its rows
    (``_window_starts``) and are not read."""
    starts = starts or [0] * len(rows)
    slots, valid, q_index = _packed(rows, lens, cu, tables, page_size, device, starts)
    L = valid.shape[1]
    mask = None
    if len(rows) > 1 or q_lens[0] != lens[0] or (window is not None and L > window):
        nq = torch.tensor(q_lens, device=device)
        nk = torch.tensor([n - k0 for n, k0 in zip(lens, starts)], device=device)  # keys read per sequence
        q_seq = torch.repeat_interleave(torch.arange(len(rows), device=device), nq)
        k_seq = torch.repeat_interleave(torch.arange(len(rows), device=device), nk)
        k_pos = torch.arange(L, device=device).expand(len(rows), L)[valid]
        # absolute position of each query: context_len - q_len + its index within the chunk
        q_first = torch.repeat_interleave(torch.tensor(lens, device=device) - nq, nq)
        q_local = torch.arange(q_seq.shape[0], device=device) - torch.repeat_interleave(torch.cumsum(nq, 0) - nq, nq)
        q_pos = q_first + q_local
        mask = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
    return _Group("packed", q_index, slots, mask)


class LlamaForCausalLM(nn.Module):
    # streaming hot-swap: when set, called with layer index l before layer l runs and with
    # num_hidden_layers before the final norm; it blocks until that layer group's weights are resident
    layer_gate = None
    # whether the layers are ``layer_in`` / ``layer_out`` (what compiled.py compiles) and one plan serves every
    # layer (what cuda_graphs.py captures); a family with other layers (gemma3.py) says False and runs eagerly
    graph_layers = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq_cpu = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self._rope_table: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.lm_head_packed: PackedLinear | None = None  # set by pack_weights()
        self.dense: DenseFns | None = None  # compiled layer parts (compiled.py); None = eager
        # the CPU paged decode kernel (paged_attn.load_kernel(); set by the engine, config ``paged_decode``);
        # None = decode attention by gather + SDPA. Used only on a CPU with the pool in the compute dtype.
        self.paged_decode = None
        # the CPU prefill attention kernel, AMX or AVX-512 BF16 (prefill_attn.load_prefill_kernel(); set by the engine, config
        # ``prefill_attention``); None = ATen's flash kernel. Used only with a bf16 pool and head dim 64.
        self.prefill_attention = None
        self.fused_ops: FusedOps | None = None  # fused elementwise CPU ops (fused_ops.py); None = eager ops
        # deterministic mode (set by the engine, config ``deterministic``): > 0 = every query's attention by the
        # paged decode kernel in fixed chunks of this many keys (``_invariant_group``); needs ``paged_decode``
        self.split_keys = 0

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Give every norm, attention and MLP the fused CPU ops (or take them away with None); mutates those
        modules' ``ops`` and ``self.fused_ops``. The ops apply only where their guards hold (fused_ops.py)."""
        self.fused_ops = ops
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.ops = ops

    @property
    def is_packed(self) -> bool:
        return self.lm_head_packed is not None

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up of every layer (memory-neutral: the old parameters become views)."""
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.fuse()
                layer.mlp.fuse()

    def pack_weights(self, gemm=None) -> None:
        """Prepack every projection and the lm_head for the CPU (model/packed.py: one extra copy of the
        linear weights; the parameters stay, and must not be written in place afterwards). Fuses first.
        ``gemm``: the decode-step kernel (model/decode_gemm.py) for the steps of a few rows, or None."""
        with torch.no_grad():
            if self.model.layers and self.model.layers[0].self_attn.qkv_weight is None:
                self.fuse_projections()
            for layer in self.model.layers:
                layer.self_attn.pack(gemm)
                layer.mlp.pack(gemm)
            self.lm_head_packed = PackedLinear(self.lm_head.weight, None, gemm=gemm)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, D]`` for ``positions`` (all ``<= max_pos``), gathered from a per-device/dtype table
        of positions ``[0, n)`` built on first use and regrown (doubling) when a longer context arrives."""
        return rope_lookup(self._rope_table, self._inv_freq_cpu, positions, dtype, max_pos, self.config.max_position_embeddings)

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
        kernel = self.paged_decode if dev.type == "cpu" and kv.k[0].dtype == self.model.embed_tokens.weight.dtype else None
        weights = self.model.embed_tokens.weight.dtype
        prefill = self.prefill_attention if kv.k[0].dtype == weights and prefill_applies(dev, weights, self.config.head_dim) else None
        max_pos = max(batch.context_lens, default=1) - 1  # no device sync: the batch knows its contexts
        # the plan is built in the call: run_planned's frame is its only holder, so it is freed before the
        # activations (measured: held here, 5x the page faults per prefill, tests/unit/test_allocator_tuning.py)
        return self.run_planned(input_ids, positions, _AttnPlan(batch, kv.page_size, input_ids.shape[0], dev,
                                self.config.sliding_window, kernel, prefill, self.split_keys), kv, max_pos)

    def run_planned(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: "_AttnPlan", kv: KVCache,
                    max_pos: int) -> torch.Tensor:
        """The layers of :meth:`forward` over a prepared plan (device tensors, no validation, no host
        sync: the body a CUDA graph captures, ``cuda_graphs.py``); ``max_pos`` bounds ``positions``.
        Writes the new tokens' K/V at ``plan.slot_mapping``; returns the final-normed hidden states."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(positions, h.dtype, max_pos)
        gate, dense = self.layer_gate, self.dense
        with dense.scope() if dense is not None else contextlib.nullcontext():
            for l, layer in enumerate(self.model.layers):
                if gate is not None:
                    gate(l)
                h = layer(h, cos, sin, kv.k[l], kv.v[l], plan, dense)
        if gate is not None:
            gate(len(self.model.layers))
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32 logits (pass all rows for all-position logits)."""
        return linear(hidden, self.lm_head_packed, self.lm_head.weight, None).float()
