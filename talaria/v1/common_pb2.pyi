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
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "restored_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    restored_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., restored_tokens: _Optional[int] = ...) -> None: ...
