"""Issue 18 item 7: under mixed load one model (tiny-qwen3, whose KV pages are 3x the bytes of the others')
lost most of its stored sessions. Cause: ``ValuePerByte`` valued a page's recompute cost in tokens but
divided by its bytes, so every page of a model with wider KV looked 3x less valuable and that model's
newest sessions were evicted before older ones of the other models. The fix prices recompute per byte of KV
(prefill work per token grows with the model's KV width x layers, as its KV bytes do): a model's pages are
not worth less per byte because its KV is wider. Pure registry test, virtual clock."""

from __future__ import annotations

from services.kvstore.registry import Family, HostKVRegistry, Layout, ValuePerByte

PAGE = 16
SLAB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _layout(model: str, page_bytes: int) -> Layout:
    return Layout(model, 0, 1, PAGE, "float32", Family.MHA, (2, 2, PAGE, 2, page_bytes // (2 * 2 * PAGE * 2 * 4)), page_bytes)


def _sessions_kept(policy) -> dict[str, int]:
    """Three models store 3-page sessions round-robin (newest last) into a store that holds ~12 of them;
    returns how many of each model's 4 newest sessions are still fully stored."""
    clock = Clock()
    models = {"llama@r": _layout("llama@r", 4096), "qwen2@r": _layout("qwen2@r", 4096), "qwen3@r": _layout("qwen3@r", 12288)}
    r = HostKVRegistry(3 * (4096 + 4096 + 12288) * 4, SLAB, clock=clock, policy=policy)
    sessions: dict[str, list[list[int]]] = {m: [] for m in models}
    h = 0
    for i in range(10):
        for m, lay in models.items():
            clock.t += 1.0
            hashes = [h + 1, h + 2, h + 3]
            h += 3
            res = r.reserve(lay, hashes)
            r.commit(res.lease_id, [b.block_id for b in res.blocks])
            sessions[m].append(hashes)
    kept = {}
    for m, lay in models.items():
        newest = sessions[m][-4:]
        kept[m.split("@")[0]] = sum(r.lookup(lay, hs).pages == 3 for hs in newest)
    r.check_integrity()
    return kept


def test_value_per_byte_keeps_every_models_newest_sessions():
    kept = _sessions_kept(ValuePerByte())
    assert kept == {"llama": 4, "qwen2": 4, "qwen3": 4}, f"newest 4 sessions still stored per model: {kept}"
