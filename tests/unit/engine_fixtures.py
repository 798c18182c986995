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
