"""What a host KV tier receives from one model's engine, and nothing else (pure Python, no torch import).

Design (the scheduler-side / worker-side split of vLLM's KV connector): the host tier never holds the engine.
Page decisions go through the KV manager (the owner of every page, ``kv/manager.py``); bytes move between the
pool tensors and the tier's staging buffers, which only needs the pool's layout; the restore-or-recompute
choice needs the engine's measured prefill cost, given as a callable. ``Engine.kv_port()`` builds one; a cold
engine that rebuilds a model's shell hands the tier the new shell's port (``HostKV.rebind``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.engine.kv.manager import KVManager


@dataclass(frozen=True, slots=True)
class KvPort:
    model_id: str
    kv: KVManager  # every page the tier pins, reserves, publishes or frees goes through it
    kv_cache: Any  # the pool (model.batch.KVCache): k[l], v[l] of shape [num_pages * page_size, kv_heads, head_dim]
    page_shape: tuple[int, int, int, int, int]  # one page in page-first layout: (2, layers, page_size, kv_heads, head_dim)
    dtype: Any  # the pool's torch dtype
    prefill_per_token: Callable[[], float]  # the engine's measured prefill seconds per token (0.0: not measured yet)
    model_dir: str | Path | None = None  # the weights, fingerprinted into the store's model key when no revision is given

    @property
    def page_size(self) -> int:
        return self.page_shape[2]

    @property
    def device(self) -> Any:
        """The pool's torch device."""
        return self.kv_cache.k[0].device
