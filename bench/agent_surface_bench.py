"""Issue 13 measurements, ratios in one run:

1. decode tokens/s with a ``json_schema`` constraint vs unconstrained, same prompts, batch 1 and 8
   (in-process executor, so NATS and HTTP do not blur the per-token cost);
2. tool-call parse accuracy on a fixed corpus per format (well-formed calls found, plain text never a call);
3. ``cached_tokens`` share across a 10-turn tool-calling session through the whole stack (router, NATS,
   engine) with ``tool_choice="required"`` and the real model.

Run: ``.venv/bin/python -m bench.agent_surface_bench [--model-dir .talaria/models/smollm2-135m-instruct]``.
Prints JSON lines; the load average is printed beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}}, "required": ["answer", "score"]}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up in the dictionary",
        "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 24}}, "required": ["word"], "additionalProperties": False}}}


def loadavg() -> str:
    return open("/proc/loadavg").read().split(" ")[0:3].__str__()


def decode_cost(model_dir: Path, tokens: int, repeats: int) -> list[dict]:
    from services.engine.executor import Engine
    from services.engine.grammar import GrammarFactory
    from services.engine.types import EngineRequest, SamplingParams

    eng = Engine(model_dir, max_num_seqs=8, dtype="float32")
    fac = GrammarFactory(eng.tokenizer, eng.vocab_size, list(eng.eos_token_ids))
    grammar = fac.compile("json_schema", json.dumps(SCHEMA))
    prompt = eng.encode_chat([{"role": "user", "content": "Describe a river in JSON."}])
    out = []
    for batch in (1, 8):
        row = {"batch": batch}
        for name, g in (("free", None), ("json_schema", grammar)):
            best = None
            for r in range(repeats):
                sp = [SamplingParams(temperature=1.0, seed=i + 100 * r, max_tokens=tokens, ignore_eos=g is None, grammar=g) for i in range(batch)]
                ids = [f"{name}-{batch}-{r}-{i}" for i in range(batch)]
                for rid, p in zip(ids, sp):
                    eng.add_request(EngineRequest(rid, list(prompt), p))
                pending, first = set(ids), True
                while pending:  # the first step prefills every prompt: decode steps only are timed
                    t_step = time.perf_counter()
                    outs = eng.step()
                    dt = time.perf_counter() - t_step
                    if not first:
                        best = best or [0.0, 0]
                        best[0] += dt
                        best[1] += sum(len(o.new_token_ids) for o in outs)
                    first = False
                    for o in outs:
                        if o.finished:
                            pending.discard(o.request_id)
            row[f"{name}_tok_s"] = round(best[1] / best[0], 1) if best and best[0] else None
            row[f"{name}_tokens"] = best[1] if best else 0
        row["cost_ratio"] = round(row["free_tok_s"] / row["json_schema_tok_s"], 3) if row.get("json_schema_tok_s") else None
        out.append(row)
    return out


def mask_overhead(model_dir: Path, iters: int = 40) -> list[dict]:
    """Sampler time per step with every row constrained vs none (min over ``iters``), on the real vocabulary:
    the grammar's added cost per decode step, robust to machine load (min of repeated short timings)."""
    import torch

    from services.engine.grammar import GrammarFactory
    from services.engine.sampling import Sampler
    from talaria.tokenizer import Tokenizer
    from services.engine.types import SamplingParams

    tok = Tokenizer.from_dir(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammar = GrammarFactory(tok, vocab, list(tok.eos_token_ids)).compile("json_schema", json.dumps(SCHEMA))
    rows = []
    for batch in (1, 8):
        res = {}
        for name, g in (("free", None), ("json_schema", grammar)):
            best = float("inf")
            for it in range(iters):
                s = Sampler()
                params = [SamplingParams(temperature=1.0, seed=i, grammar=g) for i in range(batch)]
                ids = [f"r{i}" for i in range(batch)]
                for rid, p in zip(ids, params):
                    s.add(rid, p)
                logits = torch.randn(batch, vocab)
                t0 = time.perf_counter()
                s.sample(logits, ids, params)
                best = min(best, time.perf_counter() - t0)
            res[name] = best
        rows.append({"batch": batch, "sample_free_ms": round(res["free"] * 1e3, 3), "sample_json_schema_ms": round(res["json_schema"] * 1e3, 3),
                     "added_ms_per_step": round((res["json_schema"] - res["free"]) * 1e3, 3)})
    return rows


def parse_accuracy() -> list[dict]:
    from talaria.tool_parsers import parse, render_call

    rng = random.Random(13)
    args = [{}, {"city": "Paris"}, {"q": "braces { } [x] \"q\""}, {"n": [1, 2.5, None, True], "o": {"k": "v"}}, {"t": "日本 🙂"}]
    plain = ["The capital of France is Paris.", "{\"a\": 1}", "Use <tool> or [TOOL] words.", "def f():\n    return {'name': 1}", "", "I will call lookup later."]
    rows = []
    for fmt in ("hermes", "llama3_json", "mistral"):
        ok = total = 0
        for i in range(200):
            calls = [(rng.choice(["lookup", "search", "get_weather"]), rng.choice(args)) for _ in range(1 + i % 3)]
            if fmt == "hermes":
                text = "\n".join(render_call({"function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}) for n, a in calls)
            elif fmt == "llama3_json":
                text = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
            else:
                text = "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
            got = [(c.name, json.loads(c.arguments)) for c in parse(fmt, text).tool_calls]
            ok += got == calls
            total += 1
        fp = sum(bool(parse(fmt, t).tool_calls) for t in plain)
        rows.append({"format": fmt, "well_formed_parsed": f"{ok}/{total}", "false_positives": f"{fp}/{len(plain)}"})
    return rows


def session_cache_share(model_dir: Path, turns: int, system_rules: int = 0) -> dict:
    import openai

    from talaria.config import parse_config
    from talaria.up import LocalStack

    cfg = parse_config({"namespace": f"b{os.getpid()}", "models_dir": str(model_dir.parent), "synthesize_models": False,
                        "kvstore": {"enabled": False}, "router": {"port": 0, "max_tokens_limit": 512},
                        "engines": [{"id": "b0", "models": [model_dir.name], "kv_cache_mb": 256}]})
    with LocalStack(cfg, say=lambda _m: None, quiet=True) as stack:
        deadline = time.monotonic() + 120
        client = openai.OpenAI(base_url=f"{stack.api}/v1", api_key="x", max_retries=0, timeout=120)
        while time.monotonic() < deadline:
            try:
                client.models.retrieve(model_dir.name)
                break
            except Exception:  # noqa: BLE001 - not ready yet
                time.sleep(0.5)
        system = "You are a careful dictionary assistant. " + " ".join(f"Rule {i}: use the lookup tool for every word, never guess." for i in range(system_rules))
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Look up the words river, mountain, forest and more, one at a time."}]
        shares, covered, prev = [], 0, None
        for t in range(turns):
            r = client.chat.completions.create(model=model_dir.name, messages=msgs, tools=[TOOL], tool_choice="required", max_tokens=48,
                                               temperature=0, extra_body={"session_id": "bench-tools"})
            u = r.usage
            first_prompt = u.prompt_tokens if t == 0 else first_prompt
            if t:
                shares.append(u.prompt_tokens_details.cached_tokens / u.prompt_tokens)
                covered += u.prompt_tokens_details.cached_tokens >= prev.prompt_tokens + prev.completion_tokens - 1
            prev = u
            call = r.choices[0].message.tool_calls[0]
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": f"definition {t}: a word."}]
        return {"turns": turns, "system_rules": system_rules, "first_prompt_tokens": first_prompt, "turns_reusing_all_previous_tokens": f"{covered}/{turns - 1}",
                "min_share_after_first": round(min(shares), 4), "mean_share_after_first": round(sum(shares) / len(shares), 4),
                "turns_at_or_above_95pct": f"{sum(s >= 0.95 for s in shares)}/{len(shares)}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agent_surface_bench")
    p.add_argument("--model-dir", default=".talaria/models/smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-rules", type=int, nargs="+", default=[0, 40], help="system prompt sizes (rules) for the session run")
    p.add_argument("--skip", nargs="*", default=[], choices=["decode", "mask", "parse", "session"])
    a = p.parse_args(argv)
    md = Path(a.model_dir)
    print(json.dumps({"loadavg_start": loadavg(), "model": md.name}))
    if "parse" not in a.skip:
        for row in parse_accuracy():
            print(json.dumps({"parse": row}))
    if "mask" not in a.skip:
        for row in mask_overhead(md):
            print(json.dumps({"mask": row, "loadavg": loadavg()}))
    if "decode" not in a.skip:
        for row in decode_cost(md, a.tokens, a.repeats):
            print(json.dumps({"decode": row, "loadavg": loadavg()}))
    if "session" not in a.skip:
        for rules in a.system_rules:
            print(json.dumps({"session": session_cache_share(md, a.turns, rules), "loadavg": loadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
