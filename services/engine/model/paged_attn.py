"""Paged decode attention for the CPU: a small C++ kernel (``paged_attn.cpp``) reading K/V in place.

Design note
-----------
What it computes: for each sequence ``b`` (one query token, at position ``n - 1`` with ``n =
context_lens[b]``) and query head ``h``, ``softmax(scale * q[b, h] . K_j) @ V_j`` over the keys ``j`` it may
see (``n - 1 - window < j < n`` with a window, else ``0 <= j < n``), where row ``j`` lives at pool slot
``block_tables[b][j // page_size] * page_size + j % page_size``. The same function the gather + SDPA decode
path of ``llama.Attention._attend`` computes, without that path's per-layer copy.

Why: the gather path copies every sequence's whole context K and V out of the pool into a padded
``[B, KVH, Lmax, D]`` tensor per layer and then runs SDPA with a key-padding mask, which with GQA reads
each KV head once per query head sharing it. At batch 8 and ~2,000-token contexts that was about half of a
SmolLM2-135M bf16 decode step. Reading the pool in place through the block table is PagedAttention's
idea (Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP'23: attention over non-contiguous KV blocks); the row-at-a-time float accumulation with a
max-subtracted softmax follows FlashAttention's (Dao et al., NeurIPS'22) point that attention is bound by
reads of K/V, so each K/V row should be read once. Here each (sequence, kv head) task reads its rows once
for all ``G = H / KVH`` query heads sharing them (scores for G heads per K row), in two passes over a float
score buffer (scores, then weighted V sum), float32 throughout; bf16 converts by a 16-bit shift. Tasks run
in parallel with ``at::parallel_for`` (torch's intra-op threads). Code written from scratch for this repo.

Two refinements (the agent sessions' long contexts):

* **Vectorized scores** (head dim 64, float32 or bf16, G <= 6, a CPU with AVX-512; bf16 also needs
  AVX512_BF16): the 16 K rows of a page run give 16 row-wise product vectors, summed together by one
  transpose-add tree instead of 16 horizontal sums; bf16 rows multiply as bf16 pairs with fp32 accumulation
  (the products are exact, as after a conversion); the G x 64 V accumulators stay in registers for the
  whole chunk. Other shapes and CPUs take the portable loops (same results up to rounding).
* **Head dim 256** (Gemma 3: 4 query heads on 1 kv head, most layers windowed): an AVX-512 body of the same
  scheme for wide heads (``chunk_avx512_wide``): the G query rows and their G x 16 V accumulators do not fit
  in registers, so each run of <= 16 K rows re-loads the query rows from L1 and the V sum runs per 64-dim
  quarter with its accumulators loaded from and stored to the task's part once per run. A window only moves
  the first visible key (``visible``): a windowed layer reads its last ``window`` keys and nothing older.
* **Split context** (flash-decoding's split-K, Dao et al., 2023): with fewer than two (sequence, kv head)
  tasks per thread (batch 1 with 3 kv heads on 2 threads left one thread idle a third of the time), each
  task's keys are split into chunks of at least 256 keys, ~4 tasks per thread; each chunk keeps its max
  score, its sum of exps and its weighted V sum, and the chunks of a task are merged by rescaling to the
  common max.

Measured (old kernel vs this one, side by side in one process; SmolLM2-135M shapes, 2 threads, quiet
machine, 2026-12-03): one layer, bf16, batch 1 / 8 at 2,048 keys 127 -> 53 us / 954 -> 488 us; a whole
SmolLM2 bf16 decode step at ~2,000-token contexts 26.9 -> 24.1 ms (batch 1), 61.4 -> 49.7 ms (batch 8).

* **All kv heads in one task** (2026-12-05): where the pool's rows hold the kv heads back to back
  (the engine's pools) and the AVX-512 body applies, a task is (sequence, chunk of keys) and reads each run's
  K rows, then its V rows, whole: the KVH heads one after the other while the run's rows are in cache, the
  next run's whole rows prefetched. Per-head tasks each read 128 of every 384 bytes (SmolLM2: 3 kv heads x
  64 dims x bf16), and out of cache that pattern read the pool at 7-10 GB/s. The numbers above were one
  layer called repeatedly, whose K/V (11 MB at batch 8 x 1,800 keys) stay in this CPU's 32 MB L3: 30 GB/s
  there, while a decode step reads 30 layers' K/V once each, from memory (``python -m bench.paged_attn_bench
  --mode layer`` now rotates through ``--layers`` pools, default 30). Side by side, old / new, two
  interleaved runs, load 1.2-1.6, bf16, 2 threads, 30 layers rotated: batch 8 at 1,800 keys 1,137 / 1,351
  -> 949 / 959 us (8.2-9.7 -> 11.5-11.7 GB/s), at 512 keys 328 / 376 -> 264 / 283 us; batch 1 at 1,800 keys
  157 / 198 -> 167 / 134 us (a tie within the spread). A whole SmolLM2 bf16 decode step at batch 8 x ~1,800
  keys (``Engine.step``, two alternations): attention 23.3 / 23.8 -> 21.9 / 22.4 ms, the step 39.9 -> 37.5
  ms. What remains is not the memory bound: the kernel is ~26 cycles per (key, kv head) from cache (the
  scores, one exp per score and the bf16 -> fp32 V conversion), ~370 us a layer at batch 8 x 1,800 keys
  against ~350 us to read its K/V at 32 GB/s, and out of cache the two add up rather than overlap.
  Other layouts (padded rows) keep the per-head tasks (both tested, ``tests/unit/test_paged_attn.py``).

* **Fixed split** (``split_keys`` > 0, the engine's deterministic mode): chunk ``c`` of a query is its visible
  keys ``[j0 + c * split_keys, j0 + (c + 1) * split_keys)``, whatever the batch size and the thread count, so a
  query's sums and their merge happen in one order that depends on its own keys only (batch- and
  thread-invariant; ``llama._invariant_group`` runs prefill rows through it too). ``0`` keeps the adaptive split.
Build: JIT with ``torch.utils.cpp_extension.load`` on first use (:func:`load_extension`; the same
extension carries the fused elementwise ops of ``fused_ops.cpp``, see ``fused_ops.py``), cached in torch's
extension directory (a rebuild only when a source or the flags change). ``-O3 -march=native``; the extension
name carries a hash of the CPU's flags so a cache shared by another CPU is not loaded, and one of the sources and
their directory so two checkouts (or versions) never build over each other's cache. Builds and loads of one cache directory are
serialized by a ``flock`` (:func:`_build_guard`), which also clears the lock file a killed build leaves behind
(torch would otherwise wait on it forever). Needs a C++ compiler
and ``ninja`` (the PyPI package, a runtime requirement: its ``bin`` directory is put on ``PATH`` for the
build). If the build or load fails, one warning is logged and :func:`load_kernel` returns ``None``: the
model keeps its gather + SDPA path (and its eager elementwise ops). A JIT build that has no cached result logs
one progress line first (a build is ~1-2 min on 2 cores: never silent).

Prebuilt kernels (images, machines without a compiler): ``talaria kernels build --out DIR`` compiles the same
extension ahead of time into ``DIR`` for the CPU baseline :data:`BASELINE_MARCH` and, with ``--march native``,
for the building CPU. :func:`load_extension` first looks in ``$TALARIA_KERNELS_DIR`` (the image sets it) for a
build for this exact CPU (``native``, tagged with the CPU's flag hash), then for the baseline when the CPU has
its instruction set, and only then JIT-builds (which needs a compiler: a container has none, so it never
compiles at start). The baseline build lacks the AVX-512 paths (prefill attention and the decode GEMM need
AVX-512 BF16 and report ``off``); the paged decode kernel and the fused ops run on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(n) for n in ("paged_attn.cpp", "fused_ops.cpp", "prefill_attn.cpp", "decode_gemm.cpp")]  # one extension (fused_ops.py, prefill_attn.py, decode_gemm.py)
_HEADERS = [Path(__file__).with_name("cpu_math.h")]  # included by the sources: part of the cache name's hash
# OpenMP: at::parallel_for's threads (torch's libgomp); 512-bit vectors for the loops the compiler vectorizes
# (GCC's default is 256 on AVX-512 CPUs: fused SiLU*up at 512 rows 465 -> 242 us, 2 threads). Part of the
# cache name's hash, like the sources.
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
# The CPU baseline of prebuilt kernels (images): x86-64-v3 = AVX2, FMA, F16C, BMI1/2, MOVBE (Intel Haswell,
# AMD Zen 1 and later). The flags /proc/cpuinfo must show for a baseline build to be loaded on a CPU.
BASELINE_MARCH = "x86-64-v3"
_BASELINE_CPU_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse4_2", "popcnt"})
KERNELS_DIR_ENV = "TALARIA_KERNELS_DIR"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the loaded extension or None once tried

PagedDecodeFn = Callable[..., torch.Tensor]


def _cpu_flags_line() -> str:
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags (``-march=native`` code is only valid on such a CPU)."""
    return hashlib.sha1(_cpu_flags_line().encode()).hexdigest()[:8]


