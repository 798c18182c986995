"""KV layout types shared by the engine (which writes and reads pages) and the host KV store (which keeps
them): the layout descriptor of one page of state (Talaria Appendix C). Defined here so that neither service
imports the other's internals."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Family(str, Enum):
    MHA = "mha"  # paired K/V slabs (MHA / GQA / MQA)
    MLA = "mla"  # latent slabs
    RECURRENT = "recurrent"  # Mamba-style recurrent + auxiliary state


@dataclass(frozen=True, slots=True)
class Layout:
    """Layout descriptor of one page of state (Talaria Appendix C)."""

    model: str  # model id + "@" + weights revision
    tp_rank: int
    tp_size: int
    page_size: int
    dtype: str
    family: Family
    slab_shape: tuple[int, ...]
    page_bytes: int

    def shape_key(self) -> tuple[object, ...]:
        """Everything that must match for bytes to be interchangeable, except the rank."""
        return (self.model, self.tp_size, self.page_size, self.dtype, self.family, self.slab_shape, self.page_bytes)

    def for_rank(self, rank: int) -> "Layout":
        return Layout(self.model, rank, self.tp_size, self.page_size, self.dtype, self.family, self.slab_shape, self.page_bytes)
