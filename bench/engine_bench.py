"""``talaria bench engine``: decode throughput of Talaria's ``Engine`` vs Hugging Face ``generate()``.

What is measured
    Both implementations load the same synthesized checkpoint (default ``small-llama``) in the same dtype
    (``--dtype``, default float32; ``auto`` = the engine's choice, bf16 on AVX512-BF16/AMX CPUs) on the
    same device (``--device``, default cpu), in this one process, with the same torch thread count (default 1: on a small shared machine a
    multi-threaded torch loses most of its time to other processes' load at every parallel region, which
    makes the comparison meaningless; ``--threads 0`` keeps torch's default). For each batch size (default 1 and 8)
    they generate greedily from the same prompts (``batch`` random token sequences of ``prompt_len``
    tokens, all the same length, so HF needs no padding) exactly ``new_tokens`` tokens each, EOS ignored:

    * ours: ``SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)``, requests added with
      ``add_request`` and driven with ``step()`` (the whole batch is prefilled in one step:
      ``max_num_batched_tokens >= batch * prompt_len``). The prefix cache is flushed before every run so
      no run reuses KV from an earlier one (HF has no cross-call cache either).
    * HF: ``model.generate(do_sample=False, max_new_tokens=N, eos_token_id=None)`` with an all-ones
      attention mask and a timing streamer (a ``BaseStreamer`` that only records ``perf_counter()`` at
      every ``put``: the first put is the prompt, the second the first generated token).

    Two rates per run:

    * end to end: ``batch * new_tokens / (t_done - t_start)``, prefill included;
    * decode only: ``batch * (new_tokens - 1) / (t_done - t_first_token)``, where ``t_first_token`` is
      when every sequence of the batch has its first generated token (ours: end of the prefill step; HF:
      the streamer's second ``put``).

How it is reported
    Each implementation is warmed up once per batch size, then the two run alternately ``repeats`` times
    (default 5: ours, HF, ours, HF, ...) so that noise on a shared machine hits both alike. The table shows the
    median tok/s of each side and the median of the per-repetition ratios ours/HF (> 1: ours is faster).
    The greedy tokens of the two are compared (fraction of identical sequences and of identical tokens):
    a sanity check, not a gate (fp32 batched arithmetic may legitimately flip a near-tie).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from bench import emit, ensure_models, format_table, median

DEFAULT_MODEL = "small-llama"


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1000 + batch)
    lo = 3  # skip the special tokens (<|endoftext|>, <|im_start|>, <|im_end|>)
    return [[rng.randrange(lo, vocab) for _ in range(prompt_len)] for _ in range(batch)]


class _TimingStreamer:
    """A ``transformers`` streamer that records when each ``put`` happens (and nothing else)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:  # noqa: ANN001 - torch tensor
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _run_ours(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> dict[str, Any]:
    from services.engine.types import EngineRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    engine.flush_cache()
    ids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(EngineRequest(rid, list(p), sp))
    pending = set(ids)
    t_first = None
    while pending:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                pending.discard(out.request_id)
        if t_first is None and all(tokens[r] for r in ids):
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return {"tokens": [tokens[r] for r in ids], "t_total": t1 - t0, "t_decode": t1 - (t_first or t1)}


def _run_hf(hf, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    import torch

    dev = hf.device
    ids = torch.tensor(prompts, dtype=torch.int64, device=dev)
    streamer = _TimingStreamer()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,  # EOS not special (as ignore_eos on our side); min_new_tokens would mask it instead
            pad_token_id=0,
            streamer=streamer,
        )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
    # times[0]: prompt, times[1]: first generated token (after prefill), times[-1]: last token.
    t_first = streamer.times[1] if len(streamer.times) > 1 else t1
    return {"tokens": out[:, ids.shape[1]:].tolist(), "t_total": t1 - t0, "t_decode": t1 - t_first}


def _rates(r: dict[str, Any], batch: int, new_tokens: int) -> tuple[float, float]:
    total = batch * new_tokens / r["t_total"]
    dec = batch * (new_tokens - 1) / r["t_decode"] if new_tokens > 1 and r["t_decode"] > 0 else float("nan")
    return total, dec


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    seqs = sum(x == y for x, y in zip(a, b)) / len(a)
    n = sum(len(x) for x in a)
    toks = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)) / n if n else 1.0
    return seqs, toks


