"""``talaria bench engine`` / ``talaria bench router`` (registered by ``talaria.cli`` when importable)."""

from __future__ import annotations

import argparse


def _common(p: argparse.ArgumentParser, default_model: str, default_repeats: int) -> None:
    p.add_argument("--models-dir", help="checkpoints directory (default: .talaria/bench-models, synthesized if missing)")
    p.add_argument("--model", default=default_model, help=f"model name under --models-dir (default {default_model})")
    p.add_argument("--repeats", type=int, default=default_repeats, help=f"repetitions; medians are reported (default {default_repeats})")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")


def _engine(args) -> int:
    from bench.engine_bench import main

    return main(args)


def _router(args) -> int:
    from bench.router_bench import main

    return main(args)


def _placement(args) -> int:
    from bench.router_policy_bench import main

    return main(args)


def _kvstore(args) -> int:
    from bench.kvstore_bench import main

    return main(args)


def _auth(args) -> int:
    from bench.auth_bench import main

    return main(args)


def add_cli(subparsers) -> None:

    b = subparsers.add_parser("bench", help="benchmarks: ratios vs baselines measured side by side in one run")
    bs = b.add_subparsers(dest="bench_cmd", required=True)

    e = bs.add_parser("engine", help="decode throughput: our Engine vs Hugging Face transformers generate()")
    _common(e, "small-llama", 5)
    e.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    e.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence (default 64)")
    e.add_argument("--new-tokens", type=int, default=64, help="generated tokens per sequence (default 64)")
    e.add_argument("--threads", type=int, default=1,
                   help="torch threads for both sides (default 1: robust on a shared machine; 0 = torch's default)")
    e.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/compute dtype of both sides (default float32; auto = bf16 where the device computes it natively)")
    e.add_argument("--device", default="cpu", help="torch device of both sides (default cpu; e.g. cuda:0)")
    e.add_argument("--compile", default="off", choices=["off", "auto", "on"],
                   help="our engine's compile mode (engine config `compile`; default off)")
    e.add_argument("--deterministic", action="store_true",
                   help="also run our engine in the deterministic mode (engine config `deterministic`), interleaved with the "
                        "default one, and report its decode tok/s and batch prefill time against it (bf16 only)")
    e.set_defaults(fn=_engine)

    r = bs.add_parser("router", help="per-call latency: in-process Engine vs NATS to an engine process vs router HTTP API")
    _common(r, "tiny-llama", 3)
    r.add_argument("--max-tokens", type=int, nargs="+", default=[1, 16], help="max_tokens values (default 1 16)")
    r.add_argument("--calls", type=int, default=30, help="sequential calls per path per repetition (default 30)")
    r.add_argument("--warmup", type=int, default=3, help="warm-up calls per path (default 3)")
    r.add_argument("--block", type=int, default=10, help="calls per path in a row before the next path's turn (default 10)")
    r.add_argument("--prompt-len", type=int, default=12, help="prompt tokens (default 12, under one KV page)")
    r.add_argument("--stream-interval-ms", type=float, default=0.0,
                   help="the engine's stream_interval_ms (streaming calls: tokens after the first wait up to this long to share a message; default 0 = a message per step)")
    r.set_defaults(fn=_router)

    k = bs.add_parser("kvstore", help="restore a prefix from the host KV store vs recompute it; restore vs Mooncake TCP vs memcpy bandwidth")
    _common(k, "tiny-llama", 3)
    k.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384], help="prefix lengths in tokens (default 1024 4096 16384)")
    k.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    k.add_argument("--device", default="cpu", help="torch device of the engine (default cpu; e.g. cuda:0)")
    k.set_defaults(fn=_kvstore)


    au = bs.add_parser("auth", help="issue 17: per-call cost of API keys and resume tokens (p50, vs off, one run); tenant salting vs prefix hits")
    au.add_argument("--models-dir", help="checkpoints directory (default: .talaria/bench-models, synthesized if missing)")
    au.add_argument("--model", default="tiny-llama", help="model of the prefix-hit part (default tiny-llama)")
    au.add_argument("--calls", type=int, default=300, help="HTTP calls per configuration (default 300)")
    au.add_argument("--warmup", type=int, default=20, help="warm-up calls per configuration (default 20)")
    au.add_argument("--no-hits", action="store_true", help="skip the prefix-hit part (no model needed)")
    au.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    au.set_defaults(fn=_auth)

    sw = bs.add_parser("switch", help="cold-pool switch latency by load path (full staged / partial / host only) vs a full engine reload")
    _common(sw, "small-llama", 3)
    sw.add_argument("--from", dest="src", default="tiny-llama", help="model active before each measured switch (default tiny-llama)")
    sw.add_argument("--switches", type=int, default=10, help="measured switches per path per repetition (default 10)")
    sw.add_argument("--chunk-kb", type=int, default=4096, help="weight chunk size in KiB (default 4096)")
    sw.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's default)")
    sw.add_argument("--device", default="cpu", help="torch device of the engine (default cpu; e.g. cuda:0)")
    sw.set_defaults(fn=lambda a: __import__("bench.switch_bench", fromlist=["main"]).main(a))

    from bench.peer import add_args as _peer_args

    pe = bs.add_parser("peer", help="the same workloads on Talaria and another OpenAI-compatible server (e.g. vLLM-CPU), interleaved: TTFT, decode tok/s, agent-session SCT")
    _peer_args(pe)
    pe.set_defaults(fn=lambda a: __import__("bench.peer", fromlist=["main"]).main(a))

    from bench.router_policy_bench import add_args as _placement_args

    pl = bs.add_parser("placement", help="router policies side by side (SIMULATION: real policy code, virtual clock), tau sweep, decision cost")
    _placement_args(pl)
    pl.set_defaults(fn=_placement)

    sp = bs.add_parser("sp", help="session-prefill on a real cold engine: Talaria vs no-SP vs Round-only (TTFT of returns, SCT)")
    sp.add_argument("--models-dir", help="checkpoints directory (default: .talaria/bench-models, synthesized if missing)")
    sp.add_argument("--sessions", type=int, default=9, help="agent sessions over the three models (default 9)")
    sp.add_argument("--depth", type=int, default=4, help="calls per session (default 4)")
    sp.add_argument("--repeats", type=int, default=3, help="repetitions, configs in alternating order; medians (default 3)")
    sp.add_argument("--seed", type=int, default=0, help="replay seed")
    sp.add_argument("--ttft", type=float, default=2.0, help="T_TTFT target, seconds (default 2.0)")
    sp.add_argument("--tpot", type=float, default=0.1, help="T_TPOT target, seconds (default 0.1)")
    sp.add_argument("--gamma", type=float, default=0.8, help="round bound margin (default 0.8)")
    sp.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    sp.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    sp.set_defaults(fn=lambda a: __import__("bench.sp_bench", fromlist=["main"]).main(a))

    from bench.coldpool_bench import add_args as _coldpool_args

    cp = bs.add_parser("coldpool", help="issue 16 on a real cold engine: streaming hot-swap vs load-all (cold first-call TTFT), token deadlines vs rounds (SLO attainment)")
    _coldpool_args(cp)
    cp.set_defaults(fn=lambda a: __import__("bench.coldpool_bench", fromlist=["main"]).main(a))

    # issue 8: fixed replay and the configuration matrix
    from bench.matrix import add_args as _matrix_args
    from bench.replay import add_args as _replay_args

    rp = bs.add_parser("replay", help="closed-loop fixed replay of a workload against a running stack: SCT, schedule-aware TTFT, report")
    _replay_args(rp)
    rp.set_defaults(fn=lambda a: __import__("bench.replay", fromlist=["main"]).main(a))
    mx = bs.add_parser("matrix", help="the paper's ablations and router policies side by side: one local stack per configuration, same workload")
    _matrix_args(mx)
    mx.set_defaults(fn=lambda a: __import__("bench.matrix", fromlist=["main"]).main(a))
    from bench.call_diff import add_args as _call_diff_args

    cd = bs.add_parser("call-diff", help="two runs of one workload joined call by call: where A beat B, by placement outcome and latency component")
    _call_diff_args(cd)
    cd.set_defaults(fn=lambda a: __import__("bench.call_diff", fromlist=["main"]).main(a))
    from bench.profile_bench import add_args as _profile_args

    pf = bs.add_parser("profile", help="measure a simulator profile (talaria-profile/1) from a real engine here")
    _profile_args(pf)
    pf.set_defaults(fn=lambda a: __import__("bench.profile_bench", fromlist=["main"]).main(a))
