"""The CPU paged decode attention kernel (services/engine/model/paged_attn.py) against gather + SDPA, and an
engine with it against an engine without it (greedy tokens equal). A build failure fails (tests/unit/kernel_fixtures.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from services.engine.executor import Engine
from services.engine.model.paged_attn import load_kernel
from services.engine.types import SamplingParams
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture
from tests.unit.kernel_fixtures import require_extension

PAGE = 16
LENS = (1, 15, 16, 17, 1000)


@pytest.fixture(scope="module")
def kernel():
    require_extension()  # the build (first run: tens of seconds) happens here, outside any timing; a failed build fails
    return load_kernel()


def _pool(lens, kvh, d, dtype, seed):
    """Pools with every sequence's pages scattered (a random permutation of the pool's pages)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lens]
    num_pages = sum(need) + 5
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    k = torch.randn(num_pages * PAGE, kvh, d, generator=g).to(dtype)
    v = torch.randn(num_pages * PAGE, kvh, d, generator=g).to(dtype)
    width = max(need)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k, v, tables, table


def _reference(q, k, v, tables, lens, scale, window):
    """Gather + SDPA in float32, one sequence at a time (keys j visible iff n - 1 - window < j < n)."""
    out = []
    H, kvh = q.shape[1], k.shape[1]
    for b, n in enumerate(lens):
        start = max(0, n - window) if window else 0
        slots = torch.tensor([tables[b][j // PAGE] * PAGE + j % PAGE for j in range(start, n)])
        kc = k.index_select(0, slots).float().transpose(0, 1).repeat_interleave(H // kvh, 0)  # [H, m, D]
        vc = v.index_select(0, slots).float().transpose(0, 1).repeat_interleave(H // kvh, 0)
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None], kc, vc, scale=scale)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("rows", ["whole", "padded"])
def test_kernel_matches_gather_sdpa(kernel, dtype, atol, heads, kv_heads, window, rows):
    """``whole``: the pool's rows hold the kv heads back to back (the engine's pools): every head of a sequence
    in one task where the CPU has AVX-512 (``all_heads_avx512_d64``); ``padded``: rows with a gap after the
    heads (views of a wider tensor): one task per (sequence, kv head)."""
    D = 64
    k, v, tables, table = _pool(LENS, kv_heads, D, dtype, seed=heads * 10 + window)
    if rows == "padded":
        wide_k, wide_v = torch.zeros(k.shape[0], kv_heads + 1, D, dtype=dtype), torch.zeros(k.shape[0], kv_heads + 1, D, dtype=dtype)
        wide_k[:, :kv_heads], wide_v[:, :kv_heads] = k, v
        k, v = wide_k[:, :kv_heads], wide_v[:, :kv_heads]
        assert k.stride(0) == (kv_heads + 1) * D and k.stride(2) == 1
    q = torch.randn(len(LENS), heads, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    lens = torch.tensor(LENS, dtype=torch.int32)
    out = kernel(q, k, v, table, lens, PAGE, D**-0.5, window)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, k, v, tables, LENS, D**-0.5, window)
    err = (out.float() - ref).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"
    if window:  # the window changed the answer for the long sequences (the test can tell the two apart)
        full = _reference(q, k, v, tables, LENS, D**-0.5, 0)
        assert (full - ref).abs().max().item() > 10 * atol


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 2), (7, 1)])
@pytest.mark.parametrize("window", [0, 20, 512])
def test_head_dim_256_windowed_matches_gather_sdpa(kernel, dtype, atol, heads, kv_heads, window):
    """Gemma 3's attention shape (head dim 256, 4 query heads on 1 kv head, a 512-key window on most layers):
    the AVX-512 wide-head body for G <= 6 (fp32, bf16 with AVX512_BF16), the portable loops otherwise (G = 7,
    fp16), one kv head's task per sequence and split contexts alike."""
    D = 256
    k, v, tables, table = _pool(LENS, kv_heads, D, dtype, seed=heads + window)
    q = torch.randn(len(LENS), heads, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    for sub in ([0, 1, 2, 3, 4], [4]):  # batch 5, and the 1,000-key sequence alone (its context split)
        lens = [LENS[i] for i in sub]
        out = kernel(q[sub], k, v, table[sub], torch.tensor(lens, dtype=torch.int32), PAGE, D**-0.5, window)
        ref = _reference(q[sub], k, v, [tables[i] for i in sub], lens, D**-0.5, window)
        assert (out.float() - ref).abs().max().item() <= atol, (sub, window)
    if window:
        full = _reference(q, k, v, tables, LENS, D**-0.5, 0)
        assert (full - _reference(q, k, v, tables, LENS, D**-0.5, window)).abs().max().item() > 10 * atol


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2)])
def test_context_split_over_threads_matches_gather_sdpa(kernel, dtype, atol, heads, kv_heads):
    """Few (sequence, kv head) tasks for the threads: each task's keys are split into chunks merged by
    rescaling (batch 1 at 4 threads: 6 chunks of a 2,100-key context; the short ones stay whole); G = 7
    takes the portable path, G = 3 the vectorized one where the CPU has it."""
    lens = (2100, 40)
    D = 64
    k, v, tables, table = _pool(lens, kv_heads, D, dtype, seed=7)
    q = torch.randn(len(lens), heads, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for sub in (slice(0, 1), slice(1, 2), slice(0, 2)):
            for window in (0, 700):
                out = kernel(q[sub], k, v, table[sub], torch.tensor(lens[sub], dtype=torch.int32), PAGE, D**-0.5, window)
                ref = _reference(q[sub], k, v, tables[sub], lens[sub], D**-0.5, window)
                assert (out.float() - ref).abs().max().item() <= atol, (sub, window)
    finally:
        torch.set_num_threads(n)


def test_strided_query_and_odd_head_dim(kernel):
    """A query that is a view of a wider projection (the fused q/k/v layout), and D not a multiple of 16."""
    D, H, KVH = 40, 6, 2
    lens = (3, 33, 70)
    k, v, tables, table = _pool(lens, KVH, D, torch.float32, seed=5)
    wide = torch.randn(len(lens), H + 2 * KVH, D, generator=torch.Generator().manual_seed(2))
    q = wide[:, :H]
    assert not q.is_contiguous()
    out = kernel(q, k, v, table, torch.tensor(lens, dtype=torch.int32), PAGE, 0.3, 0)
    ref = _reference(q.contiguous(), k, v, tables, lens, 0.3, 0)
    assert (out - ref).abs().max().item() <= 2e-5


def test_bad_block_table_is_refused(kernel):
    k, v, tables, table = _pool((20,), 1, 16, torch.float32, seed=3)
    table[0, 1] = k.shape[0] // PAGE  # one past the last page
    q = torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel(q, k, v, table, torch.tensor([20], dtype=torch.int32), PAGE, 0.25, 0)
    with pytest.raises(RuntimeError, match="exceeds"):
        kernel(q, k, v, table[:, :1], torch.tensor([20], dtype=torch.int32), PAGE, 0.25, 0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed_mistral(synth_models, tmp_path_factory):
    """tiny-mistral with a 12-token sliding window (shorter than the prompts)."""
    dst = tmp_path_factory.mktemp("windowed") / "windowed-mistral"
    shutil.copytree(synth_models["tiny-mistral"], dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(sliding_window=12, max_position_embeddings=4096)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "windowed"])
def test_engine_greedy_tokens_equal_with_and_without_kernel(kernel, synth_models, windowed_mistral, name):
    """Batched decodes of ragged prompts (chunked prefill mixed with decodes) give the same greedy tokens
    with the kernel as with ``paged_decode='off'`` (gather + SDPA). float32: in bf16 the two round
    differently (the kernel accumulates in fp32) and these random tiny models have near-tied logits."""
    path = windowed_mistral if name == "windowed" else synth_models[name]
    runs = {}
    for mode in ("auto", "off"):
        eng = Engine(path, dtype=torch.float32, page_size=4, num_pages=256, max_num_batched_tokens=24,
                     paged_decode=mode)
        assert eng.runner.paged_decode == (mode == "auto")
        ps = [eng.tokenizer.encode(f"request {i}: the quick brown fox {'jumps ' * (3 * i)}over the lazy dog")
              for i in range(6)]
        runs[mode] = eng.generate(ps, GREEDY)
        eng.check_integrity()
    assert runs["auto"] == runs["off"]
    assert len({tuple(t) for t in runs["off"]}) > 1  # not a degenerate model


def test_engine_refuses_an_unknown_mode(synth_models):
    with pytest.raises(ValueError, match="paged_decode"):
        Engine(synth_models["tiny-llama"], page_size=4, num_pages=64, paged_decode="on")


def test_a_build_lock_left_by_a_killed_build_is_removed_but_a_live_build_is_waited_for(tmp_path):
    """torch's ``lock`` file outlives a killed build; the guard removes it, but only once no live process
    holds the build ``flock`` (a live build's lock must stay until that build ends)."""
    import subprocess
    import sys
    import threading
    import time as _time

    from services.engine.model.paged_attn import _build_guard

    (tmp_path / "lock").write_text("")  # left by a build that was killed: nobody holds the flock
    with _build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()
    holder = subprocess.Popen(  # a live build: holds the flock and torch's lock until told to finish
        [sys.executable, "-c", (
            "import fcntl, sys, pathlib; d = pathlib.Path(sys.argv[1]); f = open(d / 'talaria-build.flock', 'a+b');"
            "fcntl.flock(f.fileno(), fcntl.LOCK_EX); (d / 'lock').write_text(''); print('held', flush=True);"
            "sys.stdin.readline(); (d / 'lock').unlink()"
        ), str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def waiter():
            with _build_guard(tmp_path):
                entered.set()

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        _time.sleep(0.3)
        assert not entered.is_set() and (tmp_path / "lock").exists()  # waits; the live build's lock stays
        holder.stdin.write("done\n")
        holder.stdin.flush()
        assert entered.wait(10)
        t.join(10)
    finally:
        holder.kill()
        holder.wait()


def test_two_checkouts_of_the_same_sources_build_into_different_cache_directories(tmp_path, monkeypatch):
    """torch's build file names the sources by absolute path: two checkouts sharing one cache directory
    rebuilt each other's extension (~1 min) every time the other loaded it, and the engine learned that
    build as its first switch (issue 12). The cache name hashes the sources' directory as well as their
    bytes; the same checkout keeps its name."""
    import shutil

    from services.engine.model import paged_attn as pa

    def tag_of(root):
        root.mkdir()
        for p in (*pa._SOURCES, *pa._HEADERS):
            shutil.copy(p, root / p.name)
        monkeypatch.setattr(pa, "_SOURCES", [root / p.name for p in pa._SOURCES])
        monkeypatch.setattr(pa, "_HEADERS", [root / p.name for p in pa._HEADERS])
        return pa._source_tag()

    here = pa._source_tag()
    a, b = tag_of(tmp_path / "a"), tag_of(tmp_path / "b")
    assert a != b and here not in (a, b)
    assert tag_of(tmp_path / "c") != b  # and stable per place: the same directory, the same name
    monkeypatch.setattr(pa, "_SOURCES", [tmp_path / "a" / p.name for p in pa._SOURCES])
    monkeypatch.setattr(pa, "_HEADERS", [tmp_path / "a" / p.name for p in pa._HEADERS])
    assert pa._source_tag() == a


def test_prebuilt_kernels_are_found_by_cpu_and_sources_not_by_place(tmp_path, monkeypatch):
    """An image builds the extension ahead of time (``talaria kernels build --out``) from a copy of the sources
    and loads it from the installed ones: the prebuilt name hashes the sources' bytes and flags but not their
    directory. At load, $TALARIA_KERNELS_DIR is searched for this CPU's native build first, then the baseline
    build only where the CPU has the baseline's instruction set; nothing found means the JIT path."""
    import shutil

    from services.engine.model import paged_attn as pa

    names = {m: pa.prebuilt_name(m) for m in ("native", pa.BASELINE_MARCH)}
    copy = tmp_path / "src"
    copy.mkdir()
    for p in (*pa._SOURCES, *pa._HEADERS):
        shutil.copy(p, copy / p.name)
    monkeypatch.setattr(pa, "_SOURCES", [copy / p.name for p in pa._SOURCES])
    monkeypatch.setattr(pa, "_HEADERS", [copy / p.name for p in pa._HEADERS])
    assert {m: pa.prebuilt_name(m) for m in names} == names  # another place, the same names
    (copy / "cpu_math.h").write_text((copy / "cpu_math.h").read_text() + "\n// changed\n")
    assert pa.prebuilt_name(pa.BASELINE_MARCH) != names[pa.BASELINE_MARCH]  # other sources, another build
    monkeypatch.undo()

    kdir = tmp_path / "kernels"
    loaded = []
    monkeypatch.setattr(pa, "_import_so", lambda name, so: loaded.append(name) or name)
    monkeypatch.setenv(pa.KERNELS_DIR_ENV, str(kdir))
    monkeypatch.setattr(pa, "_state", {})
    assert pa._load_prebuilt() is None and not loaded  # an empty directory: JIT (or the fallbacks)
    for m in names.values():
        (kdir / m).mkdir(parents=True)
        (kdir / m / f"{m}.so").write_bytes(b"")
    assert pa._load_prebuilt() == names["native"] and pa._state["variant"] == "prebuilt native"
    shutil.rmtree(kdir / names["native"])
    monkeypatch.setattr(pa, "_cpu_flags_line", lambda: "flags\t: fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe sse4_2 popcnt")
    names = {m: pa.prebuilt_name(m) for m in ("native", pa.BASELINE_MARCH)}  # another CPU: another native name
    assert pa._load_prebuilt() == names[pa.BASELINE_MARCH] and pa._state["variant"] == f"prebuilt {pa.BASELINE_MARCH}"
    monkeypatch.setattr(pa, "_cpu_flags_line", lambda: "flags\t: fpu sse2 avx")  # below the baseline
    loaded.clear()
    assert pa._load_prebuilt() is None and not loaded
    monkeypatch.delenv(pa.KERNELS_DIR_ENV)
    assert pa._load_prebuilt() is None


def test_kernels_build_cli_builds_a_prebuilt_or_refuses_a_foreign_march_for_the_cache(tmp_path, monkeypatch, capsys):
    """`talaria kernels build --out DIR --march M` writes a prebuilt build (what the image does); without --out
    only this CPU's native build makes sense (torch's cache serves this CPU), so another -march is a usage error."""
    from services.engine.model import paged_attn as pa
    from talaria import cli

    calls = []
    monkeypatch.setattr(pa, "build_prebuilt", lambda out, march: calls.append((out, march)) or out / "x.so")
    assert cli.main(["kernels", "build", "--march", "x86-64-v3", "--out", str(tmp_path)]) == 0
    assert calls == [(tmp_path, "x86-64-v3")]
    assert "x86-64-v3" in capsys.readouterr().out
    assert cli.main(["kernels", "build", "--march", "x86-64-v3"]) == 2
    monkeypatch.setattr(pa, "load_extension", lambda: None)
    monkeypatch.setattr(pa, "build_error", lambda: "RuntimeError: no compiler")
    assert cli.main(["kernels", "build"]) == 1 and "no compiler" in capsys.readouterr().err