def run_engine_bench(
    models_dir: str | Path | None = None,
    model: str = DEFAULT_MODEL,
    batches: tuple[int, ...] | list[int] = (1, 8),
    prompt_len: int = 64,
    new_tokens: int = 64,
    repeats: int = 5,
    threads: int | None = 1,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    compile_mode: str = "off",
    deterministic: bool = False,
    say=print,
) -> dict[str, Any]:
    import torch
    import transformers

    from services.engine.executor import Engine

    if repeats < 1 or new_tokens < 1 or prompt_len < 1:
        raise ValueError("repeats, new_tokens and prompt_len must be >= 1")
    mdir = ensure_models(models_dir, [model], say=say)
    path = mdir / model
    prev_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        n_threads = torch.get_num_threads()
        from services.engine.model.loader import engine_dtype

        torch_dtype = engine_dtype(dtype, device)
        dtype_name = str(torch_dtype).removeprefix("torch.")
        say(f"loading {model} from {path} ({dtype_name}, {device}, {n_threads} torch threads) ...")
        engine_kw = dict(device=device, dtype=torch_dtype, model_id=model, max_num_seqs=max(32, max(batches)),
                         max_num_batched_tokens=max(512, max(batches) * prompt_len))
        engine = Engine(path, compile_mode=compile_mode, **engine_kw)
        if compile_mode != "off":
            say(engine.runner.compile_verdict)
        # on CUDA the decode graphs (model/cuda_graphs.py) are measured against the same engine run eagerly
        eager = None
        if engine.runner.decode_graphs is not None:
            eager = Engine(path, cuda_graphs="off", **engine_kw)
        # the deterministic mode (engine config ``deterministic``) measured against this default engine, interleaved
        det = Engine(path, deterministic=True, **engine_kw) if deterministic else None
        transformers.utils.logging.disable_progress_bar()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
        vocab = engine.vocab_size
        rows: list[dict[str, Any]] = []
        for b in batches:
            prompts = _prompts(b, prompt_len, vocab, seed)
            _run_ours(engine, prompts, new_tokens, f"warm{b}")  # warm-up
            _run_hf(hf, prompts, new_tokens)
            if eager is not None:
                _run_ours(eager, prompts, new_tokens, f"ewarm{b}")
            if det is not None:
                _run_ours(det, prompts, new_tokens, f"dwarm{b}")
            det_d, det_ratio, det_prefill, def_prefill, det_same = [], [], [], [], []
            ours_t, hf_t, ours_d, hf_d, ratio_t, ratio_d = [], [], [], [], [], []
            eager_d, graph_ratio, graph_same = [], [], []
            agree_seq, agree_tok = [], []
            for rep in range(repeats):
                o = _run_ours(engine, prompts, new_tokens, f"b{b}r{rep}")
                h = _run_hf(hf, prompts, new_tokens)
                ot, od = _rates(o, b, new_tokens)
                if eager is not None:
                    e = _run_ours(eager, prompts, new_tokens, f"e{b}r{rep}")
                    eager_d.append(_rates(e, b, new_tokens)[1])
                    graph_ratio.append(od / eager_d[-1])
                    graph_same.append(_agreement(o["tokens"], e["tokens"])[0])
                if det is not None:
                    d = _run_ours(det, prompts, new_tokens, f"d{b}r{rep}")
                    det_d.append(_rates(d, b, new_tokens)[1])
                    det_ratio.append(det_d[-1] / od)
                    det_prefill.append(d["t_total"] - d["t_decode"])
                    def_prefill.append(o["t_total"] - o["t_decode"])
                    det_same.append(_agreement(o["tokens"], d["tokens"])[0])
                ht, hd = _rates(h, b, new_tokens)
                for xs, x in ((ours_t, ot), (hf_t, ht), (ours_d, od), (hf_d, hd), (ratio_t, ot / ht), (ratio_d, od / hd)):
                    xs.append(x)
                same_seqs, same_toks = _agreement(o["tokens"], h["tokens"])
                agree_seq.append(same_seqs)
                agree_tok.append(same_toks)
            row = {
                "batch": b,
                "ours_tok_s": median(ours_t),
                "hf_tok_s": median(hf_t),
                "ratio": median(ratio_t),
                "ours_decode_tok_s": median(ours_d),
                "hf_decode_tok_s": median(hf_d),
                "decode_ratio": median(ratio_d),
                "identical_seqs": min(agree_seq),
                "identical_tokens": min(agree_tok),
                "eager_decode_tok_s": median(eager_d) if eager_d else None,
                "graphs_vs_eager": median(graph_ratio) if graph_ratio else None,
                "graphs_identical_seqs": min(graph_same) if graph_same else None,
                "det_decode_tok_s": median(det_d) if det_d else None,
                "det_vs_default_decode": median(det_ratio) if det_ratio else None,
                "det_prefill_s": median(det_prefill) if det_prefill else None,
                "default_prefill_s": median(def_prefill) if def_prefill else None,
                "det_identical_seqs": min(det_same) if det_same else None,
                "runs": {"ours_tok_s": ours_t, "hf_tok_s": hf_t, "ours_decode_tok_s": ours_d, "hf_decode_tok_s": hf_d},
            }
            rows.append(row)
            say(f"  batch {b}: ours {row['ours_tok_s']:.1f} tok/s, HF {row['hf_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}")
    finally:
        torch.set_num_threads(prev_threads)
    return {
        "bench": "engine",
        "model": model,
        "models_dir": str(mdir),
        "dtype": dtype_name,
        "device": device,
        "compile": compile_mode,
        "cuda_graphs": engine.runner.decode_graphs is not None,
        "torch_threads": n_threads,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    head = (
        f"engine bench: {result['model']} {result['dtype']} {result['device']} (both sides; ours compile={result.get('compile', 'off')}), {result['torch_threads']} torch threads, prompt {result['prompt_len']} "
        f"+ {result['new_tokens']} new tokens, greedy, EOS ignored; median of {result['repeats']} "
        f"(transformers {result['transformers']}, torch {result['torch']})"
    )
    t1 = format_table(
        ["batch", "ours tok/s", "HF tok/s", "ours/HF", "ours decode tok/s", "HF decode tok/s", "decode ours/HF"],
        [[r["batch"], r["ours_tok_s"], r["hf_tok_s"], r["ratio"], r["ours_decode_tok_s"], r["hf_decode_tok_s"], r["decode_ratio"]]
         for r in result["rows"]],
    )
    t2 = format_table(
        ["batch", "identical seqs", "identical tokens"],
        [[r["batch"], f"{r['identical_seqs']:.0%}", f"{r['identical_tokens']:.1%}"] for r in result["rows"]],
    )
    graphs = [r for r in result["rows"] if r.get("graphs_vs_eager") is not None]
    t3 = "" if not graphs else "\n\ndecode CUDA graphs vs the same engine eager\n" + format_table(
        ["batch", "graphs decode tok/s", "eager decode tok/s", "graphs/eager", "identical seqs"],
        [[r["batch"], r["ours_decode_tok_s"], r["eager_decode_tok_s"], r["graphs_vs_eager"],
          f"{r['graphs_identical_seqs']:.0%}"] for r in graphs])
    dets = [r for r in result["rows"] if r.get("det_decode_tok_s") is not None]
    t3 += "" if not dets else "\n\ndeterministic mode vs the default engine (interleaved; prefill = time to every first token)\n" + format_table(
        ["batch", "det decode tok/s", "default decode tok/s", "det/default", "det prefill s", "default prefill s", "identical seqs"],
        [[r["batch"], r["det_decode_tok_s"], r["ours_decode_tok_s"], r["det_vs_default_decode"], r["det_prefill_s"],
          r["default_prefill_s"], f"{r['det_identical_seqs']:.0%}"] for r in dets])
    return f"{head}\n\nthroughput (tok/s = generated tokens / wall time; end to end incl. prefill, and decode only)\n{t1}\n\ngreedy agreement ours vs HF (sanity, not a gate)\n{t2}{t3}"


def main(args) -> int:
    result = run_engine_bench(
        models_dir=args.models_dir,
        model=args.model or DEFAULT_MODEL,
        batches=args.batch,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        compile_mode=getattr(args, "compile", "off"),
        deterministic=getattr(args, "deterministic", False),
    )
    return emit(result, render(result), args.json)
