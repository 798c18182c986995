"""The engine's wire encoding: protobuf messages to and from the executor's plain types (no I/O, no NATS).

``service.py`` decodes a ``GenerateRequest`` with these helpers, hands plain types to the executor and encodes
what comes back: token chunks, completion hooks, snapshots, switch records and round summaries.
"""

from __future__ import annotations

from services.engine.types import SamplingParams
from talaria.config import EngineConfig
from talaria.switch_path import costs_to_proto
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

import time

SCHEMA_VERSION = 1


class CallError(Exception):
    """A call the engine refuses; becomes an error chunk with ``status``."""

    def __init__(self, status: int, code: str, message: str, param: str = ""):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def proto(self) -> cpb.Error:
        return cpb.Error(code=self.code, message=self.message, http_status=self.status, param=self.param)


def sampling_params(sp: pb.SamplingParams) -> SamplingParams:
    """Decode the wire sampling parameters (unset ``top_p`` = 1). Range checks are the executor's
    (``validate_request``): they happen once, for every front."""
    top_p = sp.top_p if sp.top_p > 0 else 1.0
    return SamplingParams(
        temperature=sp.temperature,
        top_p=top_p,
        top_k=sp.top_k,
        seed=sp.seed if sp.has_seed else None,
        max_tokens=sp.max_tokens,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty or 1.0,
        min_p=sp.min_p,
        logit_bias=tuple(sorted(sp.logit_bias.items())),
        logprobs=min(sp.top_logprobs, 20) if sp.logprobs else -1,
    )


def prefix_handle(info: dict, model: str, page_size: int) -> cpb.PrefixHandle:
    """What the instance keeps for a session after a call (from the executor's ``session_info``)."""
    return cpb.PrefixHandle(
        model=model,
        committed_tokens=int(info.get("committed_tokens", 0)),
        page_size=page_size,
        full_pages=int(info.get("full_pages", 0)),
    )


def switch_record(r, instance_id: str) -> pb.SwitchRecord:
    """A cold engine's ``SwitchRecord`` (substrate/switch.py) as its wire message."""
    ph = r.phase_seconds
    return pb.SwitchRecord(
        schema_version=SCHEMA_VERSION, instance_id=instance_id, seq=r.seq, from_model=r.from_model, to_model=r.to_model,
        reason=r.reason, path=str(r.path), started_unix=r.started_unix, total_seconds=r.total_seconds,
        save_teardown_seconds=ph[0], open_weights_seconds=ph[1], restore_kv_shell_seconds=ph[2],
        restore_runtime_seconds=ph[3], publish_seconds=ph[4], weight_bytes=r.weight_bytes, staged_bytes=r.staged_bytes,
        host_bytes=r.host_bytes, dirty_bytes=r.dirty_bytes, d2d_seconds=r.d2d_seconds, h2d_seconds=r.h2d_seconds,
        kv_shell_reused=r.kv_shell_reused, runtime_reused=r.runtime_reused,
    )


def round_summary(r, instance_id: str) -> pb.RoundSummary:
    """A slot-scheduler ``RoundSummary`` (services/engine/slots/types.py) as its wire message."""
    return pb.RoundSummary(
        schema_version=SCHEMA_VERSION, instance_id=instance_id, index=r.index, sent_unix=time.time(),
        wall_s=r.wall_s, active_s=r.active_s, switch_s=r.switch_s, bound_s=r.bound_s, predicted_s=r.predicted_s,
        shortfall_s=r.shortfall_s, deadline_risk=r.deadline_risk, infeasible=list(r.infeasible),
        phase_s=dict(r.phase_s), phase_count=dict(r.phase_count), sp_admitted=r.sp_admitted, sp_deferred=r.sp_deferred,
        sp_ineligible=dict(r.sp_ineligible), p_admitted=r.p_admitted, p_deferred=r.p_deferred,
        switch_paths=[str(x) for x in r.switch_paths], flags=dict(r.flags), num_slots=len(r.slots),
        sp_deferred_reasons=dict(r.sp_deferred_reasons), sp_benefit_s=r.sp_benefit_s, sp_harm_s=r.sp_harm_s,
    )


