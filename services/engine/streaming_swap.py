"""Partial-layer residency and streaming hot-swap for the cold engine (JointServe §4.4,
``partial_layers``).

Design NOTE.
* A switch copies only a *startup prefix* of the target's layer groups (``substrate/groups.py``) in phase 2
  — together with every group staged on the device, which moves device-to-device — and publishes the model.
  The remaining groups stream host→device through the one :class:`~services.engine.substrate.transfer.
  TransferScheduler` as ``STREAM`` transfers, one per group, while the first prefill runs.
* Per-group readiness: the model's ``layer_gate`` (a two-line hook in the forward) calls :class:`GroupGate`
  before each decoder layer and before the final norm/LM head; the gate blocks until that layer's group copy
  completed, so a group never runs before its own copy (any residual wait is measured and reported as
  ``stall_s``, not assumed away). The first forward needs every group, so decode only ever starts with the
  whole model resident. Once every group is in, the gate detaches itself.
* k* (:func:`startup_prefix`): the smallest prefix such that, copying the later groups back to back from the
  moment compute starts, every group ``j >= k`` lands before compute reaches it:
  ``Σ_{i=k..j} copy_i <= Σ_{i<j} compute_i`` (Appendix C.3's sufficient condition with one channel and aligned
  release). ``copy_i`` = group bytes / the channel's measured rate; ``compute_i`` = the group's measured share
  of a forward × measured prefill seconds per token × the expected prefill tokens (the target's queued calls).
  k* >= 1: group 0 holds the embeddings, which run before any gate.
* Before the next switch releases anything, ``wait()`` (a ``before_kv_release`` barrier) finishes the stream.

Mechanism, not policy: only :func:`startup_prefix` decides, and it is a pure function of measured inputs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from services.engine.substrate.groups import LayerGroup, group_of_layer, layer_groups
from services.engine.substrate.transfer import TrafficClass, TransferScheduler, TransferTicket


def startup_prefix(copy_s: list[float], compute_s: list[float]) -> int:
    """k*: the smallest ``k >= 1`` such that streaming groups ``k..G-1`` back to back never stalls compute
    (``G`` when no shorter prefix works). Pure."""
    n = len(copy_s)
    if n != len(compute_s):
        raise ValueError("copy_s and compute_s need one entry per group")
    for k in range(1, n + 1):
        arrive, start, ok = 0.0, 0.0, True
        for j in range(n):
            if j >= k:
                arrive += copy_s[j]
                if arrive > start + 1e-12:
                    ok = False
                    break
            start += compute_s[j]
        if ok:
            return k
    return n


class GroupGate:
    """``gate(layer)`` blocks until the layer's group is resident. Records per-layer start times (the
    measured compute share of each group), waits, and an event log for tests. Detaches itself from
    ``model`` when every group is in and a whole forward passed."""

    def __init__(self, model_name: str, groups: list[LayerGroup], tickets: dict[int, TransferTicket], n_layers: int,
                 log: list | None = None) -> None:
        self.model_name = model_name
        self.groups = groups
        self.tickets = tickets
        self.n_layers = n_layers
        self.log = log
        self.stall_s = 0.0
        self.layer_t: list[float] = []
        self.module: Any = None

    def __call__(self, layer: int) -> None:
        g = group_of_layer(self.groups, layer)
        t = self.tickets.get(g)
        if t is not None and not t.done():
            t0 = time.perf_counter()
            t.sync()
            self.stall_s += time.perf_counter() - t0
        elif t is not None:
            t.sync()  # re-raise a failed copy
        if self.log is not None:
            self.log.append(("run", self.model_name, g, layer))
        if layer == 0:
            self.layer_t = []
        self.layer_t.append(time.perf_counter())
        if layer == self.n_layers and self.module is not None and all(x.done() for x in self.tickets.values()):
            self.module.layer_gate = None  # the whole model is resident: later steps run ungated

    def done(self) -> bool:
        return all(t.done() for t in self.tickets.values())

    def wait(self) -> None:
        for t in self.tickets.values():
            t.sync()

    def group_shares(self) -> list[float] | None:
        """Each group's share of the last gated forward's layer time (None before one completed)."""
        if len(self.layer_t) != self.n_layers + 1:
            return None
        total = self.layer_t[-1] - self.layer_t[0]
        if total <= 0:
            return None
        out = []
        for g in self.groups:
            lo, hi = g.layers.start, min(g.layers.stop, self.n_layers)
            out.append((self.layer_t[hi] - self.layer_t[lo]) / total)
        return out


class HotSwapStreamer:
    """The substrate's ``streamer`` (see ``MemorySubstrate.open_weights``) plus the cold engine's hooks."""

    def __init__(self, bank, arena_bytes: Callable[[int, int], Any], transfer: TransferScheduler | None = None, *,
                 layers_per_group: int = 1, prefill_per_token: Callable[[str], float] | None = None,
                 expected_tokens: Callable[[str], int] | None = None, log: list | None = None) -> None:
        self.bank = bank
        self.arena_bytes = arena_bytes
        self.transfer = transfer or TransferScheduler(copy_fn=stream_copy)
        self.layers_per_group = layers_per_group
        self.prefill_per_token = prefill_per_token or (lambda m: 1e-4)
        self.expected_tokens = expected_tokens or (lambda m: 64)
        self.log = log
        self.shares: dict[str, list[float]] = {}  # measured per-group compute share, per model
        self.gate: GroupGate | None = None
        self.k: dict[str, int] = {}  # last k* per model
        self.streams = 0
        self.stall_s = 0.0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the decision inputs (measured)
    def plan_k(self, model: str) -> int:
        return self.k_for(model, self.expected_tokens(model))

    def k_for(self, model: str, tokens: int) -> int:
        """k* of ``model`` for a first prefill of ``tokens`` tokens, from the measured channel rate, the
        model's measured per-group compute shares and its measured prefill seconds per token."""
        e = self.bank[model]
        groups = layer_groups(e, self.layers_per_group)
        rate = max(self.transfer.rate.value, 1.0)
        copy = [g.nbytes / rate for g in groups]
        shares = self.shares.get(model) or [1.0 / len(groups)] * len(groups)
        fwd = self.prefill_per_token(model) * max(tokens, 1)
        return startup_prefix(copy, [s * fwd for s in shares])

    # ------------------------------------------------------------------ substrate hooks (phase 2)
    def first_streamed_chunk(self, model: str) -> int | None:
        groups = layer_groups(self.bank[model], self.layers_per_group)
        k = self.k[model] = self.plan_k(model)
        return None if k >= len(groups) else groups[k].chunks.start

    def start(self, model: str, chunks: list[int]) -> None:
        """Queue one STREAM transfer per later group (its chunks not moved device-to-device); the gate is
        attached to the model by :meth:`attach` after publish."""
        e = self.bank[model]
        groups = layer_groups(e, self.layers_per_group)
        by_group: dict[int, list[int]] = {}
        for j in chunks:
            by_group.setdefault(next(g.index for g in groups if j in g.chunks), []).append(j)
        tickets = {}
        for g, js in sorted(by_group.items()):
            items = []
            for j in js:
                lo, hi = e.chunk_range(j)
                items.append((hi - lo, (self.arena_bytes(lo, hi), e.chunk(j), self.log, model, g)))
            tickets[g] = self.transfer.submit(TrafficClass.STREAM, items, f"{model}#g{g}")
        with self._lock:
            self.gate = GroupGate(model, groups, tickets, e.config.num_hidden_layers, self.log)
            self.streams += 1

    # ------------------------------------------------------------------ engine hooks
    def attach(self, model: str, module) -> None:
        """After publish: gate ``module``'s forward on the stream of ``model`` (no-op without one)."""
        g = self.gate
        if g is not None and g.model_name == model and g.module is None:
            g.module = module
            module.layer_gate = g

    def wait(self, _model: str | None = None) -> None:
        """Switch barrier: the stream of the outgoing model completes; its measurements are kept."""
        g = self.gate
        if g is None:
            return
        g.wait()
        shares = g.group_shares()
        if shares is not None:
            self.shares[g.model_name] = shares
        self.stall_s += g.stall_s
        if g.module is not None:
            g.module.layer_gate = None
        self.gate = None

    def snapshot(self) -> dict:
        return {"streams": self.streams, "stall_s": self.stall_s, "k": dict(self.k), "channel_bytes_per_s": self.transfer.rate.value,
                "bytes_by_class": dict(self.transfer.stats.bytes_by_class), "preemptions": self.transfer.stats.preemptions}


def stream_copy(payload) -> None:
    """The transfer scheduler's copy of a stream/stage chunk: ``(dst, src, log, model, group)`` or ``(dst, src)``,
    or a callable (a KV restore's per-layer scatter)."""
    if callable(payload):
        payload()
        return
    dst, src = payload[0], payload[1]
    dst.copy_(src)
    if len(payload) > 2 and payload[2] is not None:
        payload[2].append(("copied", payload[3], payload[4]))
