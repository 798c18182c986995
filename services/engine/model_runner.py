"""The model runner of one engine: the model, its KV pool tensors, the kernels it runs with, and one forward.

Design note. The engine is split as vLLM splits its v1 engine into a model runner (inputs to logits on the
device) and an output processor (sampled tokens to request outputs), with the loop between them: the runner
knows tensors and kernels and nothing of requests, the output processor knows requests and text and nothing
of kernels, and the loop (``executor.Engine``) owns the scheduler, the intake and the order of one step. So a
change to how a step is laid out on the device (the flat batch, the copies, CUDA graphs, thread teams, which
C++ kernel serves) lands here and cannot touch request bookkeeping, and the runner can be reasoned about (and
rebound onto moved weights by the cold pool) without the scheduler's state.

What it owns: the model (``model``, rebound by ``rebind_model``), its config and dtype, the KV pool tensors
(``kv_cache``: allocated here, or a caller-owned view), the pool's page count and the context limit that
follows from it, the kernel choices (``paged_decode``, ``fused_ops``, ``prefill_attention``, ``decode_gemm``,
``deterministic``: each set once at construction, on the model's modules), the compiled layer parts, the decode
CUDA graphs, and the intra-op thread counts of a step. What it mutates per step: the KV pool (the
copy-on-write copies a schedule asks for, and the forward's writes into the slots it is given) and the
stepping thread's torch thread count. It reads the scheduled sequences (token ids, pages) and never changes
them; it holds no request, scheduler or sampler state (sampling is the output side's: per-request generators).

Hot path: :meth:`ModelRunner.execute` is the body of a step that used to live on the engine, unchanged: one
Python list for ids + positions + slots (+ sampled rows), one host tensor, one transfer, one forward.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.engine.intra_op import set_thread_count
from services.engine.memory import default_kv_cache_bytes
from services.engine.model.batch import AttnBatch, KVCache
from services.engine.model.compiled import compile_model
from services.engine.model.config import ModelConfig
from services.engine.model.cuda_graphs import DecodeGraphs
from services.engine.model.decode_gemm import load_decode_gemm
from services.engine.model.fused_ops import load_fused_ops
from services.engine.model.llama import LlamaForCausalLM
from services.engine.model.loader import allocate_kv_cache, load_model
from services.engine.model.packed import can_pack
from services.engine.model.paged_attn import load_kernel
from services.engine.model.prefill_attn import applies as prefill_applies, isas as prefill_isas, load_prefill_kernel
from services.engine.model.registry import lookup
from services.engine.settings import EngineSettings

if TYPE_CHECKING:  # the schedule is the runner's input, read only: a type here, no import of the scheduler
    from services.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

SMALL_STEP_TOKENS = 64  # a step this small is decode (or a tiny prefill): see ModelRunner._step_threads
DETERMINISTIC_SPLIT_KEYS = 256  # deterministic mode: keys per chunk of the fixed attention split (paged_attn.cpp Split; a multiple of 16)


class ModelRunner:
    """One model on one device with its KV pool: kernel selection at construction, :meth:`execute` per step.

    ``model``/``kv_cache`` let a caller that owns device memory (the cold pool's arena) bind the runner onto
    existing tensors instead of loading and allocating; ``kv_cache`` then fixes the page count (and no CUDA graphs
    are captured: the memory moves). Construction order matters where memory is sized: the weights are loaded
    and packed before the KV pool is sized from the memory still available (``memory.py``)."""

    def __init__(
        self, model_dir: Path, settings: EngineSettings, *, model_id: str,
        model: tuple[LlamaForCausalLM, ModelConfig] | None = None, kv_cache: KVCache | None = None,
    ) -> None:
        s = settings
        self.model_id = model_id
        self.device = torch.device(s.device)
        self.model, self.config = model if model is not None else load_model(model_dir, device=self.device, dtype=s.dtype)
        self.dtype = next(self.model.parameters()).dtype
        self._pack(s.packed_weights, own_model=model is None, decode_gemm=s.decode_gemm)
        self.page_size = s.page_size
        cfg = self.config
        self.num_pages = self._kv_pages(s.num_pages, kv_cache, s.kv_cache_bytes, s.max_num_seqs)
        self.kv_cache = kv_cache if kv_cache is not None else allocate_kv_cache(cfg, self.num_pages, s.page_size, self.device, self.dtype)
        self.max_context = min(cfg.attention_span, self.num_pages * s.page_size, s.max_model_len or cfg.attention_span)  # max_model_len: a cap
        # CPU kernels, each flag says whether it is on: model/paged_attn.py, fused_ops.py, prefill_attn.py
        self.paged_decode, self.fused_ops, self.prefill_attention = (
            self._paged_decode(s.paged_decode), self._fused_ops(s.fused_ops), self._prefill_attention(s.prefill_attention))
        self.deterministic = self._deterministic(s.deterministic)
        self._log_kernels()
        self.intra_op_threads, self.small_step_threads = self.threads(s.intra_op_threads), self._small_threads(s.small_step_threads)
        # compiled layer parts (model/compiled.py): off / auto (kept where a start-up measurement shows they pay) / on;
        # decode steps replayed as CUDA graphs (model/cuda_graphs.py): own weights and KV pool only
        self.compile_verdict = compile_model(self.model, self.kv_cache, self.device, s.compile_mode, s.max_num_batched_tokens)
        self.decode_graphs = self._decode_graphs(s.cuda_graphs, model is None and kv_cache is None, s.max_num_seqs, s.cuda_graph_max_context)

    # ------------------------------------------------------------------ one step
    def execute(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Run the schedule's copies and one forward; return the logits of the rows to sample (one per
        ``sample`` entry, in batch order; an inference tensor), or None when no row samples. Mutates the KV
        pool (the copies and the forward's slot writes) and the calling thread's torch thread count."""
        P = self.page_size
        kv = self.kv_cache
        for op in sched.copies:
            s, d = op.src * P, op.dst * P
            for layer in range(len(kv.k)):
                kv.k[layer][d : d + op.num_rows].copy_(kv.k[layer][s : s + op.num_rows])
                kv.v[layer][d : d + op.num_rows].copy_(kv.v[layer][s : s + op.num_rows])
        flat, cu_q, context_lens, block_tables = self._flat_batch(sched)
        T = cu_q[-1]
        self._step_threads(T)
        rows = [i for i, sc in enumerate(sched.scheduled) if sc.sample]
        # one host tensor (ids | positions | slots | sampled rows), one transfer to the device
        flat += [cu_q[i + 1] - 1 for i in rows]
        step = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        batch = AttnBatch(cu_q, context_lens, block_tables, step[2 * T : 3 * T])
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(batch, T) if graphs is not None else None
        with torch.inference_mode():
            if bucket is not None:
                hidden = graphs.run(bucket, step[: 3 * T], batch)
            else:
                hidden = self.model.forward(step[:T], step[T : 2 * T], batch, kv)
            if not rows:
                return None
            return self.model.compute_logits(hidden.index_select(0, step[3 * T :]))

    def _flat_batch(self, sched: SchedulerOutput) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """The step's flat token axis as one int list ``ids + positions + slots`` (each ``T`` long), plus
        ``cu_q``, context lengths and block tables (see model/batch.py). Reads the sequences, mutates nothing."""
        P = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q = [0]
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        for sc in sched.scheduled:
            seq, start, end = sc.seq, sc.start, sc.start + sc.num_new_tokens
            pages = seq.pages
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            if end - start == 1:
                slots.append(pages[start // P] * P + start % P)
            else:
                slots += [pages[p // P] * P + p % P for p in range(start, end)]
            cu_q.append(len(ids))
            context_lens.append(end)
            block_tables.append(pages[: -(-end // P)])  # the pages holding positions < end
        return ids + positions + slots, cu_q, context_lens, block_tables

    def _step_threads(self, tokens: int) -> None:
        """Give the stepping thread its own intra-op thread count: ``intra_op_threads``, or ``small_step_threads``
        for a step of at most SMALL_STEP_TOKENS tokens (a decode step is ~150 short parallel regions, each
        ending at a team barrier, where a prefill chunk's regions are long).

        Why every step and not once at start-up: ``torch.set_num_threads`` on one thread also sets the default
        of every thread that never called it. The host KV tier's and the transfer scheduler's workers set 1
        for themselves (their copies run single-threaded), so an executor thread that relied on the default ran
        every step with one thread (the default stack's decode at 0.69x of the same stack with the
        host KV tier off). Once this thread has set its own count, others' calls no longer change it, so this
        is one ``get_num_threads`` a step (``intra_op.set_thread_count``). Mutates torch's thread count for the
        calling thread (and the default of threads that never ran a parallel op)."""
        want = self.intra_op_threads
        if self.small_step_threads is not None and tokens <= SMALL_STEP_TOKENS:
            want = self.small_step_threads
        set_thread_count(want)

    # ------------------------------------------------------------------ threads
    def _small_threads(self, n: int | None) -> int | None:
        if n is not None and n < 1:
            raise ValueError(f"small_step_threads must be >= 1, got {n}")
        return n if self.device.type == "cpu" else None

    @staticmethod
    def threads(n: int | None) -> int:
        """The team every step runs with (``_step_threads`` sets it on the stepping thread): ``n``, else the
        calling thread's count (``build_engine`` sets the configured one there just before). Reads only."""
        n = n if n is not None else torch.get_num_threads()
        if n < 1:
            raise ValueError(f"intra_op_threads must be >= 1, got {n}")
        return n

    # ------------------------------------------------------------------ the KV pool
    def _kv_pages(self, num_pages: int | None, kv_cache: KVCache | None, kv_cache_bytes: int | None, max_num_seqs: int) -> int:
        """The KV pool's page count: the given cache's, else ``num_pages``, else what ``kv_cache_bytes`` (or
        the machine-sized budget of ``memory.py``, capped at ``max_num_seqs`` full contexts) holds."""
        cfg, page_size = self.config, self.page_size
        if kv_cache is not None:
            num_pages = kv_cache.k[0].shape[0] // page_size
        if num_pages is None:
            page_bytes = lookup(cfg.architecture).kv_shape(cfg).page_bytes(page_size, self.dtype.itemsize)
            budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_cache_bytes(self.device)
            num_pages = budget // page_bytes
            if kv_cache_bytes is None:  # no explicit size: no more than max_num_seqs full contexts
                num_pages = min(num_pages, max_num_seqs * -(-cfg.attention_span // page_size))
                log.info("KV pool sized to the machine: %d pages (%.0f MiB; engine.kv_cache_mb sets it)", num_pages, num_pages * page_bytes / 2**20)
        if num_pages < 1:
            raise ValueError(f"KV pool too small: {num_pages} pages")
        return int(num_pages)

    # ------------------------------------------------------------------ the model and its kernels
    def rebind_model(self, model: LlamaForCausalLM) -> None:
        """Serve with ``model`` from now on (the cold pool rebinds its parameter views onto moved weights):
        the CPU kernels this runner chose (``paged_decode``, ``fused_ops``) go with it. Mutates ``self.model``
        and the new model's kernel attributes, drops the decode graphs; the caller holds no step in flight."""
        model.paged_decode = self.model.paged_decode
        model.prefill_attention = self.model.prefill_attention
        model.split_keys = self.model.split_keys
        model.use_fused_ops(self.model.fused_ops)
        self.model = model
        self.decode_graphs = None  # captured against the old weights

    def _decode_graphs(self, mode: str, own: bool, max_num_seqs: int, max_context: int) -> DecodeGraphs | None:
        """``cuda_graphs``: ``auto`` captures the decode graphs (model/cuda_graphs.py) on a CUDA device when this
        runner owns its weights and KV pool and the layers are not compiled; ``off`` (or any other case) runs
        every step eagerly. Returns the graphs or None; capturing writes slot 0 of the (still empty) pool."""
        if mode not in ("auto", "off"):
            raise ValueError(f"cuda_graphs must be 'auto' or 'off', got {mode!r}")
        if mode == "off" or self.device.type != "cuda" or not own or self.model.dense is not None or not self.model.graph_layers:
            return None
        return DecodeGraphs(self.model, self.kv_cache, max_batch=max_num_seqs,
                            max_context=min(max_context, self.max_context), say=log.info)

    def _paged_decode(self, mode: str) -> bool:
        """Give the model the CPU paged decode kernel (``model/paged_attn.py``) for ``mode`` ``auto`` on a CPU
        (built on first use, cached; None if it cannot be built: gather + SDPA stays) or take it away
        (``off``, or any other device). Sets ``self.model.paged_decode``; returns whether the kernel is on."""
        if mode not in ("auto", "off"):
            raise ValueError(f"paged_decode must be 'auto' or 'off', got {mode!r}")
        kernel = load_kernel() if mode == "auto" and self.device.type == "cpu" else None
        self.model.paged_decode = kernel
        return kernel is not None

    def _deterministic(self, on: bool) -> bool:
        """Batch- and prefix-invariant numerics (config ``deterministic``): every attention query, prefill or
        decode, by the paged decode kernel in fixed chunks of ``DETERMINISTIC_SPLIT_KEYS`` keys
        (``llama._invariant_group``), so a greedy call's tokens do not depend on what shares its steps, on
        whether its prefix was cached or restored, or on the thread count; and a packed model's linears in tiles
        of at most 16 rows through the decode GEMM (``PackedLinear.tiled``: its rows do not depend on the row
        count, oneDNN's bf16 rows do at some shapes). float32 matmuls depend on the row count at every shape (MKL
        picks other kernels by row count), so float32 is refused. Needs the CPU kernel. Sets
        ``self.model.split_keys`` and every packed linear's ``tiled``; returns ``on``. Raises ValueError where it
        cannot hold."""
        self.model.split_keys = 0
        for p in self._packed_linears():
            p.tiled = on
        if not on:
            return False
        if self.device.type != "cpu" or not self.paged_decode:
            raise ValueError("deterministic needs a CPU engine with the paged decode kernel (paged_decode: auto, and it must build)")
        if self.dtype != torch.bfloat16:
            raise ValueError(f"deterministic needs bfloat16 (float32 CPU matmuls change a row's sums with the row count); dtype is {self.dtype}")
        self.model.split_keys = DETERMINISTIC_SPLIT_KEYS
        return True

    def _packed_linears(self) -> list[Any]:
        """The model's prepacked linears (model/packed.py), none if it is not packed. Reads only."""
        m = self.model
        if not m.is_packed:
            return []
        out = [m.lm_head_packed]
        for layer in m.model.layers:
            out += [getattr(o, a) for o, a in ((layer.self_attn, "qkv_packed"), (layer.self_attn, "o_packed"))]
            out += [getattr(layer.mlp, a) for a in ("gate_up_packed", "down_packed") if hasattr(layer.mlp, a)]
        return [p for p in out if p is not None]

    def _pack(self, packed_weights: bool | None, own_model: bool, decode_gemm: str = "auto") -> None:
        """Prepack the CPU linears (model/packed.py; mutates the model): None = where measured to pay (bf16 on
        CPU) and only for a model this runner loaded itself (an arena-bound model's weights are rewritten in place).
        ``decode_gemm`` ``auto``: packed linears also get the decode-step kernel where the CPU has AVX-512 BF16
        (model/decode_gemm.py); ``off``: oneDNN for every step. Sets ``self.decode_gemm``: whether the (now) packed
        model runs it, read from the model, so a model packed before it came here is reported as it is."""
        if decode_gemm not in ("auto", "off"):
            raise ValueError(f"decode_gemm must be 'auto' or 'off', got {decode_gemm!r}")
        if packed_weights is None:
            packed_weights = own_model and can_pack(self.device, self.dtype)
        elif packed_weights and self.dtype == torch.bfloat16 and not can_pack(self.device, self.dtype):
            raise ValueError("packed_weights: true needs oneDNN's bf16 path, which this CPU lacks (AVX512-BW/VL/DQ or "
                             "AVX-NE-CONVERT); leave it unset (bf16 linears then run unpacked) or use dtype float32")
        if packed_weights and not self.model.is_packed:
            self.model.pack_weights(load_decode_gemm() if decode_gemm == "auto" and self.device.type == "cpu" else None)
        self.decode_gemm = self.model.is_packed and self.model.lm_head_packed.gemm is not None  # what the model runs

    def _log_kernels(self) -> None:
        """On a CPU, log once which path each kernel takes (operators ask which ISA serves). Mutates nothing."""
        if self.device.type != "cpu":
            return
        pa = self.model.prefill_attention
        log.info("%s CPU kernels: paged decode %s, fused ops %s, prefill attention %s, decode GEMM %s", self.model_id,
                 "on" if self.paged_decode else "off (gather + SDPA)", "on" if self.fused_ops else "off (eager)",
                 self.prefill_isa if pa is not None else "off (ATen flash)", "on" if self.decode_gemm else "off (oneDNN)")

    def kernels(self) -> tuple[tuple[str, str], ...]:
        """(kernel, what runs) for the heartbeat: on a CPU each C++ kernel is ``on`` or ``off (<the
        fallback> ...)`` with the build error when the extension did not build; on CUDA one ``device`` row.
        Reads only."""
        if self.device.type != "cpu":
            return (("device", f"{self.device.type} (ATen / SDPA kernels)"),)
        from services.engine.model.paged_attn import build_error

        err = build_error()
        why = f"; build failed: {err}" if err else ""
        pa = self.model.prefill_attention is not None
        return (
            ("paged_decode", "on" if self.paged_decode else f"off (gather + SDPA{why})"),
            ("fused_ops", "on" if self.fused_ops else f"off (eager ops{why})"),
            ("prefill_attention", f"on ({self.prefill_isa})" if pa else f"off (ATen flash{why or '; not applicable to this CPU, dtype or head dim'})"),
            ("decode_gemm", "on" if self.decode_gemm else f"off (oneDNN{why})"),
        )

    def _prefill_attention(self, mode: str) -> bool:
        """Give the model the CPU prefill attention kernel (``model/prefill_attn.py``) for ``mode`` ``auto`` on a
        CPU with AMX-BF16 or AVX-512 BF16 (the fastest it has) serving a bf16 model with head dim 64 (else ATen's flash kernel stays), or take it
        away (``off``). Sets ``self.model.prefill_attention``; returns whether the kernel is on."""
        if mode not in ("auto", "off"):
            raise ValueError(f"prefill_attention must be 'auto' or 'off', got {mode!r}")
        usable = mode == "auto" and prefill_applies(self.device, self.dtype, self.config.head_dim)
        available = prefill_isas() if usable else []
        kernel = load_prefill_kernel(available[0]) if available else None
        self.model.prefill_attention = kernel
        self.prefill_isa = available[0] if kernel is not None else None
        return kernel is not None

    def _fused_ops(self, mode: str) -> bool:
        """Give the model the fused elementwise CPU ops (``model/fused_ops.py``) for ``mode`` ``auto`` on a
        CPU (the paged-attention extension, built on first use; eager ops if it cannot be built) or take
        them away (``off``, or any other device). Mutates the model's modules; returns whether they are on."""
        if mode not in ("auto", "off"):
            raise ValueError(f"fused_ops must be 'auto' or 'off', got {mode!r}")
        ops = load_fused_ops() if mode == "auto" and self.device.type == "cpu" else None
        self.model.use_fused_ops(ops)
        return ops is not None
