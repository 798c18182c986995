"""The model-architecture registry: a Hugging Face ``architectures[0]`` name -> how to serve it.

Design note (the seam vLLM's ``ModelRegistry`` and SGLang's ``models/`` registry
give those engines): an :class:`Architecture` bundles the three things the engine needs to know about a
family and nothing else -- the ``nn.Module`` class to build, the parser of its ``config.json`` quirks
(the architecture-specific :class:`~services.engine.model.config.ModelConfig` fields), and the layout of
its KV pages. ``ModelConfig.from_dict`` (parsing), ``loader.load_model`` / ``substrate.bank`` (building)
and ``loader.allocate_kv_cache`` / ``Engine`` (KV sizing) ask the registry; none of them names a family.

A new family is one file under ``services/engine/model/`` that defines its module class (the forward
contract of ``llama.LlamaForCausalLM``: flat batch + paged KV, see ``batch.py``) and calls
:func:`register` at import, plus its module name in ``FAMILY_MODULES``. The Llama family (Llama,
Mistral, Qwen2, Qwen3) registers itself in ``llama_family.py``; Gemma 3 (sandwich norms, sliding-window
layers with their own RoPE base, GeGLU) in ``gemma3.py``.

Mutates: only the module-level registry, at import of the family modules (``register``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from talaria.kv_layout import Family

FAMILY_MODULES = ("services.engine.model.llama_family", "services.engine.model.gemma3")


@dataclass(frozen=True, slots=True)
class KVShape:
    """The KV state of one token position of a model: ``family`` (paired K/V slabs for MHA/GQA) and, per
    layer and per K or V, a slab of ``slab`` elements (``(kv_heads, head_dim)`` for MHA)."""

    family: Family
    num_layers: int
    slab: tuple[int, ...]

    def pool_shape(self, num_slots: int) -> tuple[int, ...]:
        """Shape of the whole paged pool holding ``num_slots`` token positions (``[2, L, slots, *slab]``)."""
        return (2, self.num_layers, num_slots, *self.slab)

    def page_bytes(self, page_size: int, itemsize: int) -> int:
        n = 2 * self.num_layers * page_size * itemsize
        for d in self.slab:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Architecture:
    """How to serve one architecture name (see the module note).

    ``parse(raw)`` returns the architecture-specific keyword arguments of ``ModelConfig`` from the raw
    ``config.json`` dict (raising ValueError for a setting it cannot serve); ``kv_shape(config)`` the
    per-position KV layout; ``model_class(config)`` builds the module (on whatever device is current)."""

    name: str
    model_class: type
    parse: Callable[[dict[str, Any]], dict[str, Any]]
    kv_shape: Callable[[Any], KVShape]


_REGISTRY: dict[str, Architecture] = {}
_loaded = False


def register(arch: Architecture) -> None:
    """Add ``arch`` (a family module calls this at import). A name registered twice is an error."""
    if arch.name in _REGISTRY and _REGISTRY[arch.name] is not arch:
        raise ValueError(f"architecture {arch.name!r} is registered twice")
    _REGISTRY[arch.name] = arch


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in FAMILY_MODULES:
            importlib.import_module(mod)


def supported() -> tuple[str, ...]:
    """Every registered architecture name, sorted."""
    _load_families()
    return tuple(sorted(_REGISTRY))


def lookup(name: str) -> Architecture:
    """The registered architecture ``name``; ValueError naming the supported ones otherwise."""
    _load_families()
    arch = _REGISTRY.get(name)
    if arch is None:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(supported())}")
    return arch
