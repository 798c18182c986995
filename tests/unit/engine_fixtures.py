"""Fixtures shared by the unit modules that run real (tiny) engines. Import by name: ``one_thread`` is then
autouse in the importing module. Not a conftest: the policy-only modules want none of it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is as fast and does not degrade when the CPUs are shared (the
    store's and the tests' own threads get the other core). Restores the thread count after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def stage_fully(ce, target: str) -> None:
    """Stage every chunk of ``target`` in cold engine ``ce`` (its substrate's stager, as the engine's steps
    would), waiting for the asynchronous copies to land; fails if the KV tail cannot hold it."""
    for _ in range(1000):
        ce.substrate.stage(target, 64)
        ce.substrate.area.poll(wait=True)
        if ce.substrate.staged_fraction(target) == 1.0:
            return
    raise AssertionError(f"could not stage {target}: {ce.substrate.staged_fraction(target)}")
