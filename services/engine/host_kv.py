"""Engine side of the host KV store: asynchronous checkpoint, restore on return, switch barrier.

Design (Talaria §4.3, Appendices B-C; JointServe §3.2, §4.4). One :class:`HostKV` per engine, attached
to the executor (``Engine.attach_host_kv``); the executor calls it at three points, all on the executor
thread:

* ``checkpoint(seq)`` when a call ends (before its pages are released into the caches): the full pages of
  its committed tokens get a *transfer pin* in the block manager (so no eviction can recycle them) and a
  job is queued. A worker thread then reserves slabs in the store (gRPC), gathers the reserved pages from
  the device pool into a host staging buffer in page-first layout (the device->host copy), hands the pins
  back (through ``poll``), pushes the staging bytes into the store's slabs over Mooncake, and commits —
  the store publishes only after the copy completed.
* ``before_admit(seq)`` when a call arrives: if the device caches (radix + session entry) hold fewer full
  pages of the prompt than the store can restore, it asks the store for the longest agreed prefix
  (pinned), decides restore-or-recompute from measured costs (``kv.host_tier.decide_restore``), allocates
  device pages, pulls the slabs over Mooncake into staging, scatters them into the pages and inserts them
  into the radix cache. The scheduler then sees an ordinary prefix hit and recomputes only the rest; no
  separate token path exists.
* ``poll()`` at each step start: returns the transfer pins of finished gathers to the block manager.

``drain(timeout)`` is the switch barrier: it waits until every queued checkpoint has been gathered and
written (or abandoned), then returns the pins, so the caller may release the KV region. The cold-pool
switch calls it through ``Engine.drain_checkpoints()``.

Failure rule: the store is an optimization. Any control or transfer failure marks it unavailable for
``retry_after_s`` (control calls have deadlines, Mooncake fails at once on a dead peer); meanwhile jobs are
dropped and restores skipped, so calls recompute and produce the same tokens, and nothing waits on a
dead store. A store restart is noticed by its epoch changing: everything known about the old one is
forgotten.

Tracing (issue 7): a restore is a span ``talaria.engine.kv_restore`` (tokens, pages, bytes, seconds, decision
restore | recompute) and a checkpoint a span ``talaria.engine.kv_checkpoint``, both children of the call's
engine span (``seq.trace_context``). The checkpoint runs on the worker after the call may have ended, so the
call's context is captured when the job is queued. Store RPCs run inside these spans, and the client sends
the current context as gRPC metadata, so the store's ``talaria.kvstore.*`` spans join the same trace.

Bytes: one page is ``[2, layers, page_size, kv_heads, head_dim]`` of the pool dtype (the layout
descriptor's ``slab_shape``). On CPU the staging buffer is plain host memory; on CUDA it is pinned.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.trace import Tracer

from services.engine.kv.host_tier import HostSessions, RestoreDecision, decide_restore
from services.engine.kv.session_cache import common_prefix_len
from services.engine.kv_verify import ALGO as CHECKSUM_ALGO, page_checksums, verify_pages
from services.kvstore.client import KvStoreClient, StoreUnavailable, read_pages, write_pages  # the store's public client
from services.kvstore.transfer import MooncakeEndpoint
from talaria import otel
from talaria.ewma import Ewma
from talaria.kv_layout import Family, Layout

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 32 * 1024 * 1024


def weights_revision(model_dir: str | Path, sample_bytes: int = 1 << 20, samples: int = 8) -> str:
    """Fingerprint of a checkpoint's weights: config + names/sizes + sampled chunks of every weight file.

    Part of the store's model key, so a new revision of the same model name never restores old KV.
    """
    d = Path(model_dir)
    h = hashlib.blake2b(digest_size=8)
    cfg = d / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(d.glob("*.safetensors")) + sorted(d.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for i in range(samples):
                fh.seek(size * i // samples)
                h.update(fh.read(sample_bytes))
    return h.hexdigest()


@dataclass(slots=True)
class _Job:
    session_id: str
    pages: list[int]  # pinned device pages, pages[i] holds page i of the chain
    hashes: list[int]
    trace_context: Any = None  # the finishing call's context (its span may have ended by the time the job runs)
    queued_ns: int = 0
    release: list[list[int]] | None = None  # issue 14: not a checkpoint but a session end (chains to release)


class HostKV:
    def __init__(
        self,
        engine: Any,
        client: KvStoreClient,
        *,
        mooncake: MooncakeEndpoint | None = None,
        data_host: str = "127.0.0.1",
        revision: str | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        retry_after_s: float = 2.0,
        restore_per_token_prior: float = 2e-6,
        prefill_per_token_prior: float = 1e-4,
        owner: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        mode: str = "auto",
        tracer: Tracer | None = None,
    ) -> None:
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"mode must be auto, always or never, got {mode!r}")
        self.mode = mode  # "always"/"never" override the cost model (tests, benchmarks)
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self.engine = engine
        self.client = client
        self.owner = owner or engine.model_id
        cfg = engine.config
        L, P, kvh, hd = cfg.num_hidden_layers, engine.page_size, cfg.num_key_value_heads, cfg.head_dim
        self.page_shape = (2, L, P, kvh, hd)
        self.page_elems = 2 * L * P * kvh * hd
        self.page_bytes = self.page_elems * engine.dtype.itemsize
        rev = revision if revision is not None else weights_revision(engine.model_dir)
        self.layout = Layout(
            f"{engine.model_id}@{rev}", tp_rank, tp_size, P, str(engine.dtype).removeprefix("torch."), Family.MHA,
            self.page_shape, self.page_bytes,
        )
        self.mooncake = mooncake or MooncakeEndpoint(data_host)
        pin = torch.cuda.is_available() and engine.device.type == "cuda"
        staging_bytes = max(staging_bytes, self.page_bytes)
        self._ckpt_buf = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pin)
        self._restore_buf = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pin)
        for b in (self._ckpt_buf, self._restore_buf):
            self.mooncake.register(b.data_ptr(), b.numel())
        self.staging_pages = staging_bytes // self.page_bytes
        self.retry_after_s = retry_after_s
        self.restore_per_token = Ewma(restore_per_token_prior)
        self.restore_overhead = Ewma(0.0)
        self.prefill_prior = prefill_per_token_prior
        self.sessions = HostSessions()
        self.epoch = 0
        self._stored: set[int] = set()  # hashes this engine knows the current store epoch holds
        self._down_until = 0.0
        self._lock = threading.Lock()  # guards epoch, _stored, sessions, _down_until, counters
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._unpins: deque[list[int]] = deque()  # gathered: pins to return on the executor thread
        self._inflight = 0
        self._idle = threading.Condition()
        self.counters = {
            "checkpoints": 0, "checkpoint_pages": 0, "checkpoint_bytes": 0, "checkpoints_dropped": 0,
            "restores": 0, "restore_pages": 0, "restore_bytes": 0, "restores_declined": 0, "store_failures": 0,
            "restore_verify_failures": 0, "restore_unverified_pages": 0, "sessions_released": 0, "released_pages": 0,
        }
        self.last_decision: RestoreDecision | None = None
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"host-kv-{self.owner}", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- availability
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, err: Exception) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_after_s
            self.counters["store_failures"] += 1
            # whether it comes back as the same store is unknown: forget what it held (sessions read as
            # missing until a reply names an epoch again; restores always ask the store anyway)
            self.epoch = 0
            self._stored.clear()
        log.warning("kvstore unavailable (%s: %s); recomputing for %.1fs", what, err, self.retry_after_s)

    def _saw_epoch(self, epoch: int) -> None:
        with self._lock:
            if epoch != self.epoch:
                if self.epoch:
                    log.info("kvstore restarted (epoch %d -> %d): forgetting what it held", self.epoch, epoch)
                self.epoch = epoch
                self._stored.clear()

    # ---------------------------------------------------------------- checkpoint (executor thread)
    def checkpoint(self, seq) -> bool:
        """Queue an asynchronous checkpoint of the full committed pages of a finishing session call."""
        if not seq.session_id or self._closed or not self.available():
            return False
        kv = self.engine.kv
        P = kv.page_size
        n = seq.num_computed_tokens // P
        if n == 0 or len(seq.pages) < n:
            return False
        hashes = kv.extend_hashes(seq.hashes, seq.token_ids[: n * P], seq.salt)[:n]
        with self._lock:
            if all(h in self._stored for h in hashes):
                self.sessions.committed(seq.session_id, n * P, self.epoch, time.time())
                return False
        pages = list(seq.pages[:n])
        kv.pin_pages(pages)
        with self._idle:
            self._inflight += 1
        self._jobs.put(_Job(seq.session_id, pages, list(hashes), getattr(seq, "trace_context", None), time.time_ns()))
        return True

    def poll(self) -> int:
        """Return the transfer pins of completed device->host gathers (executor thread). Returns pages freed."""
        freed = 0
        while self._unpins:
            freed += self.engine.kv.unpin_pages(self._unpins.popleft())
        return freed

    def drain(self, timeout: float | None = None) -> bool:
        """Switch barrier: wait for every queued checkpoint to finish (or be abandoned), then return pins.

        Call on the executor thread (or holding its step lock). Returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
            done = self._inflight == 0
        self.poll()
        return done

    @property
    def outstanding(self) -> int:
        return self._inflight

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job.release is not None:
                    self._release(job)
                    continue
                attrs = {"talaria.kv.pages": len(job.hashes), "talaria.kv.queued_seconds": (time.time_ns() - job.queued_ns) / 1e9}
                if job.session_id:
                    attrs[otel.SESSION_ID] = job.session_id
                with self.tracer.start_as_current_span("talaria.engine.kv_checkpoint", context=job.trace_context, attributes=attrs):
                    self._checkpoint(job)
            except Exception as e:  # noqa: BLE001 - a failing checkpoint must never stop the worker
                log.exception("checkpoint of session %s failed", job.session_id)
                self._failed("checkpoint", e)
            finally:
                if job.pages:  # not handed back yet (failure before the gather)
                    self._unpins.append(job.pages)
                with self._idle:
                    self._inflight -= 1
                    self._idle.notify_all()

    def _checkpoint(self, job: _Job) -> None:
        if not self.available():
            self.counters["checkpoints_dropped"] += 1
            return
        try:
            r = self.client.reserve(self.layout, job.hashes, owner=self.owner)
        except StoreUnavailable as e:
            self._failed("reserve", e)
            return
        self._saw_epoch(r.epoch)
        blocks = list(r.blocks)
        span = trace.get_current_span()
        span.set_attributes({"talaria.kv.new_pages": len(blocks), "talaria.kv.present_pages": r.present_pages, "talaria.kv.capacity_miss_pages": r.capacity_miss_pages})
        written: list[int] = []
        sums: list[int] = []
        try:
            for i in range(0, len(blocks), self.staging_pages):
                part = blocks[i : i + self.staging_pages]
                self._gather([job.pages[b.page_index] for b in part])
                sums += page_checksums(self._ckpt_buf.numpy(), self.page_bytes, len(part))  # issue 14: of the bytes written
                if i + self.staging_pages >= len(blocks):
                    pins, job.pages = job.pages, []
                    self._unpins.append(pins)  # device->host copies done: the pages may go
                write_pages(self.mooncake, r.data_plane, part, self._ckpt_buf.data_ptr(), self.page_bytes)
                written += [b.block_id for b in part]
            if written:
                self.client.commit(r.lease_id, written, checksums=sums, checksum_algo=CHECKSUM_ALGO)
            span.set_attribute("talaria.kv.bytes", len(written) * self.page_bytes)
        except StoreUnavailable as e:
            span.set_attribute(otel.ERROR_TYPE, "store_unavailable")
            self._failed("checkpoint transfer", e)
            try:
                self.client.commit(r.lease_id, [b.block_id for b in blocks], abort=True)
            except (StoreUnavailable, ValueError):
                pass  # the lease expires in the store
            return
        with self._lock:
            self._stored.update(job.hashes)
            self.sessions.committed(job.session_id, len(job.hashes) * self.engine.page_size, r.epoch, time.time())
            c = self.counters
            c["checkpoints"] += 1
            c["checkpoint_pages"] += len(written)
            c["checkpoint_bytes"] += len(written) * self.page_bytes

    # ---------------------------------------------------------------- page <-> staging
    def _pages_view(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf[: n * self.page_bytes].view(self.engine.dtype).view(n, *self.page_shape)

    def _pool_pages(self, tensor: torch.Tensor) -> torch.Tensor:
        P = self.engine.page_size
        return tensor.view(-1, P, *tensor.shape[1:])

    def _gather(self, pages: list[int]) -> None:
        """Device pool pages -> checkpoint staging (page-first layout). The device->host copy."""
        kvc = self.engine.kv_cache
        dst = self._pages_view(self._ckpt_buf, len(pages))
        idx = torch.tensor(pages, dtype=torch.int64, device=kvc.k[0].device)
        with torch.inference_mode():
            for l in range(len(kvc.k)):
                dst[:, 0, l].copy_(self._pool_pages(kvc.k[l]).index_select(0, idx))
                dst[:, 1, l].copy_(self._pool_pages(kvc.v[l]).index_select(0, idx))
        if kvc.k[0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _scatter(self, pages: list[int]) -> None:
        """Restore staging -> device pool pages."""
        kvc = self.engine.kv_cache
        src = self._pages_view(self._restore_buf, len(pages))
        dev = kvc.k[0].device
        idx = torch.tensor(pages, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            for l in range(len(kvc.k)):
                self._pool_pages(kvc.k[l]).index_copy_(0, idx, src[:, 0, l].to(dev, non_blocking=True))
                self._pool_pages(kvc.v[l]).index_copy_(0, idx, src[:, 1, l].to(dev, non_blocking=True))
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()

    # ---------------------------------------------------------------- restore (executor thread)
    def before_admit(self, seq) -> int:
        """Restore the store's agreed prefix of ``seq``'s prompt beyond what the device caches hold.

        Returns the number of pages restored (0: nothing to do, declined, or the store failed)."""
        if self._closed or self.mode == "never" or not self.available():
            return 0
        kv = self.engine.kv
        P = kv.page_size
        toks = seq.token_ids
        n_full = len(toks) // P
        if n_full == 0:
            return 0
        hashes = kv.extend_hashes(seq.hashes, toks, seq.salt)[:n_full]
        radix_pages = kv.radix.match(hashes)
        r = len(radix_pages)
        entry = kv.sessions.peek(seq.session_id) if seq.session_id else None
        sess_full = min(common_prefix_len(list(toks), entry.token_ids) // P, len(entry.pages)) if entry else 0
        base = max(r, sess_full)
        if base >= n_full:
            return 0
        with self._lock:
            known = hashes[base] in self._stored
        if not (seq.session_id or known):
            return 0  # a call outside any session whose next page we never stored: skip the round trip
        attrs: dict[str, Any] = {"talaria.kv.device_pages": base, "talaria.kv.prompt_pages": n_full}
        if seq.session_id:
            attrs[otel.SESSION_ID] = seq.session_id
        ctx = getattr(seq, "trace_context", None)
        t = time.perf_counter()
        with self.tracer.start_as_current_span("talaria.engine.kv_restore", context=ctx, attributes=attrs) as span:
            k, outcome = self._restore(seq, hashes, base, radix_pages, entry, r)
            # decision: restore | recompute (the cost model declined) | miss (the store has no more) | unavailable
            span.set_attributes({
                "talaria.kv.restored_pages": k, "talaria.kv.tokens": k * P, "talaria.kv.bytes": k * self.page_bytes,
                "talaria.kv.seconds": time.perf_counter() - t, "talaria.kv.decision": outcome,
            })
        return k

    def _restore(self, seq, hashes: list[int], base: int, radix_pages, entry, r: int) -> tuple[int, str]:
        """Lookup, decide, read and scatter (inside the ``kv_restore`` span). Returns (pages restored, outcome)."""
        kv = self.engine.kv
        P = kv.page_size
        span = trace.get_current_span()
        t0 = time.perf_counter()
        try:
            reply = self.client.lookup(self.layout, hashes, pin=True)
        except (StoreUnavailable, ValueError) as e:
            span.set_attribute(otel.ERROR_TYPE, "store_unavailable")
            self._failed("lookup", e)
            return 0, "unavailable"
        self._saw_epoch(reply.epoch)
        avail = reply.pages
        span.set_attribute("talaria.kv.store_pages", avail)
        if avail <= base:
            self._unpin(reply.lease_id, False)
            return 0, "miss"
        k = avail - base
        prefill = (self.engine.stats().get("profile") or {}).get("prefill_per_token") or self.prefill_prior
        decision = decide_restore(
            k * P, restore_per_token=self.restore_per_token.value, prefill_per_token=prefill,
            overhead_s=self.restore_overhead.value,
        )
        if self.mode != "auto":
            decision = RestoreDecision(self.mode == "always", decision.tokens, decision.restore_s, decision.recompute_s, f"mode={self.mode}")
        self.last_decision = decision
        span.set_attributes({
            "talaria.kv.estimate.restore_seconds": decision.restore_s, "talaria.kv.estimate.recompute_seconds": decision.recompute_s,
            "talaria.kv.decision_reason": decision.reason,
        })
        if not decision.restore:
            self.counters["restores_declined"] += 1
            self._unpin(reply.lease_id, False)
            return 0, "recompute"
        pages = self._allocate(k, hashes[:r], seq.session_id)
        if not pages:
            self._unpin(reply.lease_id, False)
            return 0, "recompute"
        k = len(pages)
        blocks = list(reply.blocks[base : base + k])
        t1 = time.perf_counter()
        try:
            for i in range(0, k, self.staging_pages):
                part = blocks[i : i + self.staging_pages]
                read_pages(self.mooncake, reply.data_plane, part, self._restore_buf.data_ptr(), self.page_bytes)
                good = self._verify(part)  # issue 14: before the pages are published
                self._scatter(pages[i : i + good])
                if good < len(part):  # the rest is recomputed: never published, never different tokens
                    kv.allocator.decref(pages[i + good :])
                    pages, k = pages[: i + good], i + good
                    break
        except StoreUnavailable as e:
            kv.allocator.decref(pages)
            span.set_attribute(otel.ERROR_TYPE, "store_unavailable")
            self._failed("restore transfer", e)
            return 0, "unavailable"
        t2 = time.perf_counter()
        if k == 0:
            self._unpin(reply.lease_id, False)
            return 0, "verify_failed"
        chain = list(radix_pages) + (list(entry.pages[r:base]) if entry is not None and base > r else []) + pages
        kv.radix.insert(hashes[: base + k], chain)
        kv.allocator.decref(pages)  # the radix cache holds them now
        self._unpin(reply.lease_id, True)
        t3 = time.perf_counter()
        span.set_attribute("talaria.kv.transfer_seconds", t2 - t1)
        self.restore_per_token.add((t2 - t1) / (k * P))
        self.restore_overhead.add((t1 - t0) + (t3 - t2))
        c = self.counters
        c["restores"] += 1
        c["restore_pages"] += k
        c["restore_bytes"] += k * self.page_bytes
        return k, "restore"

    def _verify(self, part) -> int:
        """Issue 14: check the received pages of ``part`` (in the restore staging buffer) against the store's
        checksums. Returns the verified prefix length; a mismatch is counted, and the bad page's chain (it and
        everything extending it) is released in the store so it is never served again."""
        good, unverified = verify_pages(self._restore_buf.numpy(), self.page_bytes, part)
        self.counters["restore_unverified_pages"] += unverified
        if good < len(part):
            self.counters["restore_verify_failures"] += 1
            trace.get_current_span().set_attribute("talaria.kv.verify_failed_page", part[good].page_index)
            log.warning("restored page %d failed its checksum: recomputing from there", part[good].page_index)
            try:
                self.client.release(self.layout.model, self.layout.tp_rank, [part[good].prefix_hash])
            except (StoreUnavailable, ValueError) as e:
                self._failed("release", e)
            with self._lock:
                self._stored.discard(part[good].prefix_hash)
        return good

    # ---------------------------------------------------------------- session end (issue 14 item 4)
    def release_session(self, session_id: str, chains: list[list[int]]) -> None:
        """Queue the release of an ended session's chains (newest first) in the store, after its queued
        checkpoints, on the worker: the pages nothing else extends are dropped (``Release`` with
        ``leaves_only``, one RPC per chain). Any thread.
        The session is forgotten now (for the next snapshot) and again after its queued checkpoints."""
        with self._lock:
            self.sessions.drop(session_id)
        if self._closed:
            return
        with self._idle:
            self._inflight += 1
        self._jobs.put(_Job(session_id, [], [], None, time.time_ns(), release=[list(c) for c in chains if c]))

    def _release(self, job: _Job) -> None:
        """Worker thread (``_run`` accounts for the job)."""
        with self._lock:
            self.sessions.drop(job.session_id)
        if not job.release or not self.available():
            return
        released = 0
        try:
            for chain in job.release:
                released += self.client.release(self.layout.model, self.layout.tp_rank, chain, leaves_only=True).released
        except (StoreUnavailable, ValueError) as e:
            self._failed("release", e)
            return
        with self._lock:
            for chain in job.release:  # unsure which pages stayed (shared): a later checkpoint asks the store
                self._stored.difference_update(chain)
            self.counters["sessions_released"] += 1
            self.counters["released_pages"] += released

    def _allocate(self, k: int, locked: list[int], session_id: str) -> list[int]:
        kv = self.engine.kv
        if not kv.can_allocate(k):
            kv.radix.lock(locked)
            try:
                kv.ensure_free(k, None, session_id)
            finally:
                kv.radix.unlock(locked)
            k = min(k, kv.num_free_pages)
        return kv.allocator.allocate(k) if k > 0 else []

    def _unpin(self, lease_id: int, read_complete: bool) -> None:
        if not lease_id:
            return
        try:
            self.client.unpin(lease_id, read_complete)
        except (StoreUnavailable, ValueError) as e:
            self._failed("unpin", e)  # the read lease expires in the store

    # ---------------------------------------------------------------- introspection
    def snapshot(self) -> dict[str, Any]:
        available = self.available()
        with self._lock:
            sessions = [
                {"session_id": s.session_id, "committed_tokens": s.tokens, "last_use_unix": s.last_use_unix,
                 "state": self.sessions.state(s.session_id, self.epoch, available)}
                for s in self.sessions.entries()
            ]
            return {
                "available": available,
                "epoch": self.epoch,
                "restore_per_token": self.restore_per_token.value,
                "restore_overhead_s": self.restore_overhead.value,
                "outstanding_checkpoints": self._inflight,
                "sessions": sessions,
                **self.counters,
            }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=10)
        for b in (self._ckpt_buf, self._restore_buf):
            self.mooncake.unregister(b.data_ptr())
