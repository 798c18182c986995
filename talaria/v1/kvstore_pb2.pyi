from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttentionFamily(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_FAMILY_UNSPECIFIED: _ClassVar[AttentionFamily]
    ATTENTION_MHA: _ClassVar[AttentionFamily]
    ATTENTION_MLA: _ClassVar[AttentionFamily]
    ATTENTION_RECURRENT: _ClassVar[AttentionFamily]
ATTENTION_FAMILY_UNSPECIFIED: AttentionFamily
ATTENTION_MHA: AttentionFamily
ATTENTION_MLA: AttentionFamily
ATTENTION_RECURRENT: AttentionFamily

class KvLayout(_message.Message):
    __slots__ = ("model", "tp_rank", "tp_size", "page_size", "dtype", "family", "slab_shape", "page_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    SLAB_SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    tp_rank: int
    tp_size: int
    page_size: int
    dtype: str
    family: AttentionFamily
    slab_shape: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    def __init__(self, model: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., family: _Optional[_Union[AttentionFamily, str]] = ..., slab_shape: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("block_id", "prefix_hash", "page_index", "segments", "has_checksum", "checksum", "checksum_algo")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    prefix_hash: int
    page_index: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    has_checksum: bool
    checksum: int
    checksum_algo: str
    def __init__(self, block_id: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., page_index: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., has_checksum: _Optional[bool] = ..., checksum: _Optional[int] = ..., checksum_algo: _Optional[str] = ...) -> None: ...

class DataPlane(_message.Message):
    __slots__ = ("transport", "protocol", "peer", "pool_base", "pool_bytes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    POOL_BASE_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    protocol: str
    peer: str
    pool_base: int
    pool_bytes: int
    def __init__(self, transport: _Optional[str] = ..., protocol: _Optional[str] = ..., peer: _Optional[str] = ..., pool_base: _Optional[int] = ..., pool_bytes: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("layout", "hashes", "lease_s", "owner")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    hashes: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    owner: str
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., hashes: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., owner: _Optional[str] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("epoch", "lease_id", "blocks", "present_pages", "capacity_miss_pages", "data_plane")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_MISS_PAGES_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    present_pages: int
    capacity_miss_pages: int
    data_plane: DataPlane
    def __init__(self, epoch: _Optional[int] = ..., lease_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., present_pages: _Optional[int] = ..., capacity_miss_pages: _Optional[int] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "block_ids", "abort", "checksums", "checksum_algo")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    abort: bool
    checksums: _containers.RepeatedScalarFieldContainer[int]
    checksum_algo: str
    def __init__(self, lease_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., abort: _Optional[bool] = ..., checksums: _Optional[_Iterable[int]] = ..., checksum_algo: _Optional[str] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("epoch", "committed", "aborted")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    committed: int
    aborted: int
    def __init__(self, epoch: _Optional[int] = ..., committed: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout", "hashes", "pin", "lease_s")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    hashes: _containers.RepeatedScalarFieldContainer[int]
    pin: bool
    lease_s: float
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., hashes: _Optional[_Iterable[int]] = ..., pin: _Optional[bool] = ..., lease_s: _Optional[float] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("epoch", "pages", "blocks", "lease_id", "data_plane", "note")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    pages: int
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    lease_id: int
    data_plane: DataPlane
    note: str
    def __init__(self, epoch: _Optional[int] = ..., pages: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., lease_id: _Optional[int] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ..., note: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("block_ids", "lease_s")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("epoch", "lease_id", "pinned")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_id: int
    pinned: int
    def __init__(self, epoch: _Optional[int] = ..., lease_id: _Optional[int] = ..., pinned: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("lease_id", "read_complete")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    READ_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    read_complete: bool
    def __init__(self, lease_id: _Optional[int] = ..., read_complete: _Optional[bool] = ...) -> None: ...

class UnpinReply(_message.Message):
    __slots__ = ("epoch", "unpinned")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    unpinned: int
    def __init__(self, epoch: _Optional[int] = ..., unpinned: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("model", "tp_rank", "hashes", "all_of_model", "leaves_only")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ALL_OF_MODEL_FIELD_NUMBER: _ClassVar[int]
    LEAVES_ONLY_FIELD_NUMBER: _ClassVar[int]
    model: str
    tp_rank: int
    hashes: _containers.RepeatedScalarFieldContainer[int]
    all_of_model: bool
    leaves_only: bool
    def __init__(self, model: _Optional[str] = ..., tp_rank: _Optional[int] = ..., hashes: _Optional[_Iterable[int]] = ..., all_of_model: _Optional[bool] = ..., leaves_only: _Optional[bool] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("epoch", "released")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    released: int
    def __init__(self, epoch: _Optional[int] = ..., released: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("epoch", "data_plane", "capacity_bytes", "slab_bytes", "slabs_total", "slabs_free", "used_bytes", "entries", "reserved", "pinned", "lookups", "hit_pages", "miss_pages", "restores", "capacity_miss_pages", "evictions", "bytes_in", "bytes_out", "stale_lookups", "expired_leases", "eviction_policy", "occupancy")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLABS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLABS_FREE_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MISS_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_MISS_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    STALE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    data_plane: DataPlane
    capacity_bytes: int
    slab_bytes: int
    slabs_total: int
    slabs_free: int
    used_bytes: int
    entries: int
    reserved: int
    pinned: int
    lookups: int
    hit_pages: int
    miss_pages: int
    restores: int
    capacity_miss_pages: int
    evictions: int
    bytes_in: int
    bytes_out: int
    stale_lookups: int
    expired_leases: int
    eviction_policy: str
    occupancy: float
    def __init__(self, epoch: _Optional[int] = ..., data_plane: _Optional[_Union[DataPlane, _Mapping]] = ..., capacity_bytes: _Optional[int] = ..., slab_bytes: _Optional[int] = ..., slabs_total: _Optional[int] = ..., slabs_free: _Optional[int] = ..., used_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., reserved: _Optional[int] = ..., pinned: _Optional[int] = ..., lookups: _Optional[int] = ..., hit_pages: _Optional[int] = ..., miss_pages: _Optional[int] = ..., restores: _Optional[int] = ..., capacity_miss_pages: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., stale_lookups: _Optional[int] = ..., expired_leases: _Optional[int] = ..., eviction_policy: _Optional[str] = ..., occupancy: _Optional[float] = ...) -> None: ...

class KvStoreStatsRecord(_message.Message):
    __slots__ = ("schema_version", "store_id", "address", "unix", "stats")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    store_id: str
    address: str
    unix: float
    stats: StatsReply
    def __init__(self, schema_version: _Optional[int] = ..., store_id: _Optional[str] = ..., address: _Optional[str] = ..., unix: _Optional[float] = ..., stats: _Optional[_Union[StatsReply, _Mapping]] = ...) -> None: ...
