"""Executor cost profiles for the simulator (``talaria-profile/1`` YAML).

A profile says what the *mechanisms* cost — the simulator's executor charges these, the policies only see
what they learn from it (EWMA through ``observe_step``/``observe_switch`` and the heartbeat's cost profile),
exactly as on a real engine. Every number in a profile file may be written plain or as
``{value: X, cite: "where it comes from"}``; ``profiles/paper-tp8.yaml`` cites every number.

Cost model (per model unless stated):

* prefill of ``n`` new tokens on top of ``c`` cached ones: ``k * ((c + n)**p - c**p)`` seconds (a power
  law fitted to two published points, Talaria §2.1: 25K tokens in 4.3 s, 100K in 10.9 s; ``p = 1`` is
  linear);
* decode step: ``base + per_seq * batch + per_ctx_token * total context of the batch``;
* restore from host KV: ``restore_per_token * tokens``;
* switch (Talaria App. D, five phases): phases 1, 3, 4, 5 fixed; phase 2 (open weights) interpolates
  between its D2D and H2D costs by the staged fraction of the target (§3.5, §5.6); weight bytes are
  staged at the host-to-device rate the H2D phase implies;
* sizes: weights (GiB), KV bytes per token, the instance's HBM and arena fraction, host KV capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GIB = 1 << 30
FORMAT = "talaria-profile/1"


class ProfileError(ValueError):
    pass


def unwrap(node: Any) -> Any:
    """Strip ``{value, cite}`` wrappers recursively."""
    if isinstance(node, dict):
        if "value" in node and set(node) <= {"value", "cite", "note"}:
            return node["value"]
        return {k: unwrap(v) for k, v in node.items()}
    if isinstance(node, list):
        return [unwrap(v) for v in node]
    return node


def uncited(node: Any, path: str = "") -> list[str]:
    """Paths of numbers in a raw profile that carry no ``cite`` (the paper profile must have none)."""
    out: list[str] = []
    if isinstance(node, dict):
        if "value" in node and set(node) <= {"value", "cite", "note"}:
            return [] if str(node.get("cite", "")).strip() else [path]
        for k, v in node.items():
            out += uncited(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += uncited(v, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        out.append(path)
    return out


@dataclass(frozen=True, slots=True)
class ModelCosts:
    name: str
    weights_gib: float
    kv_bytes_per_token: int
    prefill_k: float
    prefill_p: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    restore_per_token_s: float
    # compute seconds per token of checkpointing a finished call's KV to the host store, where the copies run on
    # the serving cores (a CPU engine: D2H memcpy + the store's transfer on the same cores); 0 on a GPU, where
    # the D2H copy is an asynchronous DMA (Talaria §4.3) and costs no compute
    checkpoint_per_token_s: float = 0.0

    def prefill_s(self, cached: int, new: int) -> float:
        """Seconds to prefill ``new`` tokens on top of ``cached`` ones (mutates nothing)."""
        if new <= 0:
            return 0.0
        return self.prefill_k * ((cached + new) ** self.prefill_p - cached**self.prefill_p)

    def prefill_per_token_at(self, tokens: int) -> float:
        """Mean cost per token of a full prefill of ``tokens`` (the scalar the policies' profiles use)."""
        return self.prefill_s(0, max(1, tokens)) / max(1, tokens)

    def decode_s(self, batch: int, context: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * context

    @property
    def weight_bytes(self) -> int:
        return int(self.weights_gib * GIB)


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    save_teardown_s: float
    open_d2d_s: float
    open_h2d_s: float
    restore_kv_shell_s: float
    restore_runtime_s: float
    publish_s: float

    def phases(self, staged_fraction: float) -> tuple[float, float, float, float, float]:
        f = min(1.0, max(0.0, staged_fraction))
        p2 = f * self.open_d2d_s + (1.0 - f) * self.open_h2d_s
        return (self.save_teardown_s, p2, self.restore_kv_shell_s, self.restore_runtime_s, self.publish_s)

    def total(self, staged_fraction: float) -> float:
        return sum(self.phases(staged_fraction))


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    hbm_gib: float
    arena_fraction: float
    host_kv_gib: float
    page_tokens: int
    max_batched_tokens: int
    switch: SwitchCosts
    models: dict[str, ModelCosts]
    default: ModelCosts
    source: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, Any] = field(default_factory=dict)  # knobs the profile's setting used: SlotPolicy / PolicyParams fields, and layer_groups (streaming hot-swap)

    def model(self, name: str) -> ModelCosts:
        return self.models.get(name) or ModelCosts(name, *[getattr(self.default, f) for f in _MODEL_FIELDS])

    @property
    def arena_bytes(self) -> int:
        return int(self.hbm_gib * self.arena_fraction * GIB)

    def h2d_bytes_per_s(self, model: str) -> float:
        """Weight staging rate: the H2D open phase moves the whole model."""
        return self.model(model).weight_bytes / max(1e-9, self.switch.open_h2d_s)

    def to_dict(self) -> dict[str, Any]:
        def m(c: ModelCosts) -> dict[str, Any]:
            return {f: getattr(c, f) for f in _MODEL_FIELDS}

        return {
            "format": FORMAT, "name": self.name, "source": self.source,
            "instance": {"hbm_gib": self.hbm_gib, "arena_fraction": self.arena_fraction, "host_kv_gib": self.host_kv_gib,
                         "page_tokens": self.page_tokens, "max_batched_tokens": self.max_batched_tokens},
            "switch": {f: getattr(self.switch, f) for f in SwitchCosts.__slots__},
            "default_model": m(self.default),
            "models": {k: m(v) for k, v in self.models.items()},
            "knobs": dict(self.knobs),
        }


_REQUIRED_MODEL_FIELDS = (
    "weights_gib", "kv_bytes_per_token", "prefill_k", "prefill_p", "decode_base_s", "decode_per_seq_s",
    "decode_per_ctx_token_s", "restore_per_token_s",
)
_OPTIONAL_MODEL_FIELDS = {"checkpoint_per_token_s": 0.0}
_MODEL_FIELDS = (*_REQUIRED_MODEL_FIELDS, *_OPTIONAL_MODEL_FIELDS)


def _model(name: str, d: dict[str, Any], base: dict[str, Any]) -> ModelCosts:
    merged = {**_OPTIONAL_MODEL_FIELDS, **base, **d}
    if "prefill_k" not in merged and "prefill_per_token_s" in merged:
        merged["prefill_k"], merged["prefill_p"] = merged.pop("prefill_per_token_s"), 1.0
    merged.pop("prefill_per_token_s", None)
    missing = [f for f in _MODEL_FIELDS if f not in merged]
    if missing:
        raise ProfileError(f"model {name!r}: missing {missing}")
    unknown = set(merged) - set(_MODEL_FIELDS)
    if unknown:
        raise ProfileError(f"model {name!r}: unknown fields {sorted(unknown)}")
    vals = {f: float(merged[f]) for f in _MODEL_FIELDS}
    vals["kv_bytes_per_token"] = int(vals["kv_bytes_per_token"])
    if vals["prefill_k"] <= 0 or not 0 < vals["prefill_p"] <= 2:
        raise ProfileError(f"model {name!r}: prefill_k must be > 0 and prefill_p in (0, 2]")
    return ModelCosts(name, **vals)


def from_dict(raw: dict[str, Any]) -> Profile:
    if raw.get("format") != FORMAT:
        raise ProfileError(f"not a {FORMAT} profile (format: {raw.get('format')!r})")
    d = unwrap(raw)
    inst, sw = d.get("instance") or {}, d.get("switch") or {}
    base = d.get("default_model") or {}
    try:
        switch = SwitchCosts(**{f: float(sw[f]) for f in SwitchCosts.__slots__})
        default = _model("default", {}, base) if base else None
        models = {k: _model(k, v or {}, base) for k, v in (d.get("models") or {}).items()}
        if default is None:
            if not models:
                raise ProfileError("a profile needs default_model or models")
            default = next(iter(models.values()))
        p = Profile(
            name=str(d.get("name", "")), hbm_gib=float(inst["hbm_gib"]), arena_fraction=float(inst.get("arena_fraction", 0.9)),
            host_kv_gib=float(inst["host_kv_gib"]), page_tokens=int(inst.get("page_tokens", 256)),
            max_batched_tokens=int(inst.get("max_batched_tokens", 8192)), switch=switch, models=models, default=default,
            source=d.get("source") or {}, knobs=d.get("knobs") or {},
        )
    except KeyError as e:
        raise ProfileError(f"profile lacks {e.args[0]!r}") from None
    if p.page_tokens < 1 or p.max_batched_tokens < 1 or not 0 < p.arena_fraction <= 1:
        raise ProfileError("page_tokens, max_batched_tokens must be >= 1 and arena_fraction in (0, 1]")
    return p


def load(path: str | Path) -> Profile:
    with open(path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: not a mapping")
    return from_dict(raw)


def fit_power(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of ``t = k * n**p`` in log space over (tokens, seconds) points (>= 2)."""
    pts = [(math.log(n), math.log(t)) for n, t in points if n > 0 and t > 0]
    if len(pts) < 2:
        raise ProfileError("need two prefill measurements to fit the prefill curve")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    p = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else 1.0
    p = min(2.0, max(0.3, p))
    return math.exp(my - p * mx), p
