"""One engine's settings, frozen: built once from its config entry, handed to the hot ``Engine`` and to every
model shell of a cold engine.

Design note. The settings that shape one model's runtime (KV pool, batch budgets, CPU kernels, threads,
numerics) used to be spelled out as keyword arguments at every place an engine was built: the hot engine's
constructor, the process entry for hot and for cold engines, and the cold engine's shell construction. A new
setting then touched four places and a missed one silently kept its default. :class:`EngineSettings` is the
one spelling: :meth:`EngineSettings.from_config` reads ``talaria.config.EngineConfig`` once, and everything
downstream passes the object on. Injected dependencies (the clock, a caller-owned model, KV pool, tokenizer or
page allocator) are not settings and stay constructor arguments.

Who reads what: the model runner (``model_runner.ModelRunner``) the model, pool and kernel fields; the loop
(``executor.Engine``) the scheduler budgets and the session cache. A cold engine's shells run on moving
weights, so the hot-only fields (``packed_weights``, ``compile_mode``, ``cuda_graphs``, ``max_model_len``,
the pool size) do not apply to them (``for_shell``). Frozen and slotted: nothing mutates a settings object;
``dataclasses.replace`` makes a variant (tests and tools override single fields that way).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from services.engine.model.cuda_graphs import DEFAULT_MAX_CONTEXT as DEFAULT_GRAPH_CONTEXT

if TYPE_CHECKING:
    from talaria.config import EngineConfig


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What one engine (or one cold-engine shell) is configured to be. Defaults are the constructor defaults
    tests and tools rely on; a config-built engine gets its values from :meth:`from_config`."""

    device: str | torch.device = "cpu"
    dtype: torch.dtype | str | None = None  # None: the checkpoint's dtype (loader.load_model)
    page_size: int = 16
    num_pages: int | None = None  # an explicit KV pool page count (tests, tools); else kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: sized to the machine (memory.py), capped at max_num_seqs contexts
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    lone_prefill_tokens: int = 0
    session_cache_entries: int = 256
    session_cache_pages: int | None = None
    packed_weights: bool | None = None  # None: where it pays (bf16 on a CPU), own weights only
    decode_gemm: str = "auto"
    compile_mode: str = "off"
    paged_decode: str = "auto"
    fused_ops: str = "auto"
    prefill_attention: str = "auto"
    small_step_threads: int | None = None
    intra_op_threads: int | None = None  # None: the constructing thread's count (ModelRunner.threads)
    cuda_graphs: str = "auto"
    cuda_graph_max_context: int = DEFAULT_GRAPH_CONTEXT
    max_model_len: int | None = None
    deterministic: bool = False

    @classmethod
    def from_config(cls, cfg: EngineConfig, intra_op_threads: int | None = None) -> EngineSettings:
        """The settings of config entry ``cfg`` (its dtype resolved for its device: ``loader.engine_dtype``,
        which imports torch). ``intra_op_threads``: the resolved team size (``main.torch_threads``). Pure."""
        from services.engine.model.loader import engine_dtype

        return cls(
            device=cfg.device,
            dtype=engine_dtype(cfg.dtype, cfg.device),
            page_size=cfg.page_size,
            kv_cache_bytes=cfg.kv_cache_mb * 1024 * 1024 if cfg.kv_cache_mb else None,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            lone_prefill_tokens=cfg.lone_prefill_tokens,
            session_cache_entries=cfg.session_cache_entries,
            packed_weights=cfg.packed_weights,
            decode_gemm=cfg.decode_gemm,
            compile_mode=cfg.compile,
            paged_decode=cfg.paged_decode,
            fused_ops=cfg.fused_ops,
            prefill_attention=cfg.prefill_attention,
            small_step_threads=cfg.small_step_threads,
            intra_op_threads=intra_op_threads,
            cuda_graphs=cfg.cuda_graphs,
            cuda_graph_max_context=cfg.cuda_graph_max_context,
            max_model_len=cfg.max_model_len,
            deterministic=cfg.deterministic,
        )

    def with_overrides(self, **overrides: Any) -> EngineSettings:
        """A copy with the named fields replaced (an unknown name raises TypeError). Pure."""
        return replace(self, **overrides) if overrides else self

    def for_shell(self, intra_op_threads: int) -> EngineSettings:
        """The settings of a cold engine's model shell: the same runtime, with the hot-only fields at the values
        that mean "not here" (its weights are views into the arena and move, its pool is the arena's) and the
        team size resolved now, on the thread that builds the cold engine. Pure."""
        return replace(self, intra_op_threads=intra_op_threads, num_pages=None, kv_cache_bytes=None,
                       packed_weights=False, compile_mode="off", cuda_graphs="off", max_model_len=None)
