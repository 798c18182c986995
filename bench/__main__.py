"""``python -m bench engine|router ...`` (same as ``talaria bench ...``)."""

from __future__ import annotations

import argparse

from bench.cli import add_cli


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_cli(sub)
    args = p.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
