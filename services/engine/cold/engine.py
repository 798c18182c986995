"""Cold-pool executor: several catalog models on one device, one active at a time (Talaria §3.5, §4.2, §4.4).

Each model gets a *shell*: an ordinary :class:`~services.engine.executor.Engine` (scheduler, KV manager,
sampler, detokenizer — nothing duplicated) whose parameters are views into the arena's weights region and
whose KV pool is a view of the arena's KV region, with a staging-aware page allocator. Shells are cached
across switches and reused when the stable-address check passes (``MemorySubstrate``/``SwitchProtocol``
in ``substrate/switch.py`` do the memory work and time the five phases).

Calls for every loaded model are accepted at any time and wait in per-model queues (``queues.ModelQueues``;
they hold no pages) until the switch policy admits them to their model's shell. At each ``step()``:

1. intake (new calls, aborts) is drained;
2. the switch policy's turn (``policy.SwitchPolicy``, a part the engine is composed with: the idle switch
   rule, ``policy.IdleSwitching``, or the slot scheduler of ``slots/``, ``slotted.SlotSwitching``) may switch
   to another model -- only away from a model with no work, so a switch never interrupts a running sequence --
   and says which queued calls join the active shell (a typed ``policy.Turn``);
3. one step of the active shell;
4. opportunistic staging of the predicted next model into the KV tail (``predict_next``), a few chunks
   per step, while the active model serves.

Thread model as in ``Engine``: ``add_request``/``abort``/``stats``/``open_model``-requests are safe from
any thread; ``step`` (and therefore every switch) runs on the executor thread only.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from services.engine.api import CostStats, EngineStats, KvLocation, ModelStats, SessionInfo
from services.engine.api import ModelBusyError, ModelInfo, UnknownModelError
from services.engine.cold.policy import IdleSwitching, SwitchPolicy, Turn
from services.engine.cold.queues import ModelQueues
from services.engine.executor import DEFAULT_KV_CACHE_BYTES, Engine, run_to_completion, validate_request
from services.engine.model_runner import ModelRunner
from services.engine.settings import EngineSettings
from services.engine.kv.port import KvPort
from services.engine.substrate.arena import Arena, align_up
from services.engine.substrate.bank import DEFAULT_CHUNK_BYTES, WeightBank, bind_model
from services.engine.substrate.copier import Copier, WeightLink
from services.engine.substrate.policy import EngineView, predict_next
from talaria.switch_path import SwitchCostModel, SwitchPath
from services.engine.substrate.staging import StagingAwareAllocator
from services.engine.substrate.switch import MemorySubstrate, ShellAddresses, SwitchProtocol, SwitchRecord
from talaria.tokenizer import Tokenizer
from services.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams, Usage
from talaria.attribution import Phase, PhaseClock, attribution_clock, enter_all, phase_start

log = logging.getLogger(__name__)

GAUGE_PERIOD_S = 0.1  # the staging slack gauge is rescanned at most this often (heartbeats are 0.25 s and slower)


@dataclass(slots=True)
class _Shell:
    engine: Engine
    addresses: ShellAddresses
    allocator: StagingAwareAllocator  # the page allocator given to the shell's KV manager (the staging area's hooks)


class ColdEngine:
    def __init__(
        self,
        catalog: dict[str, str | Path],
        settings: EngineSettings | None = None,
        *,
        arena_bytes: int | None = None,
        runtime_bytes: int = 1 << 20,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging: bool | None = None,  # None: the switch policy's default (``SwitchPolicy.staging``)
        staging_chunks_per_step: int = 8,
        staging_max_fraction: float = 1.0,
        initial: str | None = None,
        switching: SwitchPolicy | None = None,  # default: the idle switch rule (policy.IdleSwitching)
        clock: Callable[[], float] = time.monotonic,
        before_kv_release: list[Callable[[str], None]] | None = None,
        max_switch_records: int = 32,
        residency: Any = None,  # a cold.residency.ResidencyDriver (unified_residency)
        partial_layers: bool = False, transfer: Any = None,  # streaming hot-swap, its transfer scheduler
        weight_link_bytes_per_s: float | None = None,  # a paced host->device weight link (substrate/copier.WeightLink)
        **overrides: Any,  # single fields of ``settings`` (tests and tools: page_size=4, kv_cache_bytes=...)
    ) -> None:
        """``settings`` (``settings.EngineSettings``): every shell's runtime (``EngineSettings.for_shell``), the
        arena's page size and device, the dtype the weight bank loads, and ``kv_cache_bytes``: the arena's KV
        share (``DEFAULT_KV_CACHE_BYTES`` when None). ``intra_op_threads`` None is resolved here, on the
        constructing thread: shells are built later, on the executor thread. ``weight_link_bytes_per_s``: every
        copy from the host weight bank (switch-time and staging) crosses one link of this bandwidth
        (``WeightLink``), so a switch's host-to-device phase takes at least its bytes / bandwidth; None = the
        copy's own speed. A testbed knob: it models a PCIe- or disk-limited weight path where the CPU copy is
        too fast to matter; the switch records and the measured switch costs carry the paced time."""
        if not catalog:
            raise ValueError("a cold engine needs at least one catalog model")
        if weight_link_bytes_per_s is not None and partial_layers:
            raise ValueError("a paced weight link is not modelled for partial_layers (its streams use their own transfer scheduler)")
        s = self.settings = (settings or EngineSettings()).with_overrides(**overrides)
        self.catalog = {m: Path(p) for m, p in catalog.items()}
        self.device = torch.device(s.device)
        self.dtype = s.dtype
        self.page_size = s.page_size
        kv_cache_bytes = s.kv_cache_bytes if s.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
        self._shell_settings = s.for_shell(ModelRunner.threads(s.intra_op_threads))
        self.clock = clock
        self.switching: SwitchPolicy = switching if switching is not None else IdleSwitching()
        staging = self.switching.staging if staging is None else staging
        self.costs = SwitchCostModel()
        self.staging_chunks_per_step = staging_chunks_per_step
        self.residency = residency
        self.bank = WeightBank(chunk_bytes)
        self._info: dict[str, ModelInfo] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        for m in self.catalog:
            self._load_bank(m)
        if arena_bytes is None:
            arena_bytes = align_up(max(self.bank[m].nbytes for m in self.catalog)) + kv_cache_bytes + align_up(runtime_bytes)
        self.arena = Arena(arena_bytes, self.device, runtime_bytes=runtime_bytes)
        link = WeightLink(weight_link_bytes_per_s) if weight_link_bytes_per_s is not None else None
        self.substrate = MemorySubstrate(self.arena, self.bank, page_size=s.page_size, copier=Copier(self.device, link=link),
                                         staging=staging, staging_max_fraction=staging_max_fraction)
        # every switch's phase 1 calls these first (e.g. drain outstanding device->host KV checkpoints)
        self.before_kv_release: list[Callable[[str], None]] = before_kv_release if before_kv_release is not None else []
        self.streamer = self._make_streamer(transfer) if partial_layers else None  # streaming hot-swap
        self.protocol = SwitchProtocol(self.substrate, self, before_kv_release=())
        self.protocol.before_kv_release = self.before_kv_release  # the same list: callers may append later
        self._shells: dict[str, _Shell] = {}
        self._fresh_shell: str | None = None
        self._host_kv_factory: Callable[[Engine], Any] | None = None
        self._retention = None  # kv.retention.RetentionBook shared by every model's session cache
        self._host_kv: dict[str, Any] = {}  # model -> its HostKV tier (outlives shell rebuilds)
        self.loaded: list[str] = []
        for m in self.catalog:
            self._open(m)
        self.active: str | None = None
        self.previous: str | None = None
        self.requested: str | None = None
        self._init_intake(max_switch_records)
        self.switching.bind(self)
        first = initial or next(iter(self.catalog))
        with self._step_lock:
            self.run_switch(first, "initial")
            self._refresh_gauges()

    def _init_intake(self, max_switch_records: int) -> None:
        """The intake and per-model queues, switch records, locks and step-boundary gauges (empty)."""
        self._queues = ModelQueues(self.catalog)
        self._records_lock = threading.Lock()  # switch records: appended on the executor thread, read by any
        self.switch_records: deque[SwitchRecord] = deque(maxlen=max_switch_records)
        self._unpublished: list[SwitchRecord] = []
        self._step_lock = threading.RLock()
        self._gen_ids = itertools.count()
        self._staging_busy = False
        self._staged: frozenset[str] = frozenset()  # refreshed at step boundaries (_refresh_gauges)
        self._slack_bytes = 0
        self._slack_at = float("-inf")  # when the slack gauge was last scanned

    def _make_streamer(self, transfer):
        """Partial-layer residency (JointServe §4.4): every copy goes through one transfer scheduler; a switch
        copies a startup prefix of layer groups and streams the rest during the first prefill
        (streaming_swap.py). Mutates: the substrate's copier and streamer, the switch barriers."""
        from services.engine.streaming_swap import HotSwapStreamer, stream_copy
        from services.engine.substrate.transfer import ScheduledCopier, TransferScheduler

        tr = transfer or TransferScheduler(copy_fn=stream_copy)
        self.substrate.copier = ScheduledCopier(tr, self.device)
        st = HotSwapStreamer(self.bank, self.arena.bytes, tr, prefill_per_token=self._prefill_per_token,
                             expected_tokens=self.first_prefill_tokens)
        self.substrate.streamer = st
        self.before_kv_release.append(st.wait)
        return st

    @property
    def queues(self) -> ModelQueues:
        """The per-model call queues and the intake (read by the switch policy and the residency driver)."""
        return self._queues

    @property
    def retention(self):
        """The ``kv.retention.RetentionBook`` every model's session cache evicts by (None until attached)."""
        return self._retention

    def first_prefill_tokens(self, model: str) -> int:
        """Tokens the first forward after a switch to ``model`` computes (the compute a weight stream hides
        behind, streaming_swap.k_for), as the switch policy predicts it: the idle rule counts every waiting
        call's prompt, the slot policy the least uncached one; at most one step's token budget (the stream must
        land within that first forward). Pure read."""
        return self.switching.first_prefill_tokens(model)

    def one_step_tokens(self, model: str, tokens: int) -> int:
        """``tokens`` capped at what one step of ``model``'s shell prefills with nothing decoding."""
        eng = self.shell(model)
        if eng is None:
            return tokens
        sch = eng.scheduler
        return min(tokens, max(sch.max_num_batched_tokens, sch.lone_prefill_tokens))

    def _prefill_per_token(self, model: str) -> float:
        sh = self._shells.get(model)
        v = sh.engine.stats().profile.prefill_per_token if sh is not None else None
        return v or 1e-4  # prior until the model's shell measured a prefill

    # ------------------------------------------------------------------ catalog (open / close)
    def _load_bank(self, model: str):
        """The model's host bank entry, read from its checkpoint if absent. Mutates: the bank; a real load is
        measured into the switch cost model (the load part of the ``OPEN`` path)."""
        if model in self.bank:
            return self.bank[model]
        t0 = time.perf_counter()
        e = self.bank.load(model, self.catalog[model], self.dtype)
        self.costs.observe_load(time.perf_counter() - t0)
        return e

    def _open(self, model: str) -> None:
        if model not in self.catalog:
            raise UnknownModelError(f"model {model!r} is not in this instance's catalog {sorted(self.catalog)}")
        e = self._load_bank(model)
        _, g = self.substrate.layout_for(model)  # raises ArenaBudgetError naming the model and bytes
        if model not in self._tokenizers:
            self._tokenizers[model] = Tokenizer.from_dir(self.catalog[model])
        tok = self._tokenizers[model]
        self._info[model] = ModelInfo(model, tok, e.config.vocab_size, min(e.config.attention_span, g.num_pages * self.page_size))
        if model not in self.loaded:
            self.loaded.append(model)

    def open_model(self, model: str, activate: bool = True) -> None:
        """Load a catalog model (bank + tokenizer) and, with ``activate``, ask the switch rule for it."""
        with self._step_lock:
            self._open(model)
            self._queues.open(model)
            if activate and model != self.active:
                self.requested = model
            self._refresh_gauges()

    def close_model(self, model: str) -> None:
        """Unload a model with no unfinished calls (raises ModelBusyError otherwise)."""
        with self._step_lock:
            if model not in self.catalog:
                raise UnknownModelError(f"model {model!r} is not in this instance's catalog {sorted(self.catalog)}")
            if model not in self.loaded:
                return
            busy = self._queues.live_counts().get(model, 0)
            if busy:
                raise ModelBusyError(f"model {model!r} has {busy} unfinished calls")
            self.loaded.remove(model)
            if self.requested == model:
                self.requested = None
            if self.active == model:
                for barrier in self.before_kv_release:
                    barrier(model)
                self.save_teardown(model)
                self.arena.clear_weights()
                self.active = None
            self._shells.pop(model, None)
            hk = self._host_kv.pop(model, None)
            if hk is not None:
                hk.close()
            self._info.pop(model, None)
            self.bank.drop(model)
            self._refresh_gauges()

    # ------------------------------------------------------------------ host KV tier (Talaria §4.3)
    def attach_retention(self, book) -> None:
        """Every model's session cache evicts by predicted return (``kv.retention``; shells built later too)."""
        with self._step_lock:
            self._retention = book
            for sh in self._shells.values():
                sh.engine.attach_retention(book)

    def attach_host_kv_factory(self, factory: Callable[[KvPort], Any]) -> None:
        """Give every model's shell a host KV tier built by ``factory(shell_engine.kv_port())``.

        Sessions are checkpointed to the kvstore when their calls end; a switch's phase 1 first drains the
        outgoing model's outstanding device->host copies (the switch barrier, Appendix B) before its KV
        region is released; a returning session's prefix is restored from the store instead of recomputed.
        Mutates: the shells' ``host_kv`` and ``before_kv_release``.
        """
        with self._step_lock:
            self._host_kv_factory = factory
            for model, sh in self._shells.items():
                self._bind_host_kv(model, sh.engine)
            if self._drain_host_kv not in self.before_kv_release:
                self.before_kv_release.insert(0, self._drain_host_kv)
            self._refresh_gauges()

    def _bind_host_kv(self, model: str, eng: Engine) -> None:
        if self._host_kv_factory is None:
            return
        hk = self._host_kv.get(model)
        if hk is None:
            hk = self._host_kv[model] = self._host_kv_factory(eng.kv_port())
        else:
            hk.rebind(eng.kv_port())  # a rebuilt shell: the tier's store knowledge carries over (nothing in flight)
        eng.attach_host_kv(hk)
        # write-back (kv/write_back.py): while another model has queued calls the next switch takes this
        # model's KV off the device, so a call ending now is written back at once
        hk.leaving_soon = lambda m=model: any(q for k, q in self._queues.items() if k != m)
        if self.streamer is not None:  # restores share the one transfer scheduler (κ-floor)
            hk.channel = self.streamer.transfer

    def _drain_host_kv(self, model: str) -> None:
        sh = self._shells.get(model)
        if sh is not None and not sh.engine.release_device_kv(timeout=60.0):
            log.warning("switch barrier: checkpoints of %s did not leave the device within 60 s; they are abandoned", model)

    def info(self, model: str) -> ModelInfo:
        try:
            return self._info[model]
        except KeyError:
            raise UnknownModelError(f"model {model!r} is not loaded on this instance (loaded: {self.loaded})") from None

    def serves(self, model: str) -> bool:
        return model in self._info

    @property
    def model_id(self) -> str:
        """The default model of a call that names none: the active one (else the first loaded)."""
        return self.active or (self.loaded[0] if self.loaded else "")

    # ------------------------------------------------------------------ intake (any thread)
    def add_request(self, req: EngineRequest) -> None:
        model = req.model or self.model_id
        info = self.info(model)
        validate_request(req, info.max_context, info.vocab_size)
        req.model = model
        self._queues.add(req)

    def abort(self, request_id: str) -> None:
        self._queues.abort(request_id)

    def has_unfinished(self) -> bool:
        """Calls queued or in flight — or a requested switch or staging work (so a step loop runs them)."""
        if self._queues.has_live():
            return True
        return self._staging_busy or (self.requested is not None and self.requested != self.active)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """The one step of every cold engine: intake, the switch policy's turn (may switch; a typed ``Turn`` says
        whether the active shell steps and which queued calls of its model join it first), one shell step,
        bookkeeping, staging. The policy is a part (``self.switching``): the idle switch rule or the slot
        scheduler."""
        with self._step_lock:
            outputs = self._drain_intake()
            turn = self.switching.turn()
            if turn.runs and self.active is not None:
                outputs += self._run_turn(turn)
            for o in outputs:
                if o.finished:
                    self._queues.finish(o.request_id)
                    self.switching.finished(o)
            self._stage()
            self._refresh_gauges()
            return outputs

    def _run_turn(self, turn: Turn) -> list[RequestOutput]:
        """The admitted calls of the active model join its shell (in queue order), then one shell step as the
        policy runs it. Mutates: the active model's queue, its shell."""
        eng = self._shells[self.active].engine
        for r in self._queues.take(self.active, turn.selection()):
            if r.phases is not None:
                r.phases.enter(Phase.ENGINE_QUEUE, attribution_clock())  # its slot is open: the shell's queue
            self.switching.admitted(r)
            eng.add_validated(r)  # validated once, at this engine's intake
        return self.switching.step_shell(eng)

    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None, model: str | None = None) -> list[list[int]]:
        ids = [f"cold-generate-{next(self._gen_ids)}" for _ in prompts_token_ids]
        return run_to_completion(self, ids, prompts_token_ids, sampling, model=model or self.model_id)

    def _drain_intake(self) -> list[RequestOutput]:
        new, aborts = self._queues.take_intake()
        now = attribution_clock()
        for req in new:
            # received -> here is engine queue; in the per-model queue it waits for its round
            req.phases = PhaseClock(phase_start(req.arrival_time, self.clock, now))
            req.phases.enter(Phase.ROUND_WAIT, now)
            self._queues.enqueue(req)
        outputs: list[RequestOutput] = []
        for rid in aborts:
            hit = self._queues.remove(rid)
            if hit is not None:
                attr = hit.phases.stop(attribution_clock()) if hit.phases is not None else None
                outputs.append(RequestOutput(rid, [], "", True, FinishReason.ABORT, Usage(len(hit.prompt_token_ids), 0, 0), attribution=attr))
            elif self.active is not None:
                self._shells[self.active].engine.abort(rid)  # its ABORT output comes from the shell's step
        return outputs

    def engine_view(self) -> EngineView:
        """The idle switch rule's and the stager's view (``substrate.policy.EngineView``); executor thread."""
        counts = self._queues.counts()
        queued = {m: n for m, n in counts.items() if n and m != self.active}
        busy = False
        if self.active is not None:
            busy = bool(counts.get(self.active)) or self._shells[self.active].engine.has_unfinished()
        return EngineView(self.active, busy, queued, self._queues.oldest(), self.requested, self.previous, tuple(self.loaded))

    # ------------------------------------------------------------------ staging
    def _stage(self) -> None:
        if self.streamer is not None and self.streamer.gate is not None and not self.streamer.gate.done():
            self._staging_busy = True  # the channel is streaming the active model's groups: no prefetch now
            return
        if self.residency is not None:  # a unified residency plan decides what stays staged
            self._staging_busy = self.residency.step(self, self.clock())
            return
        if not self.staging_pays():
            self._staging_busy = False
            return
        target = predict_next(self.engine_view(), self.clock())
        if target is not None:
            self.substrate.stage(target, self.staging_chunks_per_step)
        self._staging_busy = self.substrate.staging_pending(target)

    def staging_pays(self) -> bool:
        """Whether D2D staging of the next model still pays, from the measured switch costs (a
        mechanism that costs more than it saves is not used). On a GPU the stager's copies are asynchronous
        DMA beside the compute: staging costs no step time and pays whenever a staged switch is faster. On a
        CPU the stager's copies run on the serving cores and move the same bytes a host-only switch moves, so
        staging pays only if a staged switch saves more than that copy costs: ``host - full > host`` once both
        paths are measured (before that it stages, to measure). Measured here (tiny models, 2-core CPU): a
        staged switch 1.9 ms vs host-only 1.8 ms, and the stager's copies made ``bench matrix`` 1.12x slower
        than with staging off. With a paced weight link (``weight_link_bytes_per_s``) the link's time passes on
        the stager thread, not on the serving cores: the cores pay only the memcpy, which a staged switch measures
        (on a CPU its D2D copy is the same memcpy of the same bytes), so then ``host - full > full``. Pure read."""
        full, host = self.costs.get(SwitchPath.FULL_STAGED), self.costs.get(SwitchPath.HOST_ONLY)
        if full is None or host is None:
            return True
        copy_cost = (full if self.substrate.copier.link is not None else host) if self.device.type == "cpu" else 0.0
        return host - full > copy_cost

    # ------------------------------------------------------------------ the switch (RuntimeHooks)
    def run_switch(self, target: str, reason: str) -> SwitchRecord:
        """Switch to ``target`` now (executor thread, under the step lock: the switch policy's turn); the active
        model must have no work in flight. Mutates: the active model, the arena, the queued calls' phase
        clocks, the switch cost model and records."""
        if target not in self.loaded:
            raise UnknownModelError(f"cannot switch to {target!r}: not loaded")
        src = self.active
        waiting = [r.phases for r in self._queues.all_waiting()]
        enter_all(waiting, Phase.SWITCH_WAIT, attribution_clock)  # every queued call waits for the switch
        rec = self.protocol.run(src, target, reason)
        if self.streamer is not None:  # later layer groups are still streaming: gate the forward on them
            self.streamer.attach(target, self._shells[target].engine.model)
        enter_all(waiting, Phase.ROUND_WAIT, attribution_clock)
        if src is not None:
            self.previous = src
        if self.requested == target:
            self.requested = None
        self.costs.observe(rec.path, rec.total_seconds)
        with self._records_lock:
            self.switch_records.append(rec)
            self._unpublished.append(rec)
        return rec

    def switch_to(self, model: str, reason: str = "manual") -> SwitchRecord:
        """Switch now (tests/benchmarks); the active model must have no unfinished work."""
        with self._step_lock:
            if self.active is not None and self.engine_view().active_busy:
                raise ModelBusyError(f"active model {self.active!r} has unfinished work")
            rec = self.run_switch(model, reason)
            self._refresh_gauges()
            return rec

    def save_teardown(self, model: str) -> None:
        """Phase 1: the outgoing model's KV region is released (its caches emptied; the shell is kept)."""
        sh = self._shells.get(model)
        if sh is not None:
            eng = sh.engine
            assert not eng.has_unfinished(), f"switching away from {model!r} with work in flight"
            eng.flush_cache()
        self.substrate.detach()

    def _addresses(self, model: str) -> ShellAddresses:
        _, g = self.substrate.layout_for(model)
        a = self.arena.base_addresses()
        return ShellAddresses(a["weights"], self.arena.base + g.kv_start, a["runtime"], g.num_pages)

    def restore_kv_shell(self, model: str) -> bool:
        """Phase 3: reuse the cached shell when its KV base address and page count are unchanged."""
        now = self._addresses(model)
        sh = self._shells.get(model)
        if sh is not None and sh.addresses.kv == now.kv and sh.addresses.num_pages == now.num_pages:
            return True
        e = self.bank[model]
        alloc = StagingAwareAllocator(now.num_pages)
        eng = Engine(
            self.catalog[model], self._shell_settings, model=(bind_model(e, self.substrate.weights(model)), e.config),
            kv_cache=self.substrate.kv_cache(model), tokenizer=self._tokenizers[model],
            page_allocator=alloc, model_id=model, clock=self.clock,
        )
        self._shells[model] = _Shell(eng, now, alloc)
        self._bind_host_kv(model, eng)
        eng.attach_retention(self._retention)
        self._fresh_shell = model  # its runtime state was built with it (phase 4 reports a rebuild)
        return False

    def restore_runtime(self, model: str) -> bool:
        """Phase 4: reuse parameter views / runtime buffers when the weights and runtime bases match."""
        sh = self._shells[model]
        if self._fresh_shell == model:
            self._fresh_shell = None
            return False
        now = self._addresses(model)
        if sh.addresses.weights == now.weights and sh.addresses.runtime == now.runtime:
            return True
        sh.engine.rebind_model(bind_model(self.bank[model], self.substrate.weights(model)))
        sh.addresses = now
        return False

    def publish(self, model: str) -> None:
        """Phase 5: the new model, allocator and staging area become the active references."""
        self.substrate.attach(model, self._shells[model].allocator)
        self.active = model

    def pool(self) -> ColdEngine:
        """This engine: it is the model pool (``api.ModelPool``) as well as the executor."""
        return self

    # ------------------------------------------------------------------ introspection
    def recent_switch_records(self, n: int) -> list[SwitchRecord]:
        """The latest ``n`` switch records, oldest first (any thread)."""
        with self._records_lock:
            return list(self.switch_records)[-n:]

    def take_round_summaries(self) -> list:
        """Closed rounds of the switch policy not yet handed out (the service publishes them on ``.round``;
        none under the idle switch rule)."""
        with self._step_lock:
            return self.switching.take_round_summaries()

    def idle_wait_s(self) -> float:
        """How long the step loop may sleep with nothing to run: a slot held for expected returns
        (``slots/hold.py``), else 0."""
        return self.switching.idle_wait_s()

    def take_switch_records(self) -> list[SwitchRecord]:
        """Records not yet handed out (the service publishes them on ``.switch``); any thread."""
        with self._records_lock:
            out, self._unpublished = self._unpublished, []
        return out

    def _refresh_gauges(self) -> None:
        """Executor thread, at step boundaries: the substrate's staging state, which ``stats()`` (any thread)
        must not read while the stager changes it. Two values; everything else is built in ``stats()``. The
        slack gauge scans every staging slot, so it is refreshed at most every ``GAUGE_PERIOD_S`` (heartbeats
        are slower; a scan per step was ~8 % of a loaded engine's executor thread)."""
        self._staged = frozenset(self.substrate.staged_models())
        now = self.clock()
        if now - self._slack_at >= GAUGE_PERIOD_S or now < self._slack_at:
            self._slack_bytes, self._slack_at = self.substrate.slack_bytes(), now
        self.switching.refresh()

    def _model_costs(self, model: str) -> CostStats | None:
        """The model's own measured costs (its shell's executor and host tier; any thread), None while it
        has measured nothing here: the models of one cold instance differ in size, so the router prices a
        call with its model's costs, not the active model's. Pure read."""
        sh = self._shells.get(model)
        if sh is None:
            return None
        cs = sh.engine.cost_stats()
        return cs if cs.prefill_per_token or cs.decode_step or cs.prefill_by_context or cs.decode_by_batch else None

    def stats(self) -> EngineStats:
        """Built now (any thread; never waits for a step): the active shell's stats, one ``ModelStats``
        per loaded catalog model, sessions of every model's device cache and host tier."""
        active = self.active
        sh = self._shells.get(active) if active is not None else None
        st = sh.engine.stats() if sh is not None else None
        per_model = self._queues.live_counts()
        unfinished = sum(per_model.values())
        queued = self._queues.total_waiting()
        running = st.num_running if st is not None else 0
        staged = self._staged
        slots = self.switching.slot_stats()
        waits = dict(slots.slot_wait_s) if slots is not None else {}
        models = tuple(
            ModelStats(m, True, m == active, m in staged, self._info[m].max_context, running if m == active else 0,
                       max(per_model.get(m, 0) - (running if m == active else 0), 0), waits.get(m, waits.get("", 0.0)),
                       self._model_costs(m), getattr(self._info[m].tokenizer, "max_token_bytes", 0))
            for m in list(self.loaded)
        )
        sessions = [replace(s, model=active) for s in (st.sessions if st is not None else ()) if s.where is KvLocation.DEVICE]
        on_device = {s.session_id for s in sessions}
        for m, hk in list(self._host_kv.items()):  # host KV of every model, not only the active one
            sessions += [s for s in hk.session_infos(m) if s.session_id not in on_device]
        prof = st.profile if st is not None else CostStats()
        hk_active = self._host_kv.get(active) if active is not None else None
        rpt = hk_active.restore_per_token.value if hk_active is not None else prof.restore_per_token
        tb = (self.streamer.snapshot().get("bytes_by_class") or {}) if self.streamer is not None else {}
        return EngineStats(
            model_id=active or "", num_running=running, num_waiting=queued + (st.num_waiting if st is not None else 0),
            num_unfinished=unfinished, kv_pages_total=st.kv_pages_total if st else 0, kv_pages_free=st.kv_pages_free if st else 0,
            radix_pages=st.radix_pages if st else 0, session_pages=st.session_pages if st else 0,
            prefix_hit_rate=st.prefix_hit_rate if st else 0.0, tokens_generated=st.tokens_generated if st else 0,
            num_preemptions=st.num_preemptions if st else 0, num_steps=st.num_steps if st else 0,
            max_context=st.max_context if st else 0, models=models, sessions=tuple(sessions),
            profile=CostStats(prof.prefill_per_token, prof.decode_step, rpt, self.costs.by_path,
                              prefill_by_context=prof.prefill_by_context, decode_by_batch=prof.decode_by_batch),
            host_kv=bool(self._host_kv), kv_restore_verify_failures=sum(hk.counters["restore_verify_failures"] for hk in list(self._host_kv.values())),
            staging_slack_bytes=self._slack_bytes, num_switches=self.protocol.seq,
            slots=slots, transfer_stream_bytes=tb.get("STREAM", 0), transfer_kv_bytes=tb.get("KV", 0),
            kernels=st.kernels if st is not None else self._any_kernels(),
            host_kv_counters=tuple((m, tuple(hk.counters.items())) for m, hk in list(self._host_kv.items())),
        )

    def _any_kernels(self) -> tuple[tuple[str, str], ...]:
        """Kernels of any open shell (every shell is built with the same kernel modes). Reads only."""
        for sh in list(self._shells.values()):
            return sh.engine.kernels()
        return ()

    def session_info(self, session_id: str) -> SessionInfo | None:
        """The session's KV in the active model's device cache, else in any model's host tier."""
        sh = self._shells.get(self.active) if self.active is not None else None
        info = sh.engine.session_info(session_id) if sh is not None else None
        if info is not None and info.where is KvLocation.DEVICE:
            return replace(info, model=self.active)
        for m, hk in list(self._host_kv.items()):
            hit = next((s for s in hk.session_infos(m) if s.session_id == session_id), None)
            if hit is not None:
                return hit
        return info

    def flush_cache(self) -> int:
        with self._step_lock:
            freed = self._shells[self.active].engine.flush_cache() if self.active is not None else 0
            self._refresh_gauges()
            return freed

    def end_session(self, session_id: str, tenant: str = "", token_ids=()) -> int:
        """The active model's engine ends the session (an inactive model's device KV is gone already)."""
        with self._step_lock:
            freed = self._shells[self.active].engine.end_session(session_id, tenant, token_ids) if self.active is not None else 0
            self._refresh_gauges()
            return freed

    def check_integrity(self) -> None:
        with self._step_lock:
            self.arena.check()
            if self.active is not None:
                eng = self._shells[self.active].engine
                eng.check_integrity()
                if self.substrate.area is not None:
                    self.substrate.area.check(eng.kv.is_page_used)

    def shell(self, model: str) -> Engine | None:
        sh = self._shells.get(model)
        return sh.engine if sh is not None else None
