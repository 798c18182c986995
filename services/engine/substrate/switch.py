"""The memory substrate (arena + weight bank + staging) and the five-phase switch protocol (Talaria App. D).

Phases of a switch from ``m`` to ``m'``, each timed into a :class:`SwitchRecord`:

1. save/teardown — run the switch barriers (``before_kv_release`` callables: drain outstanding
   device→host KV checkpoints of ``m``), then release ``m``'s KV region (its caches are emptied;
   the region is about to be reused) and detach it from staging.
2. open target weights — wait for in-flight staging writes, move the weights bump pointer for ``m'``, copy
   every chunk of ``m'``: CLEAN staged chunks device-to-device, dirty or missing ones from the bank.
3. restore the KV shell — reuse ``m'``'s cached KV views / page manager if the KV base address and page
   count are unchanged, else rebuild them.
4. restore runtime state — reuse ``m'``'s cached parameter views and runtime buffers (on CUDA: graphs and
   attention workspace) if the weights/runtime base addresses are unchanged, else rebind/rebuild.
5. publish — make ``m'`` the active model (allocator hooks, scheduler references, telemetry).

The substrate owns memory and copies; the runtime objects of phases 1, 3–5 belong to the caller
(the cold engine) and are reached through :class:`RuntimeHooks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from services.engine.model.batch import KVCache
from talaria.switch_path import SwitchPath

from .arena import Arena, ArenaBudgetError, Layout, align_up
from .bank import BankEntry, WeightBank
from .copier import Copier
from .policy import classify_path, plan_staging
from .staging import ChunkState, KVGeometry, StagingArea, StagingAwareAllocator, start_copy_fn

PHASES = ("save_teardown", "open_weights", "restore_kv_shell", "restore_runtime", "publish")


@dataclass(frozen=True, slots=True)
class SwitchRecord:
    seq: int
    from_model: str
    to_model: str
    reason: str
    path: SwitchPath
    started_unix: float
    total_seconds: float
    phase_seconds: tuple[float, float, float, float, float]  # in PHASES order
    weight_bytes: int
    staged_bytes: int  # moved device-to-device from clean staged chunks
    host_bytes: int  # moved host-to-device from the bank
    dirty_bytes: int  # staged bytes of the target found dirty at the switch
    d2d_seconds: float
    h2d_seconds: float
    kv_shell_reused: bool
    runtime_reused: bool

    def to_dict(self) -> dict:
        d = asdict(self)
        d["phases"] = dict(zip(PHASES, self.phase_seconds))
        return d


@dataclass(frozen=True, slots=True)
class OpenResult:
    path: SwitchPath
    staged_bytes: int
    host_bytes: int
    dirty_bytes: int
    d2d_seconds: float
    h2d_seconds: float
    d2d_chunks: tuple[int, ...] = ()


class RuntimeHooks(Protocol):
    def save_teardown(self, model: str) -> None: ...
    def restore_kv_shell(self, model: str) -> bool: ...
    def restore_runtime(self, model: str) -> bool: ...
    def publish(self, model: str) -> None: ...


def kv_page_bytes(entry: BankEntry, page_size: int) -> int:
    c = entry.config
    return 2 * c.num_hidden_layers * page_size * c.num_key_value_heads * c.head_dim * entry.dtype.itemsize


class MemorySubstrate:
    """Arena + bank + staging area + copier of one instance (mechanism only; policies choose targets)."""

    def __init__(
        self,
        arena: Arena,
        bank: WeightBank,
        *,
        page_size: int,
        copier: Copier | None = None,
        staging: bool = True,
        staging_max_fraction: float = 1.0,
    ) -> None:
        self.arena = arena
        self.bank = bank
        self.page_size = page_size
        self.copier = copier or Copier(arena.device)
        self.staging_enabled = staging
        self.staging_max_fraction = staging_max_fraction
        self.area: StagingArea | None = None
        self.allocator: StagingAwareAllocator | None = None  # of the active model
        # partial_layers: streams a model's later layer groups after phase 2 instead of copying
        # them in it (``streaming_swap.HotSwapStreamer``: first_streamed_chunk(model) / start(model, chunks))
        self.streamer = None

    # ------------------------------------------------------------------ layout
    def layout_for(self, model: str) -> tuple[Layout, KVGeometry]:
        """The arena layout and KV geometry ``model`` gets when active. Raises ArenaBudgetError."""
        e = self.bank[model]
        lay = self.arena.plan(model, e.nbytes)
        pb = kv_page_bytes(e, self.page_size)
        num_pages = lay.kv_bytes // pb
        if num_pages < 1:
            raise ArenaBudgetError(model, align_up(e.nbytes) + pb + self.arena.runtime_bytes, self.arena.capacity, "weights + one KV page + runtime")
        c = e.config
        seg = self.page_size * c.num_key_value_heads * c.head_dim * e.dtype.itemsize
        return lay, KVGeometry(lay.kv_start, num_pages, 2 * c.num_hidden_layers, seg)

    def kv_cache(self, model: str) -> KVCache:
        """KV views of the active ``model`` (``[2, L, pages*P, kvh, hd]`` at the KV region start)."""
        e = self.bank[model]
        c = e.config
        _, g = self.layout_for(model)
        pool = self.arena.view(g.kv_start, (2, c.num_hidden_layers, g.num_pages * self.page_size, c.num_key_value_heads, c.head_dim), e.dtype)
        return KVCache(k=[pool[0, l] for l in range(c.num_hidden_layers)], v=[pool[1, l] for l in range(c.num_hidden_layers)], page_size=self.page_size)

    def weights(self, model: str) -> torch.Tensor:
        return self.arena.bytes(0, self.bank[model].nbytes)

    # ------------------------------------------------------------------ staging (while another model serves)
    def attach(self, model: str, allocator: StagingAwareAllocator) -> None:
        """``model`` is now active with ``allocator``: open a fresh staging area over its KV tail."""
        _, g = self.layout_for(model)
        self.area = StagingArea(g, self.bank.chunk_bytes, max_fraction=self.staging_max_fraction) if self.staging_enabled else None
        self.allocator = allocator
        allocator.area = self.area

    def detach(self) -> None:
        if self.allocator is not None:
            self.allocator.area = None
        self.allocator = None

    def stage(self, target: str, budget: int) -> int:
        """Start staging up to ``budget`` chunks of ``target`` (lowest first). Returns chunks started."""
        a, alloc = self.area, self.allocator
        if a is None or alloc is None or target not in self.bank or budget <= 0:
            return 0
        a.poll()
        if any(c.model != target for c in a.chunks.values()):
            a.discard(keep_model=target)
        e = self.bank[target]
        staged = {i for (m, i), c in a.by_index.items() if m == target and c.state is not ChunkState.DIRTY}
        if len(staged) >= e.num_chunks:
            return 0  # staged whole: no slot scan (this runs every step)
        slots = a.free_slots(alloc.is_used, align_up(e.nbytes), limit=min(budget, e.num_chunks - len(staged)))
        todo = plan_staging(e.num_chunks, staged, len(slots), budget)
        for j, s in zip(todo, slots):
            a.stage(target, j, s, e.chunk_range(j)[1] - e.chunk_range(j)[0], start_copy_fn(self.copier, self.arena.bytes, e.chunk(j)))
        return len(todo)

    def stage_plan(self, targets: dict[str, list[int]], budget: int) -> int:
        """Carry out a residency plan's weight part: staged chunks not in ``targets`` (model ->
        chunk indices to keep staged, in priority order) are released, missing ones are staged, at most
        ``budget`` new chunks per call. Returns chunks started."""
        a, alloc = self.area, self.allocator
        if a is None or alloc is None:
            return 0
        a.poll()
        keep = {(m, j) for m, js in targets.items() if m in self.bank for j in js}
        if any((c.model, c.index) not in keep for c in a.chunks.values()):
            a.discard_keys(keep)
        started = 0
        for m, js in targets.items():
            if m not in self.bank or started >= budget:
                continue
            e = self.bank[m]
            have = {i for (mm, i), c in a.by_index.items() if mm == m and c.state is not ChunkState.DIRTY}
            todo = [j for j in js if j not in have][: budget - started]
            if not todo:
                continue
            slots = a.free_slots(alloc.is_used, align_up(e.nbytes), limit=len(todo))
            for j, s in zip(todo, slots):
                a.stage(m, j, s, e.chunk_range(j)[1] - e.chunk_range(j)[0], start_copy_fn(self.copier, self.arena.bytes, e.chunk(j)))
                started += 1
        return started

    def staging_pending(self, target: str | None) -> bool:
        """Work left for the stager: writes in flight, or chunks of ``target`` not staged with room to."""
        a, alloc = self.area, self.allocator
        if a is None or alloc is None:
            return False
        if any(c.state is ChunkState.WRITING for c in a.chunks.values()):
            return True
        if target is None or target not in self.bank:
            return False
        e = self.bank[target]
        staged = {i for (m, i), c in a.by_index.items() if m == target and c.state is not ChunkState.DIRTY}
        return len(staged) < e.num_chunks and bool(a.free_slots(alloc.is_used, align_up(e.nbytes), limit=1))

    def staged_fraction(self, model: str) -> float:
        if self.area is None or model not in self.bank:
            return 0.0
        a = self.area
        a.poll()
        clean = a.clean(model)
        return len(clean) / max(self.bank[model].num_chunks, 1)

    def staged_models(self) -> set[str]:
        return self.area.staged_models() if self.area is not None else set()

    def slack_bytes(self) -> int:
        if self.area is None or self.allocator is None:
            return 0
        return self.area.slack_bytes(self.allocator.is_used)

    # ------------------------------------------------------------------ phase 2
    def open_weights(self, target: str) -> OpenResult:
        """Copy ``target``'s weights into the arena's weights region: clean staged chunks D2D, the rest
        from the bank. The outgoing model's KV region must already be released."""
        e = self.bank[target]
        a = self.area
        clean: dict = {}
        dirty = 0
        if a is not None:
            a.poll(wait=True)  # wait for outstanding pre-staging writes
            clean = a.clean(target)
            dirty = sum(c.nbytes for (m, _), c in a.by_index.items() if m == target and c.state is ChunkState.DIRTY)
        self.detach()
        self.area = None
        self.arena.set_weights(target, e.nbytes)  # may raise ArenaBudgetError: nothing was changed yet
        wend = align_up(e.nbytes)
        d2d = [j for j, c in clean.items() if c.addr >= wend and c.addr + c.nbytes <= self.arena.runtime_start]
        d2d_set = set(d2d)
        arena = self.arena
        t0 = time.perf_counter()
        for j in d2d:
            lo, hi = e.chunk_range(j)
            c = clean[j]
            self.copier.copy(arena.bytes(lo, hi), arena.bytes(c.addr, c.addr + (hi - lo)))
        self.copier.barrier()
        t1 = time.perf_counter()
        host = 0
        first_streamed = self.streamer.first_streamed_chunk(target) if self.streamer is not None else None
        later: list[int] = []
        for j in range(e.num_chunks):
            if j in d2d_set:
                continue
            if first_streamed is not None and j >= first_streamed:
                later.append(j)  # copied host-to-device after publish, while prefill runs on the groups before it
                host += e.chunk_range(j)[1] - e.chunk_range(j)[0]  # counted (staged + host = weights); not in h2d_seconds
                continue
            lo, hi = e.chunk_range(j)
            self.copier.copy(arena.bytes(lo, hi), e.chunk(j), from_host=True)
            host += hi - lo
        self.copier.barrier()
        if first_streamed is not None:
            self.streamer.start(target, later)
        t2 = time.perf_counter()
        staged = sum(e.chunk_range(j)[1] - e.chunk_range(j)[0] for j in d2d)
        return OpenResult(classify_path(e.num_chunks, len(d2d)), staged, host, dirty, t1 - t0, t2 - t1, tuple(sorted(d2d)))


