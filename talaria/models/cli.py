"""``talaria models ...`` subcommands; the main CLI calls :func:`add_cli` with its subparsers."""

from __future__ import annotations

import argparse
import os
import sys


def _cmd_synth(args: argparse.Namespace) -> int:
    from .synth import synthesize, synthesize_scripted

    if args.scripted:
        print(synthesize_scripted(args.out, args.reasoning, args.content, seed=args.seed, name=args.scripted))
        return 0
    paths = synthesize(args.out, seed=args.seed, names=args.only or None)
    for p in paths:
        print(p)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from .synth import MODEL_SPECS

    for name, s in MODEL_SPECS.items():
        print(
            f"{name:<14} {s.architecture:<20} layers={s.num_hidden_layers} hidden={s.hidden_size} "
            f"heads={s.num_attention_heads}/{s.num_key_value_heads} head_dim={s.hd}  {s.description}"
        )
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from .importer import ImportError_, import_model

    out = args.out or os.environ.get("TALARIA_MODELS_DIR") or ".talaria/models"
    try:
        path = import_model(args.src, out, name=args.name, gguf_file=args.gguf_file, force=args.force, dtype=args.dtype)
    except ImportError_ as e:
        print(f"talaria models import: {e}", file=sys.stderr)
        return 2
    print(f"imported {path} (serve it: talaria serve {path})")
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``models synth --out DIR [--seed N] [--only NAME ...]`` and ``models list``.

    Each leaf parser sets ``fn`` (``fn(args) -> int`` exit code) via ``set_defaults``, the attribute
    ``talaria.cli.main`` dispatches on.
    """
    from .synth import SCRIPT_CONTENT, SCRIPT_REASONING

    models = subparsers.add_parser("models", help="synthesize / list small test checkpoints")
    sub = models.add_subparsers(dest="models_command", required=True)

    synth = sub.add_parser("synth", help="write small random-weight HF checkpoints with a trained BPE tokenizer")
    synth.add_argument("--out", required=True, help="output directory (one subdirectory per model)")
    synth.add_argument("--seed", type=int, default=0, help="weights seed (same seed => identical files)")
    synth.add_argument("--only", nargs="+", metavar="NAME", help="synthesize only these models")
    synth.add_argument("--scripted", metavar="NAME", help="instead: one reasoning model NAME (thinking chat template) whose greedy "
                       "output is --reasoning, </think>, --content, end of turn (talaria/models/synth.py synthesize_scripted)")
    synth.add_argument("--reasoning", default=SCRIPT_REASONING, help="--scripted: the reasoning text (each token at most once)")
    synth.add_argument("--content", default=SCRIPT_CONTENT, help="--scripted: the answer text (each token at most once)")
    synth.set_defaults(fn=_cmd_synth)

    lst = sub.add_parser("list", help="list the models the synthesizer knows")
    lst.set_defaults(fn=_cmd_list)

    imp = sub.add_parser("import", help="a GGUF file or Hugging Face checkpoint directory -> a served checkpoint")
    imp.add_argument("src", help="a .gguf file, a directory with one, a Hugging Face checkpoint directory, or a known "
                     "package's model: 'smollm2', 'gemma3-270m' (opt-in package, Gemma terms; the error says how to install it)")
    imp.add_argument("--out", help="models directory (default $TALARIA_MODELS_DIR or .talaria/models)")
    imp.add_argument("--name", help="served model name (default: from the source)")
    imp.add_argument("--gguf-file", help="which GGUF file of a directory holding several")
    imp.add_argument("--force", action="store_true", help="replace an existing checkpoint of that name")
    imp.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                     help="dtype of a GGUF's dequantized weights (float32: exactly the GGUF's values; default bfloat16)")
    imp.set_defaults(fn=_cmd_import)
    return models


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m talaria.models.cli``), for use before the main CLI exists."""
    parser = argparse.ArgumentParser(prog="talaria")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
