"""Where the public trace files are: one resolver for every reader (bench replays, the simulator, tests).

The two public traces the importers read are not part of this repository (``data/traces/README.md`` says
where to get them). A reader asks :func:`trace_path` for a trace; the file is found by the first rule that
names a location:

1. an explicit path (a command-line flag such as ``--miniswe FILE``, or a ``path=`` argument) wins;
2. else the directory in the environment variable ``TALARIA_TRACES_DIR``, holding the trace under its
   usual file name;
3. else the repository's own ``data/traces/`` directory, under the same name.

A file that is not there raises :class:`TraceNotFound`, whose one-line message names the file, where it comes
from, and how to point at it; the command-line entry points print that line instead of a traceback.
Reads the environment (only when called), never the file itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "TALARIA_TRACES_DIR"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"  # the repository's data/traces/


@dataclass(frozen=True, slots=True)
class Trace:
    """A public trace: its file name in a traces directory, where it comes from, the flag that names it."""

    name: str
    source: str
    flag: str


MINISWE = Trace(
    "lmcache_miniswe_trace.jsonl.gz",
    "LMCache/lmcache-agent-trace miniswe/*.jsonl at commit 271d1c02f97d68de6b500bcd9c9b25730b1d4b7f, the 20 files "
    "joined in file-name order and gzipped, Apache-2.0",
    "--miniswe",
)
MOONCAKE = Trace(
    "mooncake_synthetic_trace.jsonl",
    "kvcache-ai/Mooncake FAST25-release/traces/synthetic_trace.jsonl at commit 3b5a594133958449a1feaf1c9e0fc1b553e34a28, Apache-2.0",
    "--mooncake",
)


class TraceNotFound(FileNotFoundError):
    """A trace file is missing; ``str()`` is one line: the file, its source, and how to point at it."""


def trace_dir(env: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """The directory traces are looked up in when no explicit path is given, and which rule chose it."""
    env = os.environ if env is None else env
    d = env.get(ENV_VAR)
    return (Path(d), f"${ENV_VAR}") if d else (DEFAULT_DIR, "the default data/traces/")


def trace_path(trace: Trace, explicit: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The path of ``trace``: ``explicit`` if given, else ``$TALARIA_TRACES_DIR/<name>``, else
    ``data/traces/<name>``. Raises :class:`TraceNotFound` when that file does not exist."""
    if explicit:
        p, rule = Path(explicit), trace.flag
    else:
        d, rule = trace_dir(env)
        p = d / trace.name
    if not p.is_file():
        raise TraceNotFound(
            f"trace file not found: {p} (from {rule}); it is {trace.name} from {trace.source}; download it, then pass "
            f"{trace.flag} FILE, or put it in {DEFAULT_DIR}, or set ${ENV_VAR} to the directory holding it; see data/traces/README.md")
    return p