class SwitchProtocol:
    """Runs the five phases and produces one :class:`SwitchRecord` per switch."""

    def __init__(self, substrate: MemorySubstrate, hooks: RuntimeHooks, *, before_kv_release: Iterable[Callable[[str], None]] = (), wall: Callable[[], float] = time.time) -> None:
        self.substrate = substrate
        self.hooks = hooks
        self.before_kv_release: list[Callable[[str], None]] = list(before_kv_release)
        self.wall = wall
        self.seq = 0

    def run(self, from_model: str | None, to_model: str, reason: str = "") -> SwitchRecord:
        started = self.wall()
        t = [time.perf_counter()]
        # 1. save / teardown
        if from_model is not None:
            for barrier in self.before_kv_release:
                barrier(from_model)
            self.hooks.save_teardown(from_model)
        t.append(time.perf_counter())
        # 2. open target weights
        res = self.substrate.open_weights(to_model)
        t.append(time.perf_counter())
        # 3. KV shell
        kv_reused = self.hooks.restore_kv_shell(to_model)
        t.append(time.perf_counter())
        # 4. runtime state
        rt_reused = self.hooks.restore_runtime(to_model)
        t.append(time.perf_counter())
        # 5. publish
        self.hooks.publish(to_model)
        t.append(time.perf_counter())
        self.seq += 1
        phases = tuple(t[i + 1] - t[i] for i in range(5))
        return SwitchRecord(
            self.seq, from_model or "", to_model, reason, res.path, started, t[-1] - t[0], phases,  # type: ignore[arg-type]
            self.substrate.bank[to_model].nbytes, res.staged_bytes, res.host_bytes, res.dirty_bytes,
            res.d2d_seconds, res.h2d_seconds, kv_reused, rt_reused,
        )


@dataclass(slots=True)
class ShellAddresses:
    """Base addresses cached runtime state points into (the stable-address check, Talaria §4.2)."""

    weights: int
    kv: int
    runtime: int
    num_pages: int
    extra: dict = field(default_factory=dict)
