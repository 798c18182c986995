"""Verified restore: a checksum per checkpointed page, checked before a restore publishes it.

Design. No anchor system verifies host KV (vLLM and SGLang users report silent KV corruption around tool calls:
vllm#31210, sglang#39830); Talaria §4.3 only requires that a restored prefix give the same tokens as
recomputation, and a flipped byte in the host pool breaks exactly that without any error. So:

* at checkpoint, the engine computes ``crc32`` of each page's bytes *as it writes them* (the staging buffer
  after the device->host gather, i.e. the bytes Mooncake pushes into the store) and sends the values with
  ``Commit``; the store records them with the blocks (``kvstore.proto`` ``Block.checksum``) and returns them on
  ``Lookup``;
* at restore, the engine checks the bytes it *received* (the restore staging buffer after the Mooncake read)
  against the recorded values before they are scattered into device pages and inserted into the radix cache.
  The restore keeps only the verified prefix up to the first mismatch; the pages from there on are not
  published, so the scheduler recomputes them (a prefix hit shorter by those pages) and the tokens are those
  of a cold run. Each mismatching page is counted (``talaria_kv_restore_verify_failures``).

The checksum is ``zlib.crc32`` (no extra dependency; hardware-assisted in recent zlib builds): cost measured by
``bench/kv_verify_bench.py``. Blocks committed without a checksum (an older engine) are accepted unverified
and counted as such. Pure functions over any buffer-protocol object (no torch), so they test anywhere.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

ALGO = "crc32"


def page_checksums(buf: Any, page_bytes: int, n: int) -> list[int]:
    """crc32 of pages ``0..n-1`` of ``buf`` (page ``j`` at byte ``j * page_bytes``). Reads only."""
    mv = memoryview(buf).cast("B")
    return [zlib.crc32(mv[j * page_bytes : (j + 1) * page_bytes]) for j in range(n)]


def verify_pages(buf: Any, page_bytes: int, blocks: Sequence[Any]) -> tuple[int, int]:
    """Check pages ``0..len(blocks)-1`` of ``buf`` against the checksums the store recorded for ``blocks``
    (``kvstore_pb2.Block``: ``has_checksum``, ``checksum``, ``checksum_algo``). Reads only.

    Returns ``(good, unverified)``: ``good`` = the length of the verified prefix (the index of the first page
    whose bytes do not match; ``len(blocks)`` when all match), ``unverified`` = pages in that prefix that carried
    no checksum of a known algorithm (accepted as they are)."""
    mv = memoryview(buf).cast("B")
    unverified = 0
    for j, b in enumerate(blocks):
        if not b.has_checksum or b.checksum_algo != ALGO:
            unverified += 1
            continue
        if zlib.crc32(mv[j * page_bytes : (j + 1) * page_bytes]) != b.checksum:
            return j, unverified
    return len(blocks), unverified


__all__ = ["ALGO", "page_checksums", "verify_pages"]
