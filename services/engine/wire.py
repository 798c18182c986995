"""The engine's wire encoding: protobuf messages to and from the executor's plain types (no I/O, no NATS).

``service.py`` decodes a ``GenerateRequest`` with these helpers, hands plain types to the executor and encodes
what comes back: token chunks, completion hooks, snapshots, switch records and round summaries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.engine.api import CostStats, EngineStats, KvLocation, SessionInfo
from services.engine.types import SamplingParams
from talaria.config import EngineConfig
from talaria.switch_path import costs_to_proto
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

if TYPE_CHECKING:
    from services.engine.substrate.switch import SwitchRecord

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
        skip_special_tokens=sp.skip_special_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output,
    )


_KV_STATE = {KvLocation.DEVICE: pb.KV_DEVICE, KvLocation.HOST: pb.KV_HOST, KvLocation.MISSING: pb.KV_MISSING}


def kv_state(where: KvLocation) -> int:
    """The wire's ``KvState`` of a session's location: the one place ``KvLocation`` becomes the proto enum."""
    return _KV_STATE[where]


def prefix_handle(info: SessionInfo, model: str, page_size: int) -> cpb.PrefixHandle:
    """What the instance keeps for a session after a call (from the executor's ``session_info``)."""
    return cpb.PrefixHandle(model=model, committed_tokens=info.committed_tokens, page_size=page_size, full_pages=info.full_pages)


def switch_record(r: SwitchRecord, instance_id: str) -> pb.SwitchRecord:
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
        holds=r.holds, hold_gain_s=r.hold_gain_s, hold_harm_s=r.hold_harm_s,
        token_deadlines=token_deadline_stats(r.deadlines), cold_scheduler="token_deadlines" if r.flags.get("token_deadlines") else "rounds",
    )


def token_deadline_stats(st) -> pb.TokenDeadlineStats | None:
    """A ``slots.deadlines.DeadlineStats`` as its wire message (None stays unset); +inf bucket bound -> 0."""
    if st is None:
        return None
    return pb.TokenDeadlineStats(
        tokens=st.tokens, tokens_on_time=st.tokens_on_time, first_tokens=st.first_tokens, first_on_time=st.first_on_time,
        gap_p50_s=st.gap_p50_s, gap_p90_s=st.gap_p90_s, gap_p99_s=st.gap_p99_s, gap_max_s=st.gap_max_s,
        gap_bucket_le_s=[b if math.isfinite(b) else 0.0 for b in st.gap_buckets_s], gap_bucket_count=list(st.gap_counts),
    )


def instance_snapshot(cfg: EngineConfig, st: EngineStats, switches: Sequence[SwitchRecord], *, epoch: int, seq: int, draining: bool, rounds: int) -> pb.InstanceSnapshot:
    """The heartbeat message from the executor's typed ``stats()`` (and, cold pool, its latest switch records)."""
    snap = pb.InstanceSnapshot(
        schema_version=SCHEMA_VERSION, instance_id=cfg.id, pool=pb.POOL_HOT if cfg.pool == "hot" else pb.POOL_COLD,
        epoch=epoch, seq=seq, sent_unix=time.time(), heartbeat_period_s=cfg.heartbeat_period_s,
        num_running=st.num_running, num_waiting=st.num_waiting, kv_usage=st.kv_usage, kv_pages_total=st.kv_pages_total,
        kv_pages_free=st.kv_pages_free, draining=draining, device=cfg.device, tokens_generated=st.tokens_generated,
        prefix_hit_rate=st.prefix_hit_rate,
    )
    for m in st.models:  # every loaded catalog model is served; `active` marks the resident one
        snap.models.append(pb.ModelState(
            model=m.model, loaded=m.loaded, active=m.active, staged=m.staged, max_context=m.max_context,
            num_running=m.num_running, num_waiting=m.num_waiting, slot_wait_s=m.slot_wait_s, max_token_bytes=m.max_token_bytes,
        ))
        if m.profile is not None:  # the model's own costs (switch costs stay in the instance profile)
            snap.models[-1].cost.CopyFrom(cost_profile(m.profile, with_restore=st.host_kv, with_switches=False))
    if cfg.pool == "cold":
        snap.staging_slack_bytes = st.staging_slack_bytes
        snap.num_switches = st.num_switches
        for r in switches:
            snap.switches.append(switch_record(r, cfg.id))
        if st.slots is not None:  # slot scheduler: overload is reported, not hidden (Talaria §3.4)
            snap.deadline_risk = st.slots.deadline_risk
            snap.shortfall_s = st.slots.shortfall_s
            snap.round_remaining_s = st.slots.round_remaining_s
            snap.infeasible.extend(st.slots.infeasible)
            snap.rounds = rounds
            snap.deadline_attainment = st.slots.attainment
            snap.ttft_attainment = st.slots.ttft_attainment
            snap.gap_p99_s = st.slots.gap_p99_s
            snap.cold_scheduler = st.slots.mode
        snap.transfer_stream_bytes = st.transfer_stream_bytes
        snap.transfer_kv_bytes = st.transfer_kv_bytes
    model = cfg.models[0]
    for s in st.sessions:  # device, then host (restorable from the kvstore) / missing (the store restarted or is unreachable)
        snap.sessions.append(pb.SessionState(
            session_id=s.session_id, model=s.model or model, committed_tokens=s.committed_tokens,
            state=kv_state(s.where), last_use_unix=s.last_use_unix,
        ))
    for name, state in st.kernels:  # which kernels run (router /health, telemetry, talaria health)
        snap.kernels.add(name=name, state=state)
    snap.host_kv = bool(st.host_kv)  # restores what the shared kvstore holds, whoever wrote it (router: host_prefix)
    snap.profile.CopyFrom(cost_profile(st.profile, with_restore=st.host_kv, with_switches=True))
    return snap


def cost_profile(p: CostStats, *, with_restore: bool, with_switches: bool) -> pb.CostProfile:
    """The wire form of measured costs: the instance's (``InstanceSnapshot.profile``, with its switch costs)
    or one model's (``ModelState.cost``). The restore cost only where a host KV tier restores."""
    return pb.CostProfile(
        prefill_per_token=p.prefill_per_token, decode_step=p.decode_step,
        switch_costs=costs_to_proto(dict(p.switch_by_path)) if with_switches else [],
        restore_per_token=p.restore_per_token if with_restore else 0.0,
        prefill_by_context=[pb.LearnedCost(at=a, seconds=s, samples=n) for a, s, n in p.prefill_by_context],
        decode_by_batch=[pb.LearnedCost(at=a, seconds=s, samples=n) for a, s, n in p.decode_by_batch],
    )
