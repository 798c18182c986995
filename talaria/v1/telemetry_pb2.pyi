from talaria.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CallRecord(_message.Message):
    __slots__ = ("schema_version", "phase", "request_id", "session_id", "model", "instance_id", "router_id", "arrival_unix", "end_unix", "first_token_unix", "placement_reason", "lease", "avoidable_open", "opens_model", "switches_model", "kv_source", "error", "http_status", "usage", "finish_reason", "trace_id", "attribution")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    AVOIDABLE_OPEN_FIELD_NUMBER: _ClassVar[int]
    OPENS_MODEL_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    phase: str
    request_id: str
    session_id: str
    model: str
    instance_id: str
    router_id: str
    arrival_unix: float
    end_unix: float
    first_token_unix: float
    placement_reason: str
    lease: str
    avoidable_open: bool
    opens_model: bool
    switches_model: bool
    kv_source: str
    error: str
    http_status: int
    usage: _common_pb2.Usage
    finish_reason: str
    trace_id: str
    attribution: _common_pb2.CallAttribution
    def __init__(self, schema_version: _Optional[int] = ..., phase: _Optional[str] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., router_id: _Optional[str] = ..., arrival_unix: _Optional[float] = ..., end_unix: _Optional[float] = ..., first_token_unix: _Optional[float] = ..., placement_reason: _Optional[str] = ..., lease: _Optional[str] = ..., avoidable_open: _Optional[bool] = ..., opens_model: _Optional[bool] = ..., switches_model: _Optional[bool] = ..., kv_source: _Optional[str] = ..., error: _Optional[str] = ..., http_status: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., trace_id: _Optional[str] = ..., attribution: _Optional[_Union[_common_pb2.CallAttribution, _Mapping]] = ...) -> None: ...
