"""``talaria bench call-diff``: where one run of a workload beat another, call by call.

Two runs of the same workload file (e.g. two configurations of one ``bench matrix`` repetition: the full router
and ``least-pressure``, which differ only in placement) are joined call by call on (session, call index). For
every call both runs completed, the difference of their end-to-end latencies (A minus B: negative = A faster)
is attributed twice:

* **by outcome** -- each run's call is classed by what placement did to it: stayed on the instance of the
  session's previous call of the same model or moved (``same`` / ``moved``; the session's first call of the model
  is ``first``), where its prefix came from as the
  engine reported it (``device`` when cached tokens exceed the restored ones, ``host`` when restored, else
  ``recompute``), and whether its placement opened or switched the model (``open`` / ``switch`` / ``resident``,
  from the router's call record). The table sums and takes the median of the latency difference per pair of
  classes, so "A kept the session on its instance where B moved it and recomputed" reads as one row;
* **by component** -- the sum over pairs of each latency component of the engine's attribution (router queue,
  engine queue, round wait, switch wait, restore, prefill, decode, ...; ``bench.report.LATENCY_COMPONENTS``):
  which part of the call's time the difference lives in.

Sources: the replay client's ``replay.json`` (latency, instance, usage) and the telemetry records file
``records.jsonl`` (placement flags, attribution) of each run's directory. A run without records still gets the
outcome table (placement flags ``?``) and no component split. Pure functions apart from ``load_run``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import LATENCY_COMPONENTS, _component


@dataclass(frozen=True)
class CallView:
    """One completed call of one run, as the difference tables see it."""

    session_id: str
    index: int
    latency_s: float  # end of response - send (client clock)
    ttft_s: float  # first token - send
    moved: str  # "first" | "same" | "moved": the instance against the session's previous call of the same model
    kv: str  # "device" | "host" | "recompute": where the prefix came from (engine usage)
    activation: str  # "open" | "switch" | "resident" | "?" (no call record)
    instance: str = ""
    components: dict[str, float] = field(default_factory=dict)  # LATENCY_COMPONENTS name -> seconds

    @property
    def outcome(self) -> str:
        return f"{self.moved}/{self.kv}/{self.activation}"


def kv_source(cached: int, restored: int | None) -> str:
    if restored and restored > 0:
        return "host" if cached <= restored else "device"  # partly device, partly host: the device part led
    return "device" if cached > 0 else "recompute"


def _session_key(sid: str) -> str:
    """A record's session id is tenant-scoped (``<tenant>|<session>``) when keys are on; the client's is not."""
    return sid.rsplit("|", 1)[-1]


def call_views(replay: dict[str, Any], records: list[dict[str, Any]] | None) -> dict[tuple[str, int], CallView]:
    """Completed calls of one run keyed by (session, call index). ``replay``: a ``ReplayResult.to_json()``;
    ``records``: the telemetry records (any kinds; the error-free call-end records are used), joined to the
    client's completed calls by session and arrival order. Pure."""
    calls = sorted(replay["calls"], key=lambda c: (c["session_id"], c["call_index"]))
    by_session: dict[str, list[dict[str, Any]]] = {}
    for r in records or []:
        if r.get("kind", "call") == "call" and r.get("phase") == "end" and not r.get("error"):
            by_session.setdefault(_session_key(str(r.get("session_id", ""))), []).append(r)
    for rs in by_session.values():
        rs.sort(key=lambda r: float(r.get("arrival_unix") or 0.0))
    out: dict[tuple[str, int], CallView] = {}
    prev: dict[tuple[str, str], str] = {}
    seen: dict[str, int] = {}
    for c in calls:
        sid = c["session_id"]
        inst = c.get("instance", "")
        key = (sid, str(c.get("model", "")))  # a two-model session's return goes back to its model's instance
        moved = "first" if key not in prev else ("same" if prev[key] == inst else "moved")
        prev[key] = inst
        if c.get("error") or not all(math.isfinite(float(c.get(x, math.nan))) for x in ("sent", "end")):
            continue
        # the k-th completed call of the session is its k-th error-free call-end record (a retried 429 leaves an
        # error record and then the completed one)
        k = seen.get(sid, 0)
        seen[sid] = k + 1
        recs = by_session.get(sid, [])
        rec = recs[k] if k < len(recs) else None
        act = "?"
        comps: dict[str, float] = {}
        if rec is not None:
            act = "open" if rec.get("opens_model") else ("switch" if rec.get("switches_model") else "resident")
            for name, keys in LATENCY_COMPONENTS:
                v = _component(rec, keys)
                if v is not None:
                    comps[name] = v
        ft = float(c.get("first_token", math.nan))
        out[(sid, int(c["call_index"]))] = CallView(
            sid, int(c["call_index"]), float(c["end"]) - float(c["sent"]), ft - float(c["sent"]), moved,
            kv_source(int(c.get("cached_tokens") or 0), c.get("restored_tokens")), act, inst, comps,
        )
    return out


