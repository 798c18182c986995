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


def test_kvstore_pool_is_faulted_in_at_start_not_on_the_serving_path():
    srv = KvStoreServer(KvStoreConfig(capacity_mb=16, slab_kb=4))
    try:
        assert resident_bytes(srv.pool.address) >= 16 * MIB
    finally:
        srv.mooncake.close()
