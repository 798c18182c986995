"""The kvstore's host pool memory (services/kvstore/transfer.py HostBuffer): faulted in when asked, zeroed, stable.

Residency is read from the kernel (/proc/self/smaps, the mapping that holds the buffer), so a buffer that is only
reserved (the lazy default) and one faulted in up front are told apart by what the process really holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services.kvstore.server import KvStoreServer
from services.kvstore.transfer import HostBuffer
from talaria.config import KvStoreConfig

MIB = 1 << 20


def resident_bytes(address: int) -> int:
    """The Rss of the mapping of this process that contains ``address`` (0 if none does)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    return 0


def test_populated_buffer_is_resident_before_its_first_write():
    buf = HostBuffer(32 * MIB, touch=True)
    assert resident_bytes(buf.address) >= 32 * MIB
    assert not buf.array.any()  # the kernel's zero pages, nothing written


def test_lazy_buffer_holds_nothing_until_written_then_keeps_its_address():
    buf = HostBuffer(32 * MIB)
    address = buf.address
    assert resident_bytes(address) < 4 * MIB  # reserved, not faulted in
    buf.array[: 8 * MIB] = 7
    assert resident_bytes(address) >= 8 * MIB
    assert buf.address == address and buf.nbytes == 32 * MIB
    assert np.all(buf.array[: 8 * MIB] == 7) and not buf.array[8 * MIB :].any()


def test_part_of_a_buffer_is_faulted_in_on_request():
    buf = HostBuffer(32 * MIB)
    buf.populate(0, 8 * MIB)
    assert 8 * MIB <= resident_bytes(buf.address) < 16 * MIB


def test_kvstore_pool_is_faulted_in_ahead_of_use_not_on_the_serving_path():
    srv = KvStoreServer(KvStoreConfig(capacity_mb=160, slab_kb=4))  # a head chunk at start, the rest by a thread
    try:
        assert resident_bytes(srv.pool.address) >= 64 * MIB  # the head: there before the first checkpoint
        assert srv.wait_populated(timeout=30)
        assert resident_bytes(srv.pool.address) >= 160 * MIB
    finally:
        srv.mooncake.close()


def test_populating_over_written_data_keeps_it():
    buf = HostBuffer(8 * MIB)
    buf.array[: 2 * MIB] = 5  # a checkpoint already landed here
    assert buf.populate(0, 8 * MIB, may_write=False)
    assert np.all(buf.array[: 2 * MIB] == 5) and resident_bytes(buf.address) >= 8 * MIB


def test_without_populate_write_the_fallback_writes_only_where_allowed(monkeypatch):
    import services.kvstore.transfer as transfer

    monkeypatch.setattr(transfer, "MADV_POPULATE_WRITE", None)  # a kernel before 5.14
    buf = HostBuffer(8 * MIB)
    buf.array[: 2 * MIB] = 5
    assert not buf.populate(0, 8 * MIB, may_write=False)  # refuses rather than zero a page in use
    assert np.all(buf.array[: 2 * MIB] == 5)
    assert buf.populate(4 * MIB, 8 * MIB)  # nothing there yet: the per-page write is allowed
    assert resident_bytes(buf.address) >= 6 * MIB
