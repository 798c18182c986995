"""Data plane: the Mooncake transfer engine (TCP on one machine, RDMA in a cluster) and host buffers.

KV bytes move only here, never through gRPC or NATS. Both ends create a :class:`MooncakeEndpoint`
(``TransferEngine`` in P2P-handshake mode: no metadata server, a peer is addressed as ``host:rpc_port``)
and register the memory they expose. The kvstore registers its whole slab pool; an engine registers its
host staging buffer and *pushes* (``write``) checkpoints into the store's slabs or *pulls* (``read``)
restores out of them, one batched call per group of byte ranges. A dead peer fails at once (return code
-1), which the engine turns into "store unavailable".

Facts this relies on (checked on this project's machines): the package is ``mooncake-transfer-engine-non-cuda``
on CPU machines (same ``mooncake`` module as the CUDA build; never both), it needs Debian's
``libibverbs1`` even for TCP, and it logs "Local segment descriptor not found" at every init even on
success. Its TCP sockets bind every interface whatever ``host`` says.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MAX_BATCH = 1024  # segments per batched Mooncake call


class MooncakeUnavailable(RuntimeError):
    """The Mooncake transfer engine cannot be imported or initialized on this machine."""


class TransferError(RuntimeError):
    """A Mooncake transfer failed (peer gone, memory not registered, ...)."""


@dataclass(frozen=True, slots=True)
class Copy:
    """``length`` bytes between local address ``local`` and the peer's address ``remote``."""

    local: int
    remote: int
    length: int


def coalesce(copies: Iterable[Copy]) -> list[Copy]:
    """Merge copies that are adjacent on both sides (consecutive slabs into one large transfer)."""
    out: list[Copy] = []
    for c in copies:
        if c.length <= 0:
            continue
        if out:
            p = out[-1]
            if p.local + p.length == c.local and p.remote + p.length == c.remote:
                out[-1] = Copy(p.local, p.remote, p.length + c.length)
                continue
        out.append(c)
    return out


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, in one call (not in Python 3.11's mmap module)


class HostBuffer:
    """Preallocated host memory with a stable address: an anonymous mapping, in transparent huge pages where the
    kernel allows them (``madvise`` mode), faulted in up front with ``touch``.

    Why up front: a page of an anonymous mapping is allocated and zeroed by the kernel at its first write, and in a
    virtual machine each 4 KiB fault also exits to the hypervisor -- measured on this project's 2-core VM, 1 GiB
    touched page by page took 2.3 s of CPU, with huge pages 0.09 s. A store pool faulted lazily paid that on the
    serving path: the first GiB of checkpoints into a fresh kvstore cost ~1 s of CPU per 370 MB (two thirds of the
    kvstore's CPU in an agent benchmark, ``clear_page_erms``), taken from the engine's compute threads on a machine
    with no spare core. Huge pages also mean 512x fewer TLB entries for the transfer copies.

    On a GPU machine an engine would use pinned memory for its staging buffer instead (see the engine's
    host tier); the store's pool is plain host memory that Mooncake registers."""

    def __init__(self, nbytes: int, touch: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError("buffer size must be positive")
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = _advise(self._map, getattr(mmap, "MADV_HUGEPAGE", None))  # the kernel took the advice
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.nbytes = nbytes
        if touch:
            self.populate()

    def populate(self, start: int = 0, end: int | None = None, *, may_write: bool = True) -> bool:
        """Fault bytes ``[start, end)`` in now (``end`` None = the whole buffer): one ``MADV_POPULATE_WRITE`` call,
        which leaves the contents alone; on a kernel without it (before Linux 5.14), a zero written per
        page -- only with ``may_write``, i.e. where nothing in the range holds data yet or is being written
        (a transfer landing there concurrently would be corrupted). Returns whether the range is now faulted
        in. Mutates: the process's resident memory, and the range's contents only on that fallback."""
        end = self.nbytes if end is None else min(end, self.nbytes)
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        if lo >= end or _advise(self._map, MADV_POPULATE_WRITE, lo, end - lo):
            return True
        if not may_write:
            return False
        self.array[lo:end:mmap.PAGESIZE] = 0
        return True

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)


def _advise(m: mmap.mmap, advice: int | None, start: int = 0, length: int | None = None) -> bool:
    """``madvise(advice)`` over ``[start, start + length)`` of the mapping (``length`` None = to its end); False
    where the platform or kernel refuses it."""
    if advice is None:
        return False
    try:
        m.madvise(advice, start, len(m) - start if length is None else length)
    except (OSError, ValueError):
        return False
    return True


class MooncakeEndpoint:
    """One Mooncake ``TransferEngine`` (thread-safe: calls are serialized by a lock)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", metadata: str = "P2PHANDSHAKE", device: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # missing package, or libibverbs.so.1 absent (apt-get install libibverbs1)
            raise MooncakeUnavailable(f"Mooncake transfer engine not importable: {e}") from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, metadata, protocol, device)
        if rc != 0:
            raise MooncakeUnavailable(f"Mooncake initialize({host!r}, {metadata!r}, {protocol!r}) returned {rc}")
        self.host = host
        self.protocol = protocol
        self.name = f"{host}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}

    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            rc = self._engine.register_memory(address, nbytes)
            if rc != 0:
                raise TransferError(f"register_memory({address:#x}, {nbytes}) returned {rc}")
            self._registered[address] = nbytes

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is not None:
                self._engine.unregister_memory(address)

    def write(self, peer: str, copies: Sequence[Copy]) -> int:
        """Local -> peer. Returns bytes moved; raises TransferError."""
        return self._batch(peer, copies, self._engine.batch_transfer_sync_write, "write")

    def read(self, peer: str, copies: Sequence[Copy]) -> int:
        """Peer -> local. Returns bytes moved; raises TransferError."""
        return self._batch(peer, copies, self._engine.batch_transfer_sync_read, "read")

    def _batch(self, peer: str, copies: Sequence[Copy], fn, what: str) -> int:
        merged = coalesce(copies)
        total = 0
        for i in range(0, len(merged), MAX_BATCH):
            part = merged[i : i + MAX_BATCH]
            rc = fn(peer, [c.local for c in part], [c.remote for c in part], [c.length for c in part])
            if rc != 0:
                raise TransferError(f"Mooncake batch {what} of {len(part)} segments to {peer} returned {rc}")
            total += sum(c.length for c in part)
        return total

    def close(self) -> None:
        for addr in list(self._registered):
            self.unregister(addr)
