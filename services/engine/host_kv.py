"""Engine side of the host KV store: asynchronous checkpoint, restore on return, switch barrier.

Design (Talaria §4.3, Appendices B-C; JointServe §3.2, §4.4). One :class:`HostKV` per model's engine, built
from that engine's ``KvPort`` (``kv/port.py``: its KV manager, pool and page layout, measured prefill cost --
the tier holds no engine) and attached to the executor (``Engine.attach_host_kv``); the executor calls it at
three points, all on the executor thread:

* ``checkpoint(seq)`` when a call ends (before its pages are released into the caches): the full pages of
  its committed tokens get a *transfer pin* in the block manager (so no eviction can recycle them). Under
  write-through (the default, ``engines[].host_kv_write_policy: through``: another instance can restore the
  session, and an engine killed after a call's end loses nothing committed) a job is queued now; under
  write-back (``kv/write_back.py``) the session is marked dirty and the job is queued by ``write_back`` when the pages are about to leave the device (the KV
  manager's ``pressure_hook`` -> ``relieve_pressure``, the switch barrier ``drain``, the slot's end, a
  retention hint expecting a late return); a session end drops it unwritten. A worker thread (one intra-op
  thread, ``intra_op.set_thread_count``: a second OpenMP pool would throttle the executor's) then reserves
  slabs in the store (gRPC), gathers the reserved pages from
  the device pool into a host staging buffer in page-first layout (the device->host copy), hands the pins
  back (through ``poll``), pushes the staging bytes into the store's slabs over Mooncake, and commits —
  the store publishes only after the copy completed.
* ``begin_restore(seq)`` when a call arrives: the KV manager's ``match_prefix`` (with this tier's
  ``StoreIndex`` as its host-index port) says how many full pages are on the device and how many more the
  store may hold. If the store may hold more, the call is held here (not scheduled) and its restore runs
  off the executor thread, the shape of vLLM's KV connector / SGLang's load-back: the restore worker asks
  the store for the longest agreed prefix (pinned) and decides restore-or-recompute from measured costs
  (``kv.host_tier.decide_restore``); the executor thread reserves device pages from the KV manager
  (``reserve_restore``: the device part of the prefix is held, fresh pages allocated); the worker pulls the
  slabs over Mooncake into staging and scatters them into those pages (``_land``); the executor thread
  publishes them into the radix cache (``_publish_restored`` -> ``KVManager.adopt_restore``, the one point
  where restored bytes become visible) and hands the call to the scheduler (``take_ready``), which sees an
  ordinary prefix hit and recomputes only the rest. Running decodes keep stepping meanwhile; a restore in
  progress holds its pages; this tier never touches the radix tree, session cache or allocator itself.
* ``poll()`` at each step start: returns the transfer pins of finished gathers to the block manager and
  advances restores (reserve, publish).

``release_device(timeout)`` is the switch barrier: it writes back every dirty session, copies the jobs the worker has not
started into host memory at once (the worker writes those copies to the store after the switch), waits until every other
queued checkpoint has been gathered off the device and every restore has ended, then returns the pins, so the caller may
release the KV region. The cold-pool switch calls it through ``Engine.release_device_kv()``. A session whose checkpoint is
still being written when its next call arrives restores once the write is committed (the restore worker waits for it).
``drain(timeout)`` waits for everything written and committed (flush; tests and benches).

Failure rule: the store is an optimization. Any control or transfer failure marks it unavailable for
``retry_after_s`` (control calls have deadlines, Mooncake fails at once on a dead peer); meanwhile jobs are
dropped and restores skipped, so calls recompute and produce the same tokens, and nothing waits on a
dead store. A store restart is noticed by its epoch changing: everything known about the old one is
forgotten.

Tracing: a restore is a span ``talaria.engine.kv_restore`` (tokens, pages, bytes, seconds, decision
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from opentelemetry import trace
from opentelemetry.trace import Tracer

from services.engine.kv.host_tier import RESTORE_MODES, RestoreDecision, StoreIndex, decide_restore
from services.engine.kv.session_residency import Residency, host_residencies
from services.engine.kv.manager import KVManager, RestoreReservation
from services.engine.kv.port import KvPort
from services.engine.kv.write_back import WRITE_POLICIES, DirtySet, late_sessions, orphaned_sessions, write_now
from services.kvstore.client import KvStoreClient, MooncakeEndpoint, StoreUnavailable, read_pages, write_pages  # the store's public API
from services.engine.intra_op import set_thread_count
from services.engine.page_mover import PageMover
from services.engine.kv_verify import ALGO as CHECKSUM_ALGO, page_checksums, verify_pages
from talaria import otel
from talaria.ewma import Ewma
from talaria.kv_layout import Family, Layout

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 32 * 1024 * 1024
COUNTERS = (
    "checkpoints", "checkpoint_pages", "checkpoint_bytes", "checkpoints_dropped",
    "restores", "restore_pages", "restore_bytes", "restores_declined", "store_failures",
    # CPU seconds the tier's two worker threads spent (copies, checksums, store RPCs, Mooncake): on a CPU
    # engine this is taken from the cores the executor's compute team runs on (thread CPU time, per job)
    "checkpoint_cpu_s", "restore_cpu_s",
    "restore_verify_failures", "restore_unverified_pages", "sessions_released", "released_pages",
    # write-back (kv/write_back.py): calls marked dirty, dirty chains dropped unwritten, write-backs by trigger
    "dirty_marked", "dirty_dropped", "write_backs_eviction", "write_backs_switch", "write_backs_slot_end", "write_backs_hint",
    "write_backs_residency", "write_backs_next_switch", "write_backs_flush", "switch_host_copies",
)


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
    release: list[list[int]] | None = None  # not a checkpoint but a session end (chains to release)
    gathered: threading.Event | None = None  # set once its pins are handed back (or the job ended)
    # the switch barrier's copy (``release_device``): the job's pages gathered into host memory by the executor
    # thread, so the device pages could go before the worker reached the job; ``owned``: the worker is copying
    # from the device pages itself (then nobody else may). Both under ``lock``.
    host_copy: torch.Tensor | None = None
    owned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)  # set when the job ended (committed, dropped or failed)


@dataclass(slots=True, eq=False)
class _Restore:
    """One restore in progress. Stages: ``lookup`` (worker) -> ``reserve`` (executor: the KV manager's
    pages) -> ``transfer`` (worker: ``_land``) -> ``publish`` (executor: ``_publish_restored``)."""

    seq: Any
    hashes: list[int]  # the prompt's full-page hashes
    base: int  # full pages on the device when the call arrived
    span: Any
    t_begin: float
    stage: str = "lookup"
    reply: Any = None  # the store's lookup reply (pinned)
    k: int = 0  # pages the store agreed to restore beyond ``base``
    res: RestoreReservation | None = None
    landed: int = 0  # pages whose bytes are in their device pages
    outcome: str = ""  # restore | recompute | miss | unavailable
    overhead_s: float = 0.0
    cancelled: bool = False
    after: tuple[threading.Event, ...] = ()  # the session's checkpoints still being written: the lookup waits for them
    cpu_s: float = 0.0  # thread CPU time the restore worker spent on it (lookup + transfer)
    cpu0: float = 0.0  # the worker's thread CPU time when its current stage started


class HostKV:
    """The host KV tier of one model: threads, store protocol and byte movement; every page decision goes
    through the KV manager of its ``KvPort`` (the tier holds no engine), the host-tier choices are the pure
    functions of ``kv/host_tier.py`` and ``kv/write_back.py``."""

    def __init__(
        self,
        port: KvPort,
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
        write_policy: str = "through",
        tracer: Tracer | None = None,
    ) -> None:
        if mode not in RESTORE_MODES:
            raise ValueError(f"mode must be auto, always or never, got {mode!r}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be back or through, got {write_policy!r}")
        self.write_policy = write_policy  # kv/write_back.py: copy when pages leave the device, or at once
        self.dirty = DirtySet()  # write-back: sessions pinned on the device, not in the store yet (executor thread)
        self._hints_seen = 0
        # a cold engine (cold/engine.py): True while another model has queued calls, i.e. this model's KV leaves the
        # device at the next switch and a session's return comes after it: write back as the call ends
        self.leaving_soon: Callable[[], bool] | None = None
        self.mode = mode  # "always"/"never" override the cost model (tests, benchmarks)
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self._port = port
        self.client = client
        self.owner = owner or port.model_id
        self.mover = PageMover(port, staging_bytes)  # pool pages <-> staging: the bytes, no decisions
        self.page_shape = port.page_shape
        self.page_bytes = self.mover.page_bytes
        rev = revision if revision is not None else weights_revision(port.model_dir)
        self.layout = Layout(
            f"{port.model_id}@{rev}", tp_rank, tp_size, port.page_size, str(port.dtype).removeprefix("torch."), Family.MHA,
            self.page_shape, self.page_bytes,
        )
        self.mooncake = mooncake or MooncakeEndpoint(data_host)
        staging_bytes = max(staging_bytes, self.page_bytes)
        for b in (self.mover.ckpt_buf, self.mover.restore_buf):
            self.mooncake.register(b.data_ptr(), b.numel())
        self.staging_pages = self.mover.staging_pages
        self.retry_after_s = retry_after_s
        self.restore_per_token = Ewma(restore_per_token_prior)
        self.restore_overhead = Ewma(0.0)
        self.prefill_prior = prefill_per_token_prior
        self.index = StoreIndex()  # what the current store epoch holds (the KV manager's HostIndex port)
        self._down_until = 0.0
        self._lock = threading.Lock()  # guards _down_until, counters, _samples
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._unpins: deque[list[int]] = deque()  # gathered: pins to return on the executor thread
        self._inflight = 0
        self._idle = threading.Condition()
        self._copying: list[_Job] = []  # queued checkpoint jobs not finished yet (guarded by _idle)
        self.release_copy_bytes = max(4 * staging_bytes, 64 << 20)  # the switch barrier's host copies, at most
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.last_decision: RestoreDecision | None = None
        # restores: a worker of their own (a slow store read never stalls the executor thread)
        self._restore_jobs: queue.Queue[_Restore | None] = queue.Queue()
        self._to_executor: deque[_Restore] = deque()  # jobs waiting for the executor thread (reserve / publish)
        self._restore_cv = threading.Condition()
        self._restoring: dict[str, _Restore] = {}  # request id -> job (executor thread only)
        self._ready: list = []  # sequences whose restore ended (executor thread only)
        self._samples: list[tuple[int, float]] = []
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"host-kv-{self.owner}", daemon=True)
        self._worker.start()
        self._restorer = threading.Thread(target=self._run_restores, name=f"host-kv-restore-{self.owner}", daemon=True)
        self._restorer.start()

    @property
    def channel(self):
        """The transfer scheduler restore copies go through (None: direct copies); ``PageMover.scatter``."""
        return self.mover.channel

    @channel.setter
    def channel(self, ch) -> None:
        self.mover.channel = ch

    @property
    def kv(self) -> KVManager:
        """The KV manager of the model's engine (the port's): the owner of every page this tier touches."""
        return self._port.kv

    def rebind(self, port: KvPort) -> None:
        """A rebuilt engine shell of the same model: move bytes to and from its pool, ask its KV manager. The
        store knowledge carries over. Call with nothing in flight (the switch barrier ran: no pins, no
        restores). Mutates: the port."""
        self.mover.rebind(port)  # refuses a pool of another layout
        if self._restoring or self._unpins or self.dirty:  # a switch barrier that timed out: as before, not fixed here
            log.warning("host KV tier of %s rebound with work in flight (%d restores, %d pin lists, %d dirty)",
                        self.owner, len(self._restoring), len(self._unpins), len(self.dirty))
        self._port = port

    def host_index(self) -> StoreIndex | None:
        """The KV manager's ``HostIndex`` port while the store is available (None while it is down)."""
        return self.index if not self._closed and self.available() else None

    @property
    def sessions(self):
        """Sessions checkpointed by this engine (``kv.host_tier.HostSessions``)."""
        return self.index.sessions

    @property
    def epoch(self) -> int:
        return self.index.epoch

    # ---------------------------------------------------------------- availability
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, err: Exception) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_after_s
            self.counters["store_failures"] += 1
        # whether it comes back as the same store is unknown: forget what it held (sessions read as
        # missing until a reply names an epoch again; restores always ask the store anyway)
        self.index.forget()
        log.warning("kvstore unavailable (%s: %s); recomputing for %.1fs", what, err, self.retry_after_s)

    def _saw_epoch(self, epoch: int) -> None:
        if self.index.saw_epoch(epoch):
            log.info("kvstore restarted (now epoch %d): forgetting what it held", epoch)

    # ---------------------------------------------------------------- checkpoint (executor thread)
    def checkpoint(self, seq) -> bool:
        """A session call ends (executor thread, before its pages are released into the caches): its full
        committed pages get a transfer pin. ``write_policy`` "through": their copy is queued now; "back": the
        session is marked dirty instead (``kv/write_back.py``; replacing, and unpinning, its previous dirty
        chain) and the copy waits until the pages are about to leave the device (``write_back``).
        Mutates: transfer pins, the job queue or the dirty set. Returns whether pages were pinned."""
        if not seq.session_id or self._closed or not self.available():
            return False
        kv = self.kv
        P = kv.page_size
        n = seq.num_computed_tokens // P
        if n == 0 or len(seq.pages) < n:
            return False
        hashes = kv.extend_hashes(seq.hashes, seq.token_ids[: n * P], seq.salt)[:n]
        if self.index.all_stored(hashes):
            self.index.committed(seq.session_id, hashes, n * P, self.epoch, time.time(), add=False)
            self._drop_dirty([seq.session_id], count=False)  # its dirty chain is a prefix of a stored one
            return False
        pages = list(seq.pages[:n])
        kv.pin_pages(pages)
        job = _Job(seq.session_id, pages, list(hashes), getattr(seq, "trace_context", None), time.time_ns())
        if write_now(self.write_policy, self.leaving_soon):
            self._drop_dirty([seq.session_id], count=False)  # superseded by this chain
            self._queue(job)
            if self.write_policy == "back":
                self.counters["write_backs_next_switch"] += 1
            return True
        old = self.dirty.mark(seq.session_id, job)
        if old is not None:
            kv.unpin_pages(old.pages)  # the new chain's pins (taken first) keep the pages both share
        self.counters["dirty_marked"] += 1
        return True

    def _queue(self, job: _Job) -> None:
        job.gathered = threading.Event()
        with self._idle:
            self._inflight += 1
            self._copying.append(job)
        self._jobs.put(job)

    # ---------------------------------------------------------------- write-back (executor thread)
    def write_back(self, session_ids=None, reason: str = "switch") -> list[_Job]:
        """Queue the copy of the dirty chains of ``session_ids`` (all when None); ``reason`` (eviction |
        switch | slot_end | hint | residency | next_switch | flush) names the counter. Mutates: the dirty set, the job queue."""
        jobs = self.dirty.take(session_ids)
        for job in jobs:
            job.queued_ns = time.time_ns()
            self._queue(job)
        if jobs:
            with self._lock:
                self.counters[f"write_backs_{reason}"] += len(jobs)
        return jobs

    def relieve_pressure(self, timeout: float = 10.0) -> int:
        """The KV manager's ``pressure_hook``: evicting every cache entry did not free enough pages. Writes back
        the dirty chains with a page only its pins still hold (evicted from the caches; pages a running call
        holds stay pinned), waits until their pages are gathered into staging, then returns every pin of a
        finished gather. Mutates: the dirty set, transfer pins. Returns pages freed."""
        orphaned = orphaned_sessions(self.dirty, self.kv.only_pinned)
        deadline = time.monotonic() + timeout
        for job in self.write_back(orphaned, "eviction"):
            job.gathered.wait(max(0.0, deadline - time.monotonic()))
        return self._return_pins()

    def _return_pins(self) -> int:
        freed = 0
        while self._unpins:
            freed += self.kv.unpin_pages(self._unpins.popleft())
        return freed

    def _drop_dirty(self, session_ids, count: bool = True) -> None:
        for job in self.dirty.take(session_ids):
            self.kv.unpin_pages(job.pages)
            if count:
                self.counters["dirty_dropped"] += 1

    def _hinted_write_backs(self) -> None:
        """A dirty session whose retention hint expects its return after the lease window
        (``RetentionBook.value`` -1) is written back at once (it may leave the device). Checked when new
        hints arrived."""
        if not self.dirty:  # every step: the common case (write-through, or nothing dirty) costs one len()
            return
        book = self.kv.retention
        if book is None or book.counters["hints"] == self._hints_seen:
            return
        self._hints_seen = book.counters["hints"]
        late = late_sessions(self.dirty, book, time.time())
        if late:
            self.write_back(late, "hint")

    def poll(self) -> int:
        """Executor thread, at each step start: return the transfer pins of completed device->host gathers,
        reserve pages for restores the store agreed to, publish restores whose pages landed (their
        sequences then come from ``take_ready``). Returns pages freed by unpinning."""
        freed = self._return_pins()
        self._hinted_write_backs()
        self._service_restores()
        return freed

    def drain(self, timeout: float | None = None) -> bool:
        """Switch barrier: write back every dirty session, wait for every queued checkpoint to finish (or be
        abandoned), then return pins.

        Call on the executor thread (or holding its step lock). Returns False on timeout."""
        self.write_back(None, "switch")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
            done = self._inflight == 0
        return self._end_restores(deadline) and done

    def _end_restores(self, deadline: float | None) -> bool:
        """The barriers' last part: return the pins of finished gathers, then wait until every restore has
        ended (restores write into the region too: they end, published, before it goes). Executor thread.
        Returns False if ``deadline`` (monotonic) passed first."""
        self.poll()
        while self._restoring:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.wait_restore(0.05 if left is None else min(left, 0.05))
            self.poll()
        return True

    def release_device(self, timeout: float | None = None) -> bool:
        """The switch barrier (Talaria Appendix B): the outgoing model's KV region may be released once no
        checkpoint still reads its pages -- not once the store has them. Writes back every dirty session; a
        job the worker has not started is copied into host memory here, at once (the worker later writes that
        copy to the store and commits it); a job the worker is copying from the device is waited for until its
        pages are gathered; then the pins go and every restore ends (they write into the region too). The
        store writes and commits go on after the switch, so a barrier costs the device->host copies, not the
        network: before, it waited for each dirty session's Reserve, Mooncake write and Commit in turn (~10 ms
        a session on the CPU bench, the switches' whole ``save_teardown``). Until its commit a session reads
        as not in the store (``StoreIndex``, the router's view): nothing reads a partial chain; a return to
        this instance meanwhile waits for the commit on the restore worker (``begin_restore``), then restores.
        Host copies beyond ``release_copy_bytes`` are not made: those jobs are waited for, as ``drain``.

        Call on the executor thread (or holding its step lock). Mutates: the dirty set, queued jobs (their
        host copies), transfer pins. Returns False on timeout."""
        self.write_back(None, "switch")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            jobs = list(self._copying)
        budget = self.release_copy_bytes
        for job in jobs:
            with job.lock:
                if job.owned or job.host_copy is not None or not job.pages or job.gathered.is_set():
                    continue
                need = len(job.pages) * self.page_bytes
                if need > budget:
                    continue
                budget -= need
                copy = self.mover.host_pages(len(job.pages))
                self.mover.gather(job.pages, copy)
                job.host_copy = copy
                pins, job.pages = job.pages, []
                self.kv.unpin_pages(pins)
                self.counters["switch_host_copies"] += 1
                job.gathered.set()
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.gathered.wait(left):
                return False
        return self._end_restores(deadline)

    @property
    def outstanding(self) -> int:
        return self._inflight

    def _run(self) -> None:
        set_thread_count(1)  # one OpenMP pool per process: the executor's (intra_op.py)
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
                cpu0 = time.thread_time()
                with self.tracer.start_as_current_span("talaria.engine.kv_checkpoint", context=job.trace_context, attributes=attrs) as span:
                    try:
                        self._checkpoint(job)
                    finally:
                        cpu = time.thread_time() - cpu0
                        span.set_attribute("talaria.kv.cpu_seconds", cpu)
                        with self._lock:
                            self.counters["checkpoint_cpu_s"] += cpu
            except Exception as e:  # noqa: BLE001 - a failing checkpoint must never stop the worker
                log.exception("checkpoint of session %s failed", job.session_id)
                self._failed("checkpoint", e)
            finally:
                if job.pages:  # not handed back yet (failure before the gather)
                    self._unpins.append(job.pages)
                if job.gathered is not None:
                    job.gathered.set()
                job.host_copy = None
                with self._idle:
                    self._inflight -= 1
                    if job in self._copying:
                        self._copying.remove(job)
                    self._idle.notify_all()
                job.done.set()

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
        with job.lock:  # the switch barrier may have copied the pages off the device already (release_device)
            copy = job.host_copy
            job.owned = copy is None
        try:
            for i in range(0, len(blocks), self.staging_pages):
                part = blocks[i : i + self.staging_pages]
                if copy is None:
                    self.mover.gather([job.pages[b.page_index] for b in part])
                else:
                    self.mover.stage_from_host(copy, [b.page_index for b in part])
                sums += page_checksums(self.mover.ckpt_buf.numpy(), self.page_bytes, len(part))  # of the bytes written
                if i + self.staging_pages >= len(blocks) and copy is None:
                    pins, job.pages = job.pages, []
                    self._unpins.append(pins)  # device->host copies done: the pages may go
                    if job.gathered is not None:
                        job.gathered.set()
                write_pages(self.mooncake, r.data_plane, part, self.mover.ckpt_buf.data_ptr(), self.page_bytes)
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
        self.index.committed(job.session_id, job.hashes, len(job.hashes) * self._port.page_size, r.epoch, time.time())
        with self._lock:
            c = self.counters
            c["checkpoints"] += 1
            c["checkpoint_pages"] += len(written)
            c["checkpoint_bytes"] += len(written) * self.page_bytes

    # ---------------------------------------------------------------- restore: executor thread
    def begin_restore(self, seq) -> bool:
        """A call arrives: when the store may hold more of its prompt than the device caches (the KV
        manager's ``match_prefix`` with this tier's ``StoreIndex``), start a restore off the executor thread.

        Returns True when the tier now holds ``seq``: it comes back from ``take_ready()`` once its pages are
        in (or the restore was declined or failed: then it recomputes). Mutates: the restore table."""
        if self._closed or self.mode == "never" or not self.available():
            return False
        kv = self.kv
        n_full = len(seq.token_ids) // kv.page_size
        if n_full == 0:
            return False
        kv.extend_hashes(seq.hashes, seq.token_ids, seq.salt)
        m = kv.match_prefix(seq.token_ids, seq.hashes, seq.session_id, host=self.index)
        # the session's checkpoints the switch barrier let go before their commit (``release_device``): its
        # return waits for them off the executor thread, then restores what they committed
        with self._idle:
            after = tuple(j.done for j in self._copying if seq.session_id and j.session_id == seq.session_id and len(j.hashes) > m.device_pages)
        if m.host_pages == 0 and not after:
            return False
        attrs: dict[str, Any] = {"talaria.kv.device_pages": m.device_pages, "talaria.kv.prompt_pages": n_full}
        if seq.session_id:
            attrs[otel.SESSION_ID] = seq.session_id
        span = self.tracer.start_span("talaria.engine.kv_restore", context=getattr(seq, "trace_context", None), attributes=attrs)
        job = _Restore(seq, list(seq.hashes[:n_full]), m.device_pages, span, time.perf_counter(), after=after)
        self._restoring[seq.request_id] = job
        self._restore_jobs.put(job)
        return True

    def restore_blocking(self, seq, timeout: float = 120.0) -> int:
        """Run one restore of ``seq`` (never scheduled) to its end, pumping ``poll`` on the calling thread,
        which must be the executor thread or hold the engine idle. For benches that time the restore alone
        (``bench kvstore``). Returns pages restored; their radix path is released (they stay cached)."""
        if not self.begin_restore(seq):
            return 0
        deadline = time.monotonic() + timeout
        while seq.request_id in self._restoring:
            if time.monotonic() > deadline:
                raise TimeoutError(f"restore of {seq.request_id} did not end within {timeout}s")
            self.wait_restore(0.01)
            self.poll()
        self._ready.remove(seq)
        if seq.kv_hold:
            self.kv.release_hold(seq.kv_hold)
            seq.kv_hold = []
        return seq.num_restored_tokens // self.kv.page_size

    def cancel_restore(self, request_id: str) -> bool:
        """The call ended while its restore runs (abort): the restore completes (its pages are published,
        they hold valid KV) but the call is not handed back. Returns whether it was restoring."""
        job = self._restoring.get(request_id)
        if job is None:
            return False
        job.cancelled = True
        return True

    @property
    def num_restoring(self) -> int:
        return len(self._restoring)

    def restoring_sequences(self) -> list:
        """Sequences whose restore is in progress (executor thread)."""
        return [j.seq for j in self._restoring.values() if not j.cancelled]

    def take_ready(self) -> list:
        """Sequences whose restore ended since the last call, in arrival order (executor thread)."""
        out, self._ready = self._ready, []
        return out

    def take_restore_samples(self) -> list[tuple[int, float]]:
        """``(tokens, transfer seconds)`` of each real restore since the last call (for the slot cost model)."""
        with self._lock:
            out, self._samples = self._samples, []
        return out

    def wait_restore(self, timeout: float) -> None:
        """Block until a restore needs the executor thread (or ``timeout``): an otherwise idle step waits
        here instead of spinning."""
        with self._restore_cv:
            if not self._to_executor:
                self._restore_cv.wait(timeout)

    def _service_restores(self) -> None:
        """Executor thread: reserve pages for restores the store agreed to, publish the ones that landed."""
        while True:
            with self._restore_cv:
                if not self._to_executor:
                    return
                job = self._to_executor.popleft()
            if job.stage == "reserve":
                seq = job.seq
                # the device prefix may have changed since the lookup: reserve against what the store agreed to
                job.res = self.kv.reserve_restore(seq.token_ids, job.hashes[: job.reply.pages], seq.session_id, job.k)
                job.stage = "transfer"
                self._restore_jobs.put(job)
            else:
                self._publish_restored(job)

    def _publish_restored(self, job: _Restore) -> None:
        """THE point where restored pages become visible (executor thread): their bytes have landed in the
        reserved device pages (``_land``, restore worker); the radix cache now adopts them, so the
        scheduler sees an ordinary prefix hit. A verification of the landed bytes goes here, before
        ``adopt_restore``. Mutates: KV manager (reservation, radix cache), the sequence, counters."""
        kv, seq = self.kv, job.seq
        del self._restoring[seq.request_id]
        if job.res is not None:
            if job.landed:
                seq.kv_hold = kv.adopt_restore(job.res, job.landed)
            else:
                kv.cancel_restore(job.res)
        k, P = job.landed, kv.page_size
        seq.num_restored_tokens = k * P
        job.span.set_attributes({
            "talaria.kv.restored_pages": k, "talaria.kv.tokens": k * P, "talaria.kv.bytes": k * self.page_bytes,
            "talaria.kv.seconds": time.perf_counter() - job.t_begin, "talaria.kv.decision": job.outcome,
            "talaria.kv.cpu_seconds": job.cpu_s,
        })
        with self._lock:
            self.counters["restore_cpu_s"] += job.cpu_s
        job.span.end()
        if job.cancelled:
            if seq.kv_hold:
                kv.release_hold(seq.kv_hold)
                seq.kv_hold = []
        else:
            self._ready.append(seq)

    # ---------------------------------------------------------------- restore: worker thread
    def _run_restores(self) -> None:
        set_thread_count(1)  # one OpenMP pool per process: the executor's (intra_op.py)
        while True:
            job = self._restore_jobs.get()
            if job is None:
                return
            job.cpu0 = time.thread_time()
            try:
                with trace.use_span(job.span, end_on_exit=False):
                    if job.stage == "lookup":
                        self._lookup(job)
                    else:
                        self._land(job)
            except Exception as e:  # noqa: BLE001 - a failing restore must never stop the worker
                log.exception("restore of %s failed", job.seq.request_id)
                self._failed("restore", e)
                job.landed, job.outcome = 0, "unavailable"
                self._post(job, "publish")

    def _post(self, job: _Restore, stage: str) -> None:
        """Restore worker: hand ``job`` to the executor thread for ``stage`` (its CPU time so far counted first:
        the executor may publish it at once)."""
        job.cpu_s += time.thread_time() - job.cpu0
        job.stage = stage
        with self._restore_cv:
            self._to_executor.append(job)
            self._restore_cv.notify_all()

    def _lookup(self, job: _Restore) -> None:
        """Ask the store for the agreed prefix (pinned) and decide restore-or-recompute from measured costs."""
        span, P = job.span, self._port.page_size
        for ev in job.after:  # the session's own checkpoints still in flight (bounded: a dead store fails them)
            ev.wait(30.0)
        t0 = time.perf_counter()
        if self._closed or not self.available():
            job.outcome = "unavailable"
            return self._post(job, "publish")
        try:
            reply = self.client.lookup(self.layout, job.hashes, pin=True)
        except (StoreUnavailable, ValueError) as e:
            span.set_attribute(otel.ERROR_TYPE, "store_unavailable")
            self._failed("lookup", e)
            job.outcome = "unavailable"
            return self._post(job, "publish")
        job.overhead_s = time.perf_counter() - t0
        self._saw_epoch(reply.epoch)
        job.reply = reply
        span.set_attribute("talaria.kv.store_pages", reply.pages)
        if reply.pages <= job.base:
            self._unpin(reply.lease_id, False)
            job.outcome = "miss"  # the store has no more than the device
            return self._post(job, "publish")
        decision = self._decide((reply.pages - job.base) * P)
        span.set_attributes({
            "talaria.kv.estimate.restore_seconds": decision.restore_s, "talaria.kv.estimate.recompute_seconds": decision.recompute_s,
            "talaria.kv.decision_reason": decision.reason,
        })
        if not decision.restore:
            with self._lock:
                self.counters["restores_declined"] += 1
            self._unpin(reply.lease_id, False)
            job.outcome = "recompute"
            return self._post(job, "publish")
        job.k = reply.pages - job.base
        self._post(job, "reserve")

    def _decide(self, tokens: int) -> RestoreDecision:
        prefill = self._port.prefill_per_token() or self.prefill_prior
        decision = decide_restore(
            tokens, restore_per_token=self.restore_per_token.value, prefill_per_token=prefill, overhead_s=self.restore_overhead.value,
            mode=self.mode,
        )
        self.last_decision = decision
        return decision

    def _land(self, job: _Restore) -> None:
        """Read the reserved pages from the store over Mooncake into staging and scatter them into their
        device pages (pages nobody else reads: the reservation holds them). Then hand the job back for
        ``_publish_restored``."""
        reply, res, P = job.reply, job.res, self._port.page_size
        if res is None or self._closed:
            self._unpin(reply.lease_id, False)
            job.outcome = "recompute"  # no device pages for it
            return self._post(job, "publish")
        pages = list(res.pages)
        k = len(pages)
        base = len(res.chain)
        blocks = list(reply.blocks[base : base + k])
        assert len(blocks) == k, f"reservation of {k} pages beyond {base} but the store agreed to {reply.pages}"
        t1 = time.perf_counter()
        landed = read = 0
        try:
            for i in range(0, k, self.staging_pages):
                part = blocks[i : i + self.staging_pages]
                read_pages(self.mooncake, reply.data_plane, part, self.mover.restore_buf.data_ptr(), self.page_bytes)
                read += len(part)
                good = self._verify(part)  # before the pages are published
                self.mover.scatter(pages[i : i + good])
                landed += good
                if good < len(part):  # the rest is recomputed: never published (adopt_restore drops it)
                    break
        except StoreUnavailable as e:
            job.span.set_attribute(otel.ERROR_TYPE, "store_unavailable")
            self._failed("restore transfer", e)
            job.outcome = "unavailable"
            return self._post(job, "publish")
        t2 = time.perf_counter()
        if landed == 0:
            self._unpin(reply.lease_id, False)
            job.landed, job.outcome = 0, "verify_failed"
            return self._post(job, "publish")
        self._unpin(reply.lease_id, True)
        job.span.set_attribute("talaria.kv.transfer_seconds", t2 - t1)
        self.restore_per_token.add((t2 - t1) / (read * P))
        self.restore_overhead.add(job.overhead_s + (time.perf_counter() - t2))
        with self._lock:
            c = self.counters
            c["restores"] += 1
            c["restore_pages"] += landed
            c["restore_bytes"] += landed * self.page_bytes
            self._samples.append((read * P, t2 - t1))
        job.landed, job.outcome = landed, "restore"
        self._post(job, "publish")

    def _verify(self, part) -> int:
        """Check the received pages of ``part`` (in the restore staging buffer) against the store's
        checksums. Returns the verified prefix length; a mismatch is counted, and the bad page's chain (it and
        everything extending it) is released in the store so it is never served again."""
        good, unverified = verify_pages(self.mover.restore_buf.numpy(), self.page_bytes, part)
        with self._lock:
            self.counters["restore_unverified_pages"] += unverified
            if good < len(part):
                self.counters["restore_verify_failures"] += 1
        if good < len(part):
            trace.get_current_span().set_attribute("talaria.kv.verify_failed_page", part[good].page_index)
            log.warning("restored page %d failed its checksum: recomputing from there", part[good].page_index)
            try:
                self.client.release(self.layout.model, self.layout.tp_rank, [part[good].prefix_hash])
            except (StoreUnavailable, ValueError) as e:
                self._failed("release", e)
            self.index.discard([part[good].prefix_hash])
        return good

    # ---------------------------------------------------------------- session end
    def release_session(self, session_id: str, chains: list[list[int]]) -> None:
        """Queue the release of an ended session's chains (newest first) in the store, after its queued
        checkpoints, on the worker: the pages nothing else extends are dropped (``Release`` with
        ``leaves_only``, one RPC per chain). Its dirty chain (write-back) is dropped unwritten and unpinned:
        call on the executor thread or holding its step lock.
        The session is forgotten now (for the next snapshot) and again after its queued checkpoints."""
        with self._lock:
            self.sessions.drop(session_id)
        self._drop_dirty([session_id])  # never written: nothing will ask for it
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
        for chain in job.release:  # unsure which pages stayed (shared): a later checkpoint asks the store
            self.index.discard(chain)
        with self._lock:
            self.counters["sessions_released"] += 1
            self.counters["released_pages"] += released


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
        sessions = [
            {"session_id": s.session_id, "committed_tokens": s.tokens, "last_use_unix": s.last_use_unix, "state": state}
            for s, state in self.index.states(available)
        ]
        with self._lock:
            return {
                "available": available,
                "epoch": self.epoch,
                "restore_per_token": self.restore_per_token.value,
                "restore_overhead_s": self.restore_overhead.value,
                "outstanding_checkpoints": self._inflight,
                "write_policy": self.write_policy,
                "dirty_sessions": len(self.dirty),
                "dirty_pages": self.dirty.num_pages,
                "sessions": sessions,
                **self.counters,
            }

    def session_infos(self, model: str) -> list[Residency]:
        """Sessions this engine checkpointed: ``HOST`` (restorable) or ``MISSING`` (any thread)."""
        return host_residencies(self.index, self.available(), model)

    def close(self) -> None:
        """Stop the workers. Dirty chains are dropped unwritten (their pins returned): call on the executor
        thread or holding its step lock, after the switch barrier when the model leaves the device."""
        if self._closed:
            return
        self._drop_dirty(None, count=False)
        self._closed = True
        self._jobs.put(None)
        self._restore_jobs.put(None)
        self._worker.join(timeout=10)
        self._restorer.join(timeout=10)
        for b in (self.mover.ckpt_buf, self.mover.restore_buf):
            self.mooncake.unregister(b.data_ptr())