def diff(a: dict[tuple[str, int], CallView], b: dict[tuple[str, int], CallView], top: int = 10) -> dict[str, Any]:
    """The per-call difference A - B over the calls both completed: by outcome pair, by latency component, and
    the ``top`` largest differences each way. Pure."""
    keys = sorted(set(a) & set(b))
    groups: dict[tuple[str, str], list[float]] = {}
    comp_a: dict[str, float] = {}
    comp_b: dict[str, float] = {}
    with_comps = 0
    for k in keys:
        x, y = a[k], b[k]
        groups.setdefault((x.outcome, y.outcome), []).append(x.latency_s - y.latency_s)
        if x.components and y.components:
            with_comps += 1
            for name, v in x.components.items():
                comp_a[name] = comp_a.get(name, 0.0) + v
            for name, v in y.components.items():
                comp_b[name] = comp_b.get(name, 0.0) + v
    rows = [
        {"a": oa, "b": ob, "calls": len(ds), "sum_delta_s": sum(ds), "median_delta_s": statistics.median(ds),
         "a_faster": sum(d < 0 for d in ds)}
        for (oa, ob), ds in groups.items()
    ]
    rows.sort(key=lambda r: r["sum_delta_s"])
    deltas = sorted(((a[k].latency_s - b[k].latency_s, k) for k in keys))
    pick = [k for _d, k in deltas[:top]] + [k for _d, k in deltas[::-1][:top] if _d > 0]

    def view(k: tuple[str, int]) -> dict[str, Any]:
        x, y = a[k], b[k]
        return {"session_id": k[0], "index": k[1], "delta_s": x.latency_s - y.latency_s,
                "a": {"outcome": x.outcome, "instance": x.instance, "latency_s": x.latency_s, "components": x.components},
                "b": {"outcome": y.outcome, "instance": y.instance, "latency_s": y.latency_s, "components": y.components}}

    names = [n for n, _k in LATENCY_COMPONENTS if n in comp_a or n in comp_b]
    return {
        "calls": len(keys), "only_a": len(set(a) - set(b)), "only_b": len(set(b) - set(a)),
        "sum_delta_s": sum(d for d, _k in deltas), "a_faster": sum(d < 0 for d, _k in deltas),
        "by_outcome": rows,
        "components": {"calls": with_comps,
                       "rows": [{"component": n, "a_s": comp_a.get(n, 0.0), "b_s": comp_b.get(n, 0.0),
                                 "delta_s": comp_a.get(n, 0.0) - comp_b.get(n, 0.0)} for n in names]},
        "top": [view(k) for k in pick],
    }


def table(d: dict[str, Any], a_name: str = "A", b_name: str = "B") -> str:
    """Markdown: the outcome table and the component table of a ``diff``."""
    lines = [
        f"{d['calls']} calls completed in both ({d['only_a']} only in {a_name}, {d['only_b']} only in {b_name}); "
        f"{a_name} faster in {d['a_faster']}; sum of {a_name} - {b_name} latency {d['sum_delta_s']:+.1f} s "
        "(outcome = previous instance kept / prefix source / model activation)",
        "",
        f"| {a_name} outcome | {b_name} outcome | calls | {a_name} faster | sum of {a_name} - {b_name} | median |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["by_outcome"]:
        lines.append(f"| {r['a']} | {r['b']} | {r['calls']} | {r['a_faster']} | {r['sum_delta_s']:+.2f} s | {r['median_delta_s']:+.3f} s |")
    c = d["components"]
    if c["rows"]:
        lines += ["", f"Latency components summed over the {c['calls']} calls both runs recorded:", "",
                  f"| component | {a_name} | {b_name} | {a_name} - {b_name} |", "|---|---|---|---|"]
        for r in c["rows"]:
            lines.append(f"| {r['component']} | {r['a_s']:.2f} s | {r['b_s']:.2f} s | {r['delta_s']:+.2f} s |")
    return "\n".join(lines)


def load_run(cdir: Path) -> dict[tuple[str, int], CallView]:
    """A run directory of ``bench matrix`` (``replay.json``, ``records.jsonl`` if telemetry wrote one)."""
    replay = json.loads((cdir / "replay.json").read_text())
    rec_path = cdir / "records.jsonl"
    records = None
    if rec_path.exists():
        records = [json.loads(line) for line in rec_path.read_text().splitlines() if line.strip()]
    return call_views(replay, records)


def main(args) -> int:
    a, b = load_run(Path(args.a)), load_run(Path(args.b))
    d = diff(a, b, top=args.top)
    print(table(d, args.a_name or Path(args.a).name, args.b_name or Path(args.b).name))
    if args.json:
        Path(args.json).write_text(json.dumps(d, indent=1))
    return 0


def add_args(p) -> None:
    p.add_argument("a", help="run directory A (bench matrix: <out>/[rep<i>/]<configuration>)")
    p.add_argument("b", help="run directory B, same workload")
    p.add_argument("--a-name", default="", help="A's name in the tables (default: its directory name)")
    p.add_argument("--b-name", default="")
    p.add_argument("--top", type=int, default=10, help="largest differences each way kept in --json")
    p.add_argument("--json", default="", help="also write the whole difference as JSON here")
