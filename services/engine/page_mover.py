"""Bytes between one model's KV pool pages and two host staging buffers -- the host tier's byte mover.

Design (the worker side of vLLM's KV connector, SGLang's ``HiCacheController``): it copies, and decides
nothing. It holds no engine, no KV manager and no store: the pages to copy are given to it (the KV manager
decided and holds them), and what happens to the staging bytes (Mooncake, checksums) is the caller's. One page
in staging is ``[2, layers, page_size, kv_heads, head_dim]`` of the pool dtype (the port's ``page_shape``),
pages back to back. On CPU the staging buffers are plain host memory; on CUDA they are pinned.

Threads: ``gather`` runs on the checkpoint worker (or, for the switch barrier's host copies, the executor
thread), ``scatter`` on the restore worker; each buffer has one user at a time (the caller's job order).
"""

from __future__ import annotations

import math

import torch

from services.engine.kv.port import KvPort


class PageMover:
    def __init__(self, port: KvPort, staging_bytes: int) -> None:
        self._port = port
        self.page_shape = port.page_shape
        self.dtype = port.dtype
        self.page_bytes = math.prod(port.page_shape) * port.dtype.itemsize
        pin = torch.cuda.is_available() and port.device.type == "cuda"
        staging_bytes = max(staging_bytes, self.page_bytes)
        self.ckpt_buf = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pin)  # gathers land here
        self.restore_buf = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pin)  # scatters read from here
        self.staging_pages = staging_bytes // self.page_bytes
        self.channel = None  # a transfer scheduler the restore copies go through (see scatter)

    def rebind(self, port: KvPort) -> None:
        """Copy to and from another pool of the same layout (a rebuilt engine shell). Mutates: the pool used."""
        if (port.page_shape, port.dtype) != (self.page_shape, self.dtype):
            raise ValueError(f"rebind to a pool of another layout: {port.page_shape} {port.dtype}, tier has {self.page_shape} {self.dtype}")
        self._port = port

    def host_pages(self, n: int) -> torch.Tensor:
        """A fresh host tensor for ``n`` pages in staging layout (the switch barrier's copies)."""
        return torch.empty((n, *self.page_shape), dtype=self.dtype)

    def stage_from_host(self, copy: torch.Tensor, indices: list[int]) -> None:
        """Pages ``indices`` of a host copy (``host_pages``) -> checkpoint staging, back to back."""
        dst = self.pages_view(self.ckpt_buf, len(indices))
        torch.index_select(copy, 0, torch.tensor(indices, dtype=torch.int64), out=dst)

    def pages_view(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf[: n * self.page_bytes].view(self._port.dtype).view(n, *self.page_shape)

    def _pool_pages(self, tensor: torch.Tensor) -> torch.Tensor:
        P = self._port.page_size
        return tensor.view(-1, P, *tensor.shape[1:])

    def gather(self, pages: list[int], dst: torch.Tensor | None = None) -> None:
        """Device pool pages -> checkpoint staging, or ``dst`` (page-first layout). The device->host copy."""
        kvc = self._port.kv_cache
        if dst is None:
            dst = self.pages_view(self.ckpt_buf, len(pages))
        dev = kvc.k[0].device
        idx = torch.tensor(pages, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            # off the CPU: gather into one device buffer in the staging layout, then one device -> host copy
            # (2 x layers copies into strided host slices would each go through a host temporary)
            out = dst if dev.type == "cpu" else torch.empty(dst.shape, dtype=dst.dtype, device=dev)
            for l in range(len(kvc.k)):
                out[:, 0, l].copy_(self._pool_pages(kvc.k[l]).index_select(0, idx))
                out[:, 1, l].copy_(self._pool_pages(kvc.v[l]).index_select(0, idx))
            if out is not dst:
                dst.copy_(out)
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def scatter(self, pages: list[int]) -> None:
        """Restore staging -> device pool pages. With a ``channel`` (the cold engine's transfer
        scheduler under ``partial_layers``) each layer's copy is a chunk of one ``KV`` transfer, so a weight
        stream cannot starve it (κ-floor); this thread waits for it."""
        kvc = self._port.kv_cache
        src = self.pages_view(self.restore_buf, len(pages))
        dev = kvc.k[0].device
        idx = torch.tensor(pages, dtype=torch.int64, device=dev)
        if dev.type != "cpu" and self.channel is None:
            # one contiguous (pinned -> device) copy of the whole part, then per-layer device gathers, instead
            # of 2 x layers strided host slices (each made contiguous on the host before its copy)
            src = src.to(dev, non_blocking=True)

        def layer(l: int) -> None:
            with torch.inference_mode():
                self._pool_pages(kvc.k[l]).index_copy_(0, idx, src[:, 0, l].to(dev, non_blocking=True))
                self._pool_pages(kvc.v[l]).index_copy_(0, idx, src[:, 1, l].to(dev, non_blocking=True))

        if self.channel is not None:
            per_layer = 2 * len(pages) * self.page_bytes // max(2 * len(kvc.k), 1)
            self.channel.submit_kv([(per_layer, (lambda l=l: layer(l))) for l in range(len(kvc.k))]).sync()
        else:
            for l in range(len(kvc.k)):
                layer(l)
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()
