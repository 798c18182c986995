"""The rule every CPU-kernel test follows (issue 43 item 4): skip only where the CPU lacks the instruction set
a kernel needs; where it has it, a kernel that did not build is a failure with the build error, never a skip
(a build that silently breaks would otherwise turn the suite green while engines run fallbacks)."""

from __future__ import annotations

from pathlib import Path

import pytest


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def require_extension():
    """The compiled CPU extension; fails the test (with the build error) if it did not build. The portable
    kernels (paged decode, fused ops) need no particular instruction set, so there is nothing to skip for."""
    from services.engine.model.paged_attn import build_error, load_extension

    module = load_extension()
    assert module is not None, f"the CPU extension did not build: {build_error()}"
    return module


def require_isa(*flags: str) -> None:
    """Skip unless this CPU has every one of ``flags``; where it has them, require the extension to build."""
    missing = [f for f in flags if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    require_extension()
