"""The weight bank: host copies of catalog models in the layout the executor uses (Talaria §4.4, App. D).

Each model is loaded once from its safetensors checkpoint (through the same loader a stock engine uses, so
the bank holds the *post-processed* tensors: dtype-converted, tied weights stored once) and packed into one
flat host byte image. The image layout *is* the arena's weights-region layout: tensor ``i`` lives at
``specs[i].offset`` in both, so opening a model is a plain byte copy, chunk by chunk, followed by binding
parameter views (``bind_model``). The image is split into fixed-size chunks (the unit of staging and of the
switch's gather plan). Host memory is pinned when CUDA is available (so H2D copies can be asynchronous).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaForCausalLM
from services.engine.model.loader import load_model
from services.engine.model.registry import lookup

from .arena import align_up

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes, in the image and in the arena's weights region
    nbytes: int


@dataclass(slots=True)
class BankEntry:
    model: str
    path: Path
    config: ModelConfig
    dtype: torch.dtype
    specs: tuple[TensorSpec, ...]
    nbytes: int  # image size (the weights region size)
    chunk_bytes: int
    host: torch.Tensor  # uint8 [nbytes], pinned when CUDA is available

    @property
    def num_chunks(self) -> int:
        return -(-self.nbytes // self.chunk_bytes)

    def chunk_range(self, j: int) -> tuple[int, int]:
        lo = j * self.chunk_bytes
        return lo, min(lo + self.chunk_bytes, self.nbytes)

    def chunk(self, j: int) -> torch.Tensor:
        lo, hi = self.chunk_range(j)
        return self.host[lo:hi]


class WeightBank:
    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *, pin: bool | None = None) -> None:
        if chunk_bytes <= 0 or chunk_bytes % 512:
            raise ValueError(f"chunk_bytes must be a positive multiple of 512, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._entries: dict[str, BankEntry] = {}

    def __contains__(self, model: str) -> bool:
        return model in self._entries

    def __getitem__(self, model: str) -> BankEntry:
        return self._entries[model]

    def models(self) -> list[str]:
        return list(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def load(self, model: str, path: str | Path, dtype: torch.dtype | str | None = None) -> BankEntry:
        """Load ``model`` from its checkpoint into the bank (once; a second call returns the entry)."""
        if model in self._entries:
            return self._entries[model]
        module, config = load_model(path, device="cpu", dtype=dtype)
        params = list(module.named_parameters())  # de-duplicated: a tied lm_head is not listed
        specs: list[TensorSpec] = []
        off = 0
        for name, p in params:
            off = align_up(off)
            specs.append(TensorSpec(name, tuple(p.shape), p.dtype, off, p.numel() * p.element_size()))
            off += specs[-1].nbytes
        nbytes = align_up(max(off, 1))
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        host.zero_()
        for spec, (_, p) in zip(specs, params):
            host[spec.offset : spec.offset + spec.nbytes].view(p.dtype).view(p.shape).copy_(p.detach())
        entry = BankEntry(model, Path(path), config, params[0][1].dtype, tuple(specs), nbytes, self.chunk_bytes, host)
        self._entries[model] = entry
        return entry

    def drop(self, model: str) -> None:
        self._entries.pop(model, None)


def bind_model(entry: BankEntry, weights: torch.Tensor) -> LlamaForCausalLM:
    """Build ``entry``'s model whose parameters are views into ``weights`` (a uint8 tensor laid out like the
    bank image, e.g. the arena's weights region). No parameter memory is allocated."""
    if weights.dtype != torch.uint8 or weights.numel() < entry.nbytes:
        raise ValueError(f"weights region of {weights.numel()} bytes cannot hold {entry.model} ({entry.nbytes} bytes)")
    with torch.device("meta"):
        model = lookup(entry.config.architecture).model_class(entry.config)
    by_name = {s.name: s for s in entry.specs}
    fresh: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters():
        s = by_name.get(name)
        if s is None:
            raise ValueError(f"{entry.model}: parameter {name!r} is not in the bank")
        view = weights[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
        fresh[id(p)] = nn.Parameter(view, requires_grad=False)
    if len(fresh) != len(entry.specs):
        raise ValueError(f"{entry.model}: bank has {len(entry.specs)} tensors, model {len(fresh)}")
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[pname] = fresh[id(p)]  # tied parameters stay tied (same id)
    if any(True for _ in model.buffers()):
        raise ValueError(f"{entry.model}: module buffers are not supported by the arena binding")
    model.eval()
    return model
