"""Conversions between the registry's plain types and the ``talaria.v1`` kvstore messages."""

from __future__ import annotations

import math

from services.kvstore.registry import BlockView
from talaria.kv_layout import Family, Layout
from talaria.v1 import kvstore_pb2 as pb

FAMILY_TO_PB = {Family.MHA: pb.ATTENTION_MHA, Family.MLA: pb.ATTENTION_MLA, Family.RECURRENT: pb.ATTENTION_RECURRENT}
FAMILY_FROM_PB = {v: k for k, v in FAMILY_TO_PB.items()}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}


class WireError(ValueError):
    """A message that does not describe a valid request (becomes INVALID_ARGUMENT)."""


def layout_to_pb(layout: Layout) -> pb.KvLayout:
    return pb.KvLayout(
        model=layout.model, tp_rank=layout.tp_rank, tp_size=layout.tp_size, page_size=layout.page_size,
        dtype=layout.dtype, family=FAMILY_TO_PB[layout.family], slab_shape=list(layout.slab_shape),
        page_bytes=layout.page_bytes,
    )


def layout_from_pb(m: pb.KvLayout) -> Layout:
    """Validate and convert; raises WireError naming the bad field."""
    if m.family not in FAMILY_FROM_PB:
        raise WireError(f"layout.family {m.family} is not a known attention family")
    if m.dtype not in DTYPE_BYTES:
        raise WireError(f"layout.dtype {m.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if not m.slab_shape or any(d == 0 for d in m.slab_shape):
        raise WireError("layout.slab_shape must be non-empty with positive dimensions")
    expect = math.prod(m.slab_shape) * DTYPE_BYTES[m.dtype]
    if expect != m.page_bytes:
        raise WireError(f"layout.page_bytes {m.page_bytes} != prod(slab_shape) * itemsize = {expect}")
    if m.tp_size == 0 or m.tp_rank >= m.tp_size:
        raise WireError(f"layout.tp_rank {m.tp_rank} outside tp_size {m.tp_size}")
    if not m.model or len(m.model) > 512:
        raise WireError("layout.model must be 1..512 characters")
    return Layout(m.model, m.tp_rank, m.tp_size, m.page_size, m.dtype, FAMILY_FROM_PB[m.family], tuple(m.slab_shape), m.page_bytes)


def block_to_pb(b: BlockView) -> pb.Block:
    m = pb.Block(
        block_id=b.block_id, prefix_hash=b.prefix_hash, page_index=b.page_index,
        segments=[pb.Segment(offset=e.offset, length=e.length) for e in b.extents],
    )
    if b.checksum is not None:  # recorded at commit
        m.has_checksum, m.checksum, m.checksum_algo = True, b.checksum, b.checksum_algo
    return m
