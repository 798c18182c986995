from talaria.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Lease(_message.Message):
    __slots__ = ("schema_version", "lease_id", "session_id", "model", "instance_id", "prefix", "t_done_unix", "t_exp_unix", "router_id", "instance_epoch", "gap_mu", "gap_sigma", "p_return", "tool", "early")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    T_DONE_UNIX_FIELD_NUMBER: _ClassVar[int]
    T_EXP_UNIX_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    GAP_MU_FIELD_NUMBER: _ClassVar[int]
    GAP_SIGMA_FIELD_NUMBER: _ClassVar[int]
    P_RETURN_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EARLY_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    lease_id: str
    session_id: str
    model: str
    instance_id: str
    prefix: _common_pb2.PrefixHandle
    t_done_unix: float
    t_exp_unix: float
    router_id: str
    instance_epoch: int
    gap_mu: float
    gap_sigma: float
    p_return: float
    tool: str
    early: bool
    def __init__(self, schema_version: _Optional[int] = ..., lease_id: _Optional[str] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., prefix: _Optional[_Union[_common_pb2.PrefixHandle, _Mapping]] = ..., t_done_unix: _Optional[float] = ..., t_exp_unix: _Optional[float] = ..., router_id: _Optional[str] = ..., instance_epoch: _Optional[int] = ..., gap_mu: _Optional[float] = ..., gap_sigma: _Optional[float] = ..., p_return: _Optional[float] = ..., tool: _Optional[str] = ..., early: _Optional[bool] = ...) -> None: ...
