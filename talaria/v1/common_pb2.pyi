from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Error(_message.Message):
    __slots__ = ("code", "message", "http_status", "param")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    http_status: int
    param: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., http_status: _Optional[int] = ..., param: _Optional[str] = ...) -> None: ...

class PrefixHandle(_message.Message):
    __slots__ = ("model", "committed_tokens", "page_size", "full_pages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FULL_PAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    committed_tokens: int
    page_size: int
    full_pages: int
    def __init__(self, model: _Optional[str] = ..., committed_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., full_pages: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "restored_tokens", "reasoning_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    restored_tokens: int
    reasoning_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., restored_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class CallAttribution(_message.Message):
    __slots__ = ("router_queue_s", "placement_s", "engine_queue_s", "round_wait_s", "switch_wait_s", "restore_s", "prefill_s", "decode_s", "preemption_s", "other_s", "total_s")
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_S_FIELD_NUMBER: _ClassVar[int]
    OTHER_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    router_queue_s: float
    placement_s: float
    engine_queue_s: float
    round_wait_s: float
    switch_wait_s: float
    restore_s: float
    prefill_s: float
    decode_s: float
    preemption_s: float
    other_s: float
    total_s: float
    def __init__(self, router_queue_s: _Optional[float] = ..., placement_s: _Optional[float] = ..., engine_queue_s: _Optional[float] = ..., round_wait_s: _Optional[float] = ..., switch_wait_s: _Optional[float] = ..., restore_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., preemption_s: _Optional[float] = ..., other_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...
