"""The router's call records to telemetry are best effort, but a record it could not send is counted, never
silently lost (``RouterState.publish_call``; the counters are in ``/health``)."""

from __future__ import annotations

from services.router.service import make_state
from talaria.config import StackConfig
from talaria.v1 import telemetry_pb2 as tpb


def test_a_record_without_a_nats_connection_is_counted_as_dropped():
    state = make_state(StackConfig())
    assert state.nc is None  # not connected (before start, or while NATS is down)
    state.publish_call(tpb.CallRecord(request_id="r1"))
    state.publish_call(tpb.CallRecord(request_id="r2"))
    assert state.counters["call_record_dropped"] == 2