def instance_snapshot(cfg: EngineConfig, st: dict, switches: list, *, epoch: int, seq: int, draining: bool, rounds: int) -> pb.InstanceSnapshot:
    """The heartbeat message from the executor's ``stats()`` (and, cold pool, its latest switch records)."""
    model = cfg.models[0]
    multi = cfg.pool == "cold"
    snap = pb.InstanceSnapshot(
        schema_version=SCHEMA_VERSION,
        instance_id=cfg.id,
        pool=pb.POOL_HOT if cfg.pool == "hot" else pb.POOL_COLD,
        epoch=epoch,
        seq=seq,
        sent_unix=time.time(),
        heartbeat_period_s=cfg.heartbeat_period_s,
        num_running=st.get("num_running", 0),
        num_waiting=st.get("num_waiting", 0),
        kv_usage=st.get("kv_usage", 0.0),
        kv_pages_total=st.get("kv_pages_total", 0),
        kv_pages_free=st.get("kv_pages_free", 0),
        draining=draining,
        device=cfg.device,
        tokens_generated=st.get("tokens_generated", 0),
        prefix_hit_rate=st.get("prefix_hit_rate", 0.0),
    )
    if multi:  # every loaded catalog model is served; `active` marks the resident one
        for m in st.get("models", []):
            snap.models.append(pb.ModelState(**m))
        snap.staging_slack_bytes = st.get("staging_slack_bytes", 0)
        snap.num_switches = st.get("num_switches", 0)
        for r in switches:
            snap.switches.append(switch_record(r, cfg.id))
        slots = st.get("slots")
        if slots:  # slot scheduler: overload is reported, not hidden (Talaria §3.4)
            snap.deadline_risk = bool(slots.get("deadline_risk"))
            snap.shortfall_s = float(slots.get("shortfall_s", 0.0))
            snap.round_remaining_s = float(slots.get("round_remaining_s", 0.0))
            snap.infeasible.extend(slots.get("infeasible", []))
            snap.rounds = rounds
    else:
        snap.models.append(
            pb.ModelState(model=model, loaded=True, active=True, max_context=st.get("max_context", 0), num_running=snap.num_running, num_waiting=snap.num_waiting)
        )
    for s in st.get("sessions", []):
        snap.sessions.append(pb.SessionState(session_id=s["session_id"], model=s.get("model") or model, committed_tokens=s["committed_tokens"], state=pb.KV_DEVICE, last_use_unix=s.get("last_use_unix", 0.0)))
    prof = st.get("profile") or {}
    snap.profile.CopyFrom(pb.CostProfile(
        prefill_per_token=prof.get("prefill_per_token", 0.0), decode_step=prof.get("decode_step", 0.0),
        switch_costs=costs_to_proto(prof.get("switch_by_path", {})),
        prefill_by_context=[pb.LearnedCost(at=a, seconds=s, samples=n) for a, s, n in prof.get("prefill_by_context", ())],
        decode_by_batch=[pb.LearnedCost(at=a, seconds=s, samples=n) for a, s, n in prof.get("decode_by_batch", ())],
    ))
    _add_host_kv_state(snap, st, model)
    return snap

def _add_host_kv_state(snap: pb.InstanceSnapshot, st: dict, model: str) -> None:
    """Sessions whose KV left the device: ``host`` (restorable from the kvstore) or ``missing`` (the
    store restarted, or is unreachable); plus the measured restore cost per token."""
    hk = st.get("host_kv")
    if not hk:
        return
    snap.profile.restore_per_token = hk.get("restore_per_token", 0.0)
    on_device = {s.session_id for s in snap.sessions}
    for s in hk.get("sessions", []):
        if s["session_id"] in on_device:
            continue
        state = pb.KV_HOST if s["state"] == "host" else pb.KV_MISSING
        snap.sessions.append(pb.SessionState(session_id=s["session_id"], model=s.get("model") or model, committed_tokens=s["committed_tokens"], state=state, last_use_unix=s.get("last_use_unix", 0.0)))
