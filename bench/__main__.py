"""``python -m bench engine|router ...`` (same as ``talaria bench ...``)."""

from __future__ import annotations

import argparse
import sys

from bench.cli import add_cli
from bench.workloads.traces import TraceNotFound


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_cli(sub)
    args = p.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    try:
        return int(args.fn(args) or 0)
    except TraceNotFound as e:  # a missing public trace: one line naming the file and its source, no traceback
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