def cpu_has_baseline() -> bool:
    """Whether this CPU runs code built for :data:`BASELINE_MARCH` (its flags in ``/proc/cpuinfo``). Reads only."""
    flags = set(_cpu_flags_line().partition(":")[2].split())
    return _BASELINE_CPU_FLAGS <= flags


def _cflags(march: str) -> list[str]:
    return ["-O3", f"-march={march}", *_CFLAGS[2:]]


def prebuilt_name(march: str) -> str:
    """The module name of a prebuilt extension for ``march`` (``native``: tagged with this CPU's flag hash, valid
    on such a CPU only): it carries a hash of the sources and flags but not of their directory, so a build made
    at image build time is found by the same installed sources at run time."""
    h = hashlib.sha1()
    for p in (*_SOURCES, *_HEADERS):
        h.update(p.read_bytes())
    h.update(" ".join(_cflags(march)).encode())
    variant = f"native_{_cpu_tag()}" if march == "native" else march.replace("-", "_")
    return f"talaria_kernels_{variant}_{h.hexdigest()[:8]}"


def build_prebuilt(out: Path, march: str = BASELINE_MARCH, verbose: bool = False) -> Path:
    """Compile the extension for ``march`` into ``out/<prebuilt_name>/`` (creates it) and return the ``.so``
    path. Needs a C++ compiler and ninja; raises on a failed build."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    name = prebuilt_name(march)
    build_dir = Path(out) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_guard(build_dir):
        cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=_cflags(march),
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=verbose)
    return build_dir / f"{name}.so"


def _import_so(name: str, so: Path):
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_prebuilt():
    """The prebuilt extension from ``$TALARIA_KERNELS_DIR`` for this CPU (the ``native`` build made on a CPU
    with the same flags, else the baseline build where the CPU has its instruction set), or ``None``. Sets
    ``_state["variant"]``."""
    kdir = os.environ.get(KERNELS_DIR_ENV)
    if not kdir:
        return None
    marches = ["native"] + ([BASELINE_MARCH] if cpu_has_baseline() else [])
    for march in marches:
        name = prebuilt_name(march)
        so = Path(kdir) / name / f"{name}.so"
        if so.exists():
            module = _import_so(name, so)
            _state["variant"] = f"prebuilt {march}"
            log.info("CPU kernels: prebuilt %s build from %s", march, so.parent)
            return module
    log.warning("no prebuilt CPU kernels in %s for this CPU (looked for: %s)", kdir, ", ".join(marches))
    return None


def _source_tag() -> str:
    """A short hash of the sources and where they are: checkouts (worktrees, versions) build into different
    cache directories instead of rebuilding over each other's extension. The directory counts even for
    identical sources: torch's build file names the sources by absolute path, so a second checkout would
    rewrite it and ninja would rebuild (~1 min on 2 cores) every time the other checkout loaded it."""
    h = hashlib.sha1()
    for p in (*_SOURCES, *_HEADERS):
        h.update(p.read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(str(_SOURCES[0].resolve().parent).encode())
    return h.hexdigest()[:8]


def _ninja_on_path() -> None:
    """Put the ``ninja`` PyPI package's binary directory on ``PATH`` (mutates ``os.environ``) if it is not."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path


