"""The arena: one device buffer per instance, allocated once (Talaria §4.2, "bump-managed HBM layout").

Layout (byte offsets into the buffer)::

    0 ........ weights_end | kv_start ............ kv_end | runtime_start ...... capacity
    [ weights of the active model ][ KV pool (the gap)     ][ runtime buffers (anchored high) ]

* Weights grow up from offset 0; a switch only moves the ``weights_end`` bump pointer.
* Runtime buffers are anchored at the high end and have a fixed size, so their base address does not
  depend on which model is active.
* The KV pool is whatever lies between (``kv_start`` is ``weights_end`` rounded up to ``ALIGN``).

Tensors handed out by ``view``/``bytes`` are views of the one buffer: nothing is allocated or freed on a
switch. ``plan`` is the check, ``set_weights`` the commit; both raise :class:`ArenaBudgetError` (naming the
model and the bytes) when the model's weights plus the runtime region plus ``min_kv_bytes`` do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.api import ExecutorError

ALIGN = 512  # bytes; every region and every tensor view starts on this boundary


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class ArenaBudgetError(ExecutorError, MemoryError):
    """A model does not fit in the arena."""

    status = 507
    code = "insufficient_memory"

    def __init__(self, model: str, needed: int, capacity: int, detail: str = "") -> None:
        self.model, self.needed, self.capacity = model, needed, capacity
        super().__init__(
            f"model {model!r} needs {needed} bytes ({needed / 2**20:.1f} MiB{', ' + detail if detail else ''}) "
            f"but the arena has {capacity} bytes ({capacity / 2**20:.1f} MiB)"
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the regions are for one active model (offsets into the arena)."""

    model: str
    weights_end: int
    kv_start: int
    kv_end: int  # == runtime_start
    capacity: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_end - self.kv_start

    @property
    def runtime_start(self) -> int:
        return self.kv_end


class Arena:
    def __init__(
        self,
        capacity_bytes: int,
        device: str | torch.device = "cpu",
        *,
        runtime_bytes: int = 0,
        min_kv_bytes: int = 0,
    ) -> None:
        capacity_bytes = (int(capacity_bytes) // ALIGN) * ALIGN
        if capacity_bytes <= 0:
            raise ValueError(f"arena capacity must be positive, got {capacity_bytes}")
        self.device = torch.device(device)
        self.capacity = capacity_bytes
        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)  # the only allocation
        self.buffer.zero_()  # touch every page now, so no switch pays first-touch faults
        self.min_kv_bytes = int(min_kv_bytes)
        self._runtime_bytes = 0
        self.layout: Layout | None = None
        self.set_runtime_bytes(runtime_bytes)

    # ------------------------------------------------------------------ regions
    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    @property
    def runtime_bytes(self) -> int:
        return self._runtime_bytes

    @property
    def runtime_start(self) -> int:
        return self.capacity - self._runtime_bytes

    def set_runtime_bytes(self, n: int) -> None:
        """Resize the runtime region (its base address moves: cached runtime state must be rebuilt)."""
        n = align_up(int(n)) if n else 0
        wend = self.layout.weights_end if self.layout else 0
        if align_up(wend) + self.min_kv_bytes + n > self.capacity:
            raise ArenaBudgetError("<runtime>", align_up(wend) + self.min_kv_bytes + n, self.capacity, "runtime region")
        self._runtime_bytes = n
        if self.layout is not None:
            self.layout = self._layout(self.layout.model, self.layout.weights_end)

    def _layout(self, model: str, weight_bytes: int) -> Layout:
        kv_start = align_up(weight_bytes)
        return Layout(model, weight_bytes, kv_start, self.runtime_start, self.capacity)

    def plan(self, model: str, weight_bytes: int) -> Layout:
        """The layout ``model`` would get (check only). Raises ArenaBudgetError when it does not fit."""
        need = align_up(weight_bytes) + self.min_kv_bytes + self._runtime_bytes
        if need > self.capacity:
            raise ArenaBudgetError(
                model, need, self.capacity,
                f"weights {weight_bytes} + min KV {self.min_kv_bytes} + runtime {self._runtime_bytes}",
            )
        return self._layout(model, weight_bytes)

    def set_weights(self, model: str, weight_bytes: int) -> Layout:
        """Commit: move the weights bump pointer for ``model``; the KV region becomes the new gap."""
        self.layout = self.plan(model, weight_bytes)
        return self.layout

    def clear_weights(self) -> None:
        self.layout = None

    # ------------------------------------------------------------------ views
    def bytes(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.capacity:
            raise IndexError(f"arena range [{start}, {end}) outside [0, {self.capacity})")
        return self.buffer[start:end]

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"offset {offset} is not aligned for {dtype}")
        return self.bytes(offset, offset + nbytes).view(dtype).view(shape)

    def base_addresses(self) -> dict[str, int]:
        """Absolute base addresses of the regions (what cached runtime state points into)."""
        lay = self.layout
        return {
            "weights": self.base,
            "kv": self.base + (lay.kv_start if lay else 0),
            "runtime": self.base + self.runtime_start,
        }

    def check(self) -> None:
        """Assert the regions are ordered and inside the budget."""
        assert self.buffer.numel() == self.capacity
        lay = self.layout
        assert 0 <= self.runtime_start <= self.capacity
        if lay is not None:
            assert 0 <= lay.weights_end <= lay.kv_start <= lay.kv_end == self.runtime_start <= self.capacity
            assert lay.kv_bytes >= self.min_kv_bytes
