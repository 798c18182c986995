"""Cost of verified restore (issue 14 item 5): crc32 of restored KV pages, per GiB, beside the copies a
restore does anyway.

What is measured (one process, CPU, single thread for the checksum as in the engine)
    ``pages`` pages of ``page_bytes`` each (default: SmolLM2-135M, page 16, bf16 = 2*30*16*3*64*2 = 368,640 B)
    of random bytes in one host buffer, as a restore staging buffer holds them:

    * **verify**: ``kv_verify.verify_pages`` over the buffer against recorded checksums (the restore's check);
    * **checksum**: ``kv_verify.page_checksums`` (the checkpoint's side, the same crc32 work);
    * **memcpy**: a ``torch`` copy of the same bytes into a preallocated tensor (the cheapest copy a restore does:
      staging -> device pages on CPU);

    each repeated ``repeats`` times, interleaved; medians reported in seconds per GiB and GiB/s, and the ratio
    verify / memcpy. Run ``python -m bench.kv_verify_bench [--gib 1] [--page-bytes N] [--repeats 5]``; prints
    JSON, with ``/proc/loadavg`` beside the numbers (a shared machine: say so with any number you quote).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from services.engine.kv_verify import ALGO, page_checksums, verify_pages
from talaria.v1 import kvstore_pb2 as kpb

SMOLLM2_PAGE_BYTES = 2 * 30 * 16 * 3 * 64 * 2


def run(gib: float = 1.0, page_bytes: int = SMOLLM2_PAGE_BYTES, repeats: int = 5) -> dict:
    pages = max(1, int(gib * 2**30) // page_bytes)
    nbytes = pages * page_bytes
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    buf = src.numpy()
    sums = page_checksums(buf, page_bytes, pages)
    blocks = [kpb.Block(has_checksum=True, checksum=c, checksum_algo=ALGO) for c in sums]
    times: dict[str, list[float]] = {"verify": [], "checksum": [], "memcpy": []}
    for _ in range(repeats):
        t = time.perf_counter()
        good, _ = verify_pages(buf, page_bytes, blocks)
        times["verify"].append(time.perf_counter() - t)
        assert good == pages
        t = time.perf_counter()
        page_checksums(buf, page_bytes, pages)
        times["checksum"].append(time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        times["memcpy"].append(time.perf_counter() - t)
    g = nbytes / 2**30
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bytes": nbytes, "pages": pages, "page_bytes": page_bytes, "repeats": repeats, "algo": ALGO,
        "s_per_gib": {k: v / g for k, v in med.items()},
        "gib_per_s": {k: g / v for k, v in med.items()},
        "verify_over_memcpy": statistics.median(v / m for v, m in zip(times["verify"], times["memcpy"])),
        "torch_threads": torch.get_num_threads(),
        "loadavg": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--page-bytes", type=int, default=SMOLLM2_PAGE_BYTES)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    print(json.dumps(run(a.gib, a.page_bytes, a.repeats), indent=2))


if __name__ == "__main__":
    main()