@contextlib.contextmanager
def _build_guard(build_dir: Path):
    """Hold an exclusive ``flock`` on ``<build dir>/talaria-build.flock`` for one build-or-load of the
    extension, and inside it remove torch's own build lock (``<build dir>/lock``) if one is there.

    Why: torch's ``FileBaton`` lock is a plain file created with ``O_EXCL``; a build that is killed (a test
    run stopped, an engine restarted mid-compile) leaves it behind and every later load polls for it
    forever. Every process that builds this extension goes through this guard, and the kernel drops a
    ``flock`` when its holder exits however it exits, so whoever holds the guard knows no live build owns a
    ``lock`` file it finds: that file is an orphan (mutates the extension cache directory)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "talaria-build.flock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # another process's build: wait for it, it ends or dies
        try:
            orphan = build_dir / "lock"
            if orphan.exists():
                log.warning("removing an extension build lock left by a killed build: %s", orphan)
                orphan.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build():
    """The extension: a prebuilt one (:func:`_load_prebuilt`) or a JIT ``-march=native`` build in torch's
    extension cache, announced by one progress line when there is no cached build to reuse."""
    module = _load_prebuilt()
    if module is not None:
        return module
    from torch.utils import cpp_extension

    _ninja_on_path()
    name = f"talaria_paged_attn_{_cpu_tag()}_{_source_tag()}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    _state["variant"] = "jit native"
    with _build_guard(build_dir):
        if not (build_dir / f"{name}.so").exists():
            log.warning("building the CPU kernels for this CPU (-march=native) into %s: once per CPU and version, "
                        "~1-2 min on 2 cores (`talaria kernels build` does it ahead of time)", build_dir)
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def load_extension() -> Any:
    """The compiled extension module (``paged_attn.cpp`` + ``fused_ops.cpp``), built on the first call (may
    take tens of seconds; later calls and processes reuse torch's extension cache), or ``None`` if it cannot
    be built or loaded (one warning logged, once per process). Thread-safe."""
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _build()
            except Exception as e:  # no compiler, no ninja, a failed compile: the eager paths stay
                _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                log.warning("CPU kernels unavailable (%s: %s); decode keeps gather + SDPA, layers keep eager ops",
                            type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
                _state["module"] = None
        return _state["module"]


def variant() -> str:
    """Which build :func:`load_extension` loaded (``prebuilt native``, ``prebuilt x86-64-v3``, ``jit native``),
    "" before it was tried or when it failed. Reads only."""
    with _lock:
        return str(_state.get("variant", "")) if _state.get("module") is not None else ""


def build_error() -> str:
    """Why :func:`load_extension` returned ``None`` ("" if it has not been tried or it loaded). Reads only."""
    with _lock:
        return str(_state.get("error", ""))


def load_kernel() -> PagedDecodeFn | None:
    """The compiled :func:`paged_decode_attention` kernel (:func:`load_extension`), or ``None``."""
    module = load_extension()
    return None if module is None else module.paged_decode_attention


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, page_size: int, scale: float, window: int = 0,
                           split_keys: int = 0) -> torch.Tensor:
    """``[B, H, D]`` decode attention of ``q`` (one token per sequence) over the paged pools ``[S, KVH, D]``
    through ``block_tables`` (int32 ``[B, pages]``) and ``context_lens`` (int32 ``[B]``); ``window`` > 0
    shows only the last ``window`` keys; ``split_keys`` > 0 (a multiple of 16) splits every query's keys into
    fixed chunks of that many (batch- and thread-invariant results), 0 adaptively. Output in ``q``'s dtype;
    reads only, writes nothing but the result. Raises ``RuntimeError`` if the kernel cannot be built."""
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("paged decode attention kernel unavailable (see the warning logged)")
    return kernel(q, k_pool, v_pool, block_tables, context_lens, page_size, scale, window, split_keys)
