from talaria.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pool(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_UNSPECIFIED: _ClassVar[Pool]
    POOL_HOT: _ClassVar[Pool]
    POOL_COLD: _ClassVar[Pool]

class KvState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_STATE_UNSPECIFIED: _ClassVar[KvState]
    KV_DEVICE: _ClassVar[KvState]
    KV_HOST: _ClassVar[KvState]
    KV_MISSING: _ClassVar[KvState]

class SwitchPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWITCH_PATH_UNSPECIFIED: _ClassVar[SwitchPath]
    SWITCH_PATH_FULL_STAGED: _ClassVar[SwitchPath]
    SWITCH_PATH_PARTIAL: _ClassVar[SwitchPath]
    SWITCH_PATH_HOST_ONLY: _ClassVar[SwitchPath]
    SWITCH_PATH_OPEN: _ClassVar[SwitchPath]

class ControlOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_OP_UNSPECIFIED: _ClassVar[ControlOp]
    CONTROL_DRAIN: _ClassVar[ControlOp]
    CONTROL_RESUME: _ClassVar[ControlOp]
    CONTROL_OPEN_MODEL: _ClassVar[ControlOp]
    CONTROL_CLOSE_MODEL: _ClassVar[ControlOp]
    CONTROL_FLUSH_CACHE: _ClassVar[ControlOp]
    CONTROL_END_SESSION: _ClassVar[ControlOp]
POOL_UNSPECIFIED: Pool
POOL_HOT: Pool
POOL_COLD: Pool
KV_STATE_UNSPECIFIED: KvState
KV_DEVICE: KvState
KV_HOST: KvState
KV_MISSING: KvState
SWITCH_PATH_UNSPECIFIED: SwitchPath
SWITCH_PATH_FULL_STAGED: SwitchPath
SWITCH_PATH_PARTIAL: SwitchPath
SWITCH_PATH_HOST_ONLY: SwitchPath
SWITCH_PATH_OPEN: SwitchPath
CONTROL_OP_UNSPECIFIED: ControlOp
CONTROL_DRAIN: ControlOp
CONTROL_RESUME: ControlOp
CONTROL_OPEN_MODEL: ControlOp
CONTROL_CLOSE_MODEL: ControlOp
CONTROL_FLUSH_CACHE: ControlOp
CONTROL_END_SESSION: ControlOp

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls_json", "tool_call_id", "has_content", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls_json: str
    tool_call_id: str
    has_content: bool
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., has_content: _Optional[bool] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "constraint", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "logprobs", "top_logprobs", "skip_special_tokens", "include_stop_str_in_output", "thinking_token_budget")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    constraint: Constraint
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    thinking_token_budget: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., thinking_token_budget: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "json_schema", "tool_choice", "parallel_tool_calls")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    json_schema: str
    tool_choice: str
    parallel_tool_calls: bool
    def __init__(self, kind: _Optional[str] = ..., json_schema: _Optional[str] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("schema_version", "request_id", "session_id", "model", "text", "token_ids", "messages", "sampling", "stream", "prefix", "lease_id", "deadline_unix", "trace_context", "tenant", "resume_epoch", "tools_json", "ttft_target_s", "tpot_target_s", "hints", "end_session", "chat_template", "cache_salt")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RESUME_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TTFT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    END_SESSION_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    session_id: str
    model: str
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    stream: bool
    prefix: _common_pb2.PrefixHandle
    lease_id: str
    deadline_unix: float
    trace_context: _containers.ScalarMap[str, str]
    tenant: str
    resume_epoch: int
    tools_json: str
    ttft_target_s: float
    tpot_target_s: float
    hints: AgentCallHints
    end_session: bool
    chat_template: ChatTemplateOptions
    cache_salt: str
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ..., prefix: _Optional[_Union[_common_pb2.PrefixHandle, _Mapping]] = ..., lease_id: _Optional[str] = ..., deadline_unix: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ..., resume_epoch: _Optional[int] = ..., tools_json: _Optional[str] = ..., ttft_target_s: _Optional[float] = ..., tpot_target_s: _Optional[float] = ..., hints: _Optional[_Union[AgentCallHints, _Mapping]] = ..., end_session: _Optional[bool] = ..., chat_template: _Optional[_Union[ChatTemplateOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ChatTemplateOptions(_message.Message):
    __slots__ = ("kwargs_json", "no_generation_prompt", "continue_final_message", "reasoning_effort")
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    NO_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    kwargs_json: str
    no_generation_prompt: bool
    continue_final_message: bool
    reasoning_effort: str
    def __init__(self, kwargs_json: _Optional[str] = ..., no_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., reasoning_effort: _Optional[str] = ...) -> None: ...

class AgentCallHints(_message.Message):
    __slots__ = ("has_priority", "priority", "expected_output_tokens", "expected_tool_s", "cache_ttl_s", "latency_sensitivity_s")
    HAS_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOOL_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SENSITIVITY_S_FIELD_NUMBER: _ClassVar[int]
    has_priority: bool
    priority: int
    expected_output_tokens: int
    expected_tool_s: float
    cache_ttl_s: float
    latency_sensitivity_s: float
    def __init__(self, has_priority: _Optional[bool] = ..., priority: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., expected_tool_s: _Optional[float] = ..., cache_ttl_s: _Optional[float] = ..., latency_sensitivity_s: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("schema_version", "request_id", "seq", "accepted", "token_ids", "text", "finished", "finish_reason", "usage", "error", "instance_id", "ttft_seconds", "keepalive", "tool_format", "logprobs", "stop_reason", "reasoning_format", "reasoning_open", "attribution", "constraint_after_reasoning")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    REASONING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    REASONING_OPEN_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_AFTER_REASONING_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    seq: int
    accepted: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    usage: _common_pb2.Usage
    error: _common_pb2.Error
    instance_id: str
    ttft_seconds: float
    keepalive: bool
    tool_format: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_reason: str
    reasoning_format: str
    reasoning_open: bool
    attribution: _common_pb2.CallAttribution
    constraint_after_reasoning: bool
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., seq: _Optional[int] = ..., accepted: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., instance_id: _Optional[str] = ..., ttft_seconds: _Optional[float] = ..., keepalive: _Optional[bool] = ..., tool_format: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_reason: _Optional[str] = ..., reasoning_format: _Optional[str] = ..., reasoning_open: _Optional[bool] = ..., attribution: _Optional[_Union[_common_pb2.CallAttribution, _Mapping]] = ..., constraint_after_reasoning: _Optional[bool] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("schema_version", "request_id", "reason")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    reason: str
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CompletionHook(_message.Message):
    __slots__ = ("schema_version", "request_id", "session_id", "model", "instance_id", "prefix", "usage", "finish_reason", "arrival_unix", "finish_unix", "ttft_seconds", "error", "attribution", "hints", "session_ended", "kv_restore_verify_failures", "tool_names", "tool_call_count")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINISH_UNIX_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ENDED_FIELD_NUMBER: _ClassVar[int]
    KV_RESTORE_VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_COUNT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    session_id: str
    model: str
    instance_id: str
    prefix: _common_pb2.PrefixHandle
    usage: _common_pb2.Usage
    finish_reason: str
    arrival_unix: float
    finish_unix: float
    ttft_seconds: float
    error: _common_pb2.Error
    attribution: _common_pb2.CallAttribution
    hints: AgentCallHints
    session_ended: bool
    kv_restore_verify_failures: int
    tool_names: _containers.RepeatedScalarFieldContainer[str]
    tool_call_count: int
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., prefix: _Optional[_Union[_common_pb2.PrefixHandle, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., arrival_unix: _Optional[float] = ..., finish_unix: _Optional[float] = ..., ttft_seconds: _Optional[float] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., attribution: _Optional[_Union[_common_pb2.CallAttribution, _Mapping]] = ..., hints: _Optional[_Union[AgentCallHints, _Mapping]] = ..., session_ended: _Optional[bool] = ..., kv_restore_verify_failures: _Optional[int] = ..., tool_names: _Optional[_Iterable[str]] = ..., tool_call_count: _Optional[int] = ...) -> None: ...

class ToolIntent(_message.Message):
    __slots__ = ("schema_version", "request_id", "session_id", "model", "instance_id", "tool_name", "seen_unix", "prompt_tokens", "generated_tokens")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    session_id: str
    model: str
    instance_id: str
    tool_name: str
    seen_unix: float
    prompt_tokens: int
    generated_tokens: int
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., seen_unix: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class RetentionHint(_message.Message):
    __slots__ = ("schema_version", "session_id", "model", "lease_id", "t_done_unix", "gap_mu", "gap_sigma", "window_s")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    T_DONE_UNIX_FIELD_NUMBER: _ClassVar[int]
    GAP_MU_FIELD_NUMBER: _ClassVar[int]
    GAP_SIGMA_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    session_id: str
    model: str
    lease_id: str
    t_done_unix: float
    gap_mu: float
    gap_sigma: float
    window_s: float
    def __init__(self, schema_version: _Optional[int] = ..., session_id: _Optional[str] = ..., model: _Optional[str] = ..., lease_id: _Optional[str] = ..., t_done_unix: _Optional[float] = ..., gap_mu: _Optional[float] = ..., gap_sigma: _Optional[float] = ..., window_s: _Optional[float] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("session_id", "model", "committed_tokens", "state", "last_use_unix")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_USE_UNIX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    committed_tokens: int
    state: KvState
    last_use_unix: float
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., committed_tokens: _Optional[int] = ..., state: _Optional[_Union[KvState, str]] = ..., last_use_unix: _Optional[float] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("model", "loaded", "active", "staged", "max_context", "num_running", "num_waiting", "slot_wait_s", "cost", "max_token_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    SLOT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    loaded: bool
    active: bool
    staged: bool
    max_context: int
    num_running: int
    num_waiting: int
    slot_wait_s: float
    cost: CostProfile
    max_token_bytes: int
    def __init__(self, model: _Optional[str] = ..., loaded: _Optional[bool] = ..., active: _Optional[bool] = ..., staged: _Optional[bool] = ..., max_context: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., slot_wait_s: _Optional[float] = ..., cost: _Optional[_Union[CostProfile, _Mapping]] = ..., max_token_bytes: _Optional[int] = ...) -> None: ...

class SwitchCost(_message.Message):
    __slots__ = ("path", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: SwitchPath
    seconds: float
    def __init__(self, path: _Optional[_Union[SwitchPath, str]] = ..., seconds: _Optional[float] = ...) -> None: ...

class CostProfile(_message.Message):
    __slots__ = ("prefill_per_token", "decode_step", "restore_per_token", "switch_costs", "prefill_by_context", "decode_by_batch")
    PREFILL_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SWITCH_COSTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BY_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DECODE_BY_BATCH_FIELD_NUMBER: _ClassVar[int]
    prefill_per_token: float
    decode_step: float
    restore_per_token: float
    switch_costs: _containers.RepeatedCompositeFieldContainer[SwitchCost]
    prefill_by_context: _containers.RepeatedCompositeFieldContainer[LearnedCost]
    decode_by_batch: _containers.RepeatedCompositeFieldContainer[LearnedCost]
    def __init__(self, prefill_per_token: _Optional[float] = ..., decode_step: _Optional[float] = ..., restore_per_token: _Optional[float] = ..., switch_costs: _Optional[_Iterable[_Union[SwitchCost, _Mapping]]] = ..., prefill_by_context: _Optional[_Iterable[_Union[LearnedCost, _Mapping]]] = ..., decode_by_batch: _Optional[_Iterable[_Union[LearnedCost, _Mapping]]] = ...) -> None: ...

class LearnedCost(_message.Message):
    __slots__ = ("at", "seconds", "samples")
    AT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    at: int
    seconds: float
    samples: int
    def __init__(self, at: _Optional[int] = ..., seconds: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class InstanceSnapshot(_message.Message):
    __slots__ = ("schema_version", "instance_id", "pool", "epoch", "seq", "sent_unix", "heartbeat_period_s", "models", "sessions", "num_running", "num_waiting", "kv_usage", "kv_pages_total", "kv_pages_free", "staging_slack_bytes", "profile", "draining", "device", "tokens_generated", "prefix_hit_rate", "switches", "num_switches", "deadline_risk", "shortfall_s", "round_remaining_s", "rounds", "infeasible", "deadline_attainment", "ttft_attainment", "gap_p99_s", "cold_scheduler", "transfer_stream_bytes", "transfer_kv_bytes", "host_kv", "kernels")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    STAGING_SLACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_RISK_FIELD_NUMBER: _ClassVar[int]
    SHORTFALL_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    INFEASIBLE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    TTFT_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    GAP_P99_S_FIELD_NUMBER: _ClassVar[int]
    COLD_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_STREAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    instance_id: str
    pool: Pool
    epoch: int
    seq: int
    sent_unix: float
    heartbeat_period_s: float
    models: _containers.RepeatedCompositeFieldContainer[ModelState]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionState]
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_pages_total: int
    kv_pages_free: int
    staging_slack_bytes: int
    profile: CostProfile
    draining: bool
    device: str
    tokens_generated: int
    prefix_hit_rate: float
    switches: _containers.RepeatedCompositeFieldContainer[SwitchRecord]
    num_switches: int
    deadline_risk: bool
    shortfall_s: float
    round_remaining_s: float
    rounds: int
    infeasible: _containers.RepeatedScalarFieldContainer[str]
    deadline_attainment: float
    ttft_attainment: float
    gap_p99_s: float
    cold_scheduler: str
    transfer_stream_bytes: int
    transfer_kv_bytes: int
    host_kv: bool
    kernels: _containers.RepeatedCompositeFieldContainer[KernelState]
    def __init__(self, schema_version: _Optional[int] = ..., instance_id: _Optional[str] = ..., pool: _Optional[_Union[Pool, str]] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., sent_unix: _Optional[float] = ..., heartbeat_period_s: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelState, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionState, _Mapping]]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., staging_slack_bytes: _Optional[int] = ..., profile: _Optional[_Union[CostProfile, _Mapping]] = ..., draining: _Optional[bool] = ..., device: _Optional[str] = ..., tokens_generated: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., switches: _Optional[_Iterable[_Union[SwitchRecord, _Mapping]]] = ..., num_switches: _Optional[int] = ..., deadline_risk: _Optional[bool] = ..., shortfall_s: _Optional[float] = ..., round_remaining_s: _Optional[float] = ..., rounds: _Optional[int] = ..., infeasible: _Optional[_Iterable[str]] = ..., deadline_attainment: _Optional[float] = ..., ttft_attainment: _Optional[float] = ..., gap_p99_s: _Optional[float] = ..., cold_scheduler: _Optional[str] = ..., transfer_stream_bytes: _Optional[int] = ..., transfer_kv_bytes: _Optional[int] = ..., host_kv: _Optional[bool] = ..., kernels: _Optional[_Iterable[_Union[KernelState, _Mapping]]] = ...) -> None: ...

class KernelState(_message.Message):
    __slots__ = ("name", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class SwitchRecord(_message.Message):
    __slots__ = ("schema_version", "instance_id", "seq", "from_model", "to_model", "reason", "path", "started_unix", "total_seconds", "save_teardown_seconds", "open_weights_seconds", "restore_kv_shell_seconds", "restore_runtime_seconds", "publish_seconds", "weight_bytes", "staged_bytes", "host_bytes", "dirty_bytes", "d2d_seconds", "h2d_seconds", "kv_shell_reused", "runtime_reused")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_MODEL_FIELD_NUMBER: _ClassVar[int]
    TO_MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAVE_TEARDOWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPEN_WEIGHTS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_KV_SHELL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_RUNTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIRTY_BYTES_FIELD_NUMBER: _ClassVar[int]
    D2D_SECONDS_FIELD_NUMBER: _ClassVar[int]
    H2D_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_SHELL_REUSED_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_REUSED_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    instance_id: str
    seq: int
    from_model: str
    to_model: str
    reason: str
    path: str
    started_unix: float
    total_seconds: float
    save_teardown_seconds: float
    open_weights_seconds: float
    restore_kv_shell_seconds: float
    restore_runtime_seconds: float
    publish_seconds: float
    weight_bytes: int
    staged_bytes: int
    host_bytes: int
    dirty_bytes: int
    d2d_seconds: float
    h2d_seconds: float
    kv_shell_reused: bool
    runtime_reused: bool
    def __init__(self, schema_version: _Optional[int] = ..., instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., from_model: _Optional[str] = ..., to_model: _Optional[str] = ..., reason: _Optional[str] = ..., path: _Optional[str] = ..., started_unix: _Optional[float] = ..., total_seconds: _Optional[float] = ..., save_teardown_seconds: _Optional[float] = ..., open_weights_seconds: _Optional[float] = ..., restore_kv_shell_seconds: _Optional[float] = ..., restore_runtime_seconds: _Optional[float] = ..., publish_seconds: _Optional[float] = ..., weight_bytes: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., dirty_bytes: _Optional[int] = ..., d2d_seconds: _Optional[float] = ..., h2d_seconds: _Optional[float] = ..., kv_shell_reused: _Optional[bool] = ..., runtime_reused: _Optional[bool] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("schema_version", "op", "model", "session_id", "tenant")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    op: ControlOp
    model: str
    session_id: str
    tenant: str
    def __init__(self, schema_version: _Optional[int] = ..., op: _Optional[_Union[ControlOp, str]] = ..., model: _Optional[str] = ..., session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("schema_version", "ok", "error", "snapshot")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    ok: bool
    error: _common_pb2.Error
    snapshot: InstanceSnapshot
    def __init__(self, schema_version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., snapshot: _Optional[_Union[InstanceSnapshot, _Mapping]] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("schema_version", "instance_id", "index", "sent_unix", "wall_s", "active_s", "switch_s", "bound_s", "predicted_s", "shortfall_s", "deadline_risk", "infeasible", "phase_s", "phase_count", "sp_admitted", "sp_deferred", "sp_ineligible", "p_admitted", "p_deferred", "switch_paths", "flags", "num_slots", "sp_deferred_reasons", "sp_benefit_s", "sp_harm_s", "holds", "hold_gain_s", "hold_harm_s", "token_deadlines", "cold_scheduler")
    class PhaseSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PhaseCountEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SpIneligibleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FlagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bool
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bool] = ...) -> None: ...
    class SpDeferredReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    BOUND_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    SHORTFALL_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_RISK_FIELD_NUMBER: _ClassVar[int]
    INFEASIBLE_FIELD_NUMBER: _ClassVar[int]
    PHASE_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_COUNT_FIELD_NUMBER: _ClassVar[int]
    SP_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    SP_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    SP_INELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    P_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    P_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    SWITCH_PATHS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SP_DEFERRED_REASONS_FIELD_NUMBER: _ClassVar[int]
    SP_BENEFIT_S_FIELD_NUMBER: _ClassVar[int]
    SP_HARM_S_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_GAIN_S_FIELD_NUMBER: _ClassVar[int]
    HOLD_HARM_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DEADLINES_FIELD_NUMBER: _ClassVar[int]
    COLD_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    instance_id: str
    index: int
    sent_unix: float
    wall_s: float
    active_s: float
    switch_s: float
    bound_s: float
    predicted_s: float
    shortfall_s: float
    deadline_risk: bool
    infeasible: _containers.RepeatedScalarFieldContainer[str]
    phase_s: _containers.ScalarMap[str, float]
    phase_count: _containers.ScalarMap[str, int]
    sp_admitted: int
    sp_deferred: int
    sp_ineligible: _containers.ScalarMap[str, int]
    p_admitted: int
    p_deferred: int
    switch_paths: _containers.RepeatedScalarFieldContainer[str]
    flags: _containers.ScalarMap[str, bool]
    num_slots: int
    sp_deferred_reasons: _containers.ScalarMap[str, int]
    sp_benefit_s: float
    sp_harm_s: float
    holds: int
    hold_gain_s: float
    hold_harm_s: float
    token_deadlines: TokenDeadlineStats
    cold_scheduler: str
    def __init__(self, schema_version: _Optional[int] = ..., instance_id: _Optional[str] = ..., index: _Optional[int] = ..., sent_unix: _Optional[float] = ..., wall_s: _Optional[float] = ..., active_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., bound_s: _Optional[float] = ..., predicted_s: _Optional[float] = ..., shortfall_s: _Optional[float] = ..., deadline_risk: _Optional[bool] = ..., infeasible: _Optional[_Iterable[str]] = ..., phase_s: _Optional[_Mapping[str, float]] = ..., phase_count: _Optional[_Mapping[str, int]] = ..., sp_admitted: _Optional[int] = ..., sp_deferred: _Optional[int] = ..., sp_ineligible: _Optional[_Mapping[str, int]] = ..., p_admitted: _Optional[int] = ..., p_deferred: _Optional[int] = ..., switch_paths: _Optional[_Iterable[str]] = ..., flags: _Optional[_Mapping[str, bool]] = ..., num_slots: _Optional[int] = ..., sp_deferred_reasons: _Optional[_Mapping[str, int]] = ..., sp_benefit_s: _Optional[float] = ..., sp_harm_s: _Optional[float] = ..., holds: _Optional[int] = ..., hold_gain_s: _Optional[float] = ..., hold_harm_s: _Optional[float] = ..., token_deadlines: _Optional[_Union[TokenDeadlineStats, _Mapping]] = ..., cold_scheduler: _Optional[str] = ...) -> None: ...

class TokenDeadlineStats(_message.Message):
    __slots__ = ("tokens", "tokens_on_time", "first_tokens", "first_on_time", "gap_p50_s", "gap_p90_s", "gap_p99_s", "gap_max_s", "gap_bucket_le_s", "gap_bucket_count")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ON_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ON_TIME_FIELD_NUMBER: _ClassVar[int]
    GAP_P50_S_FIELD_NUMBER: _ClassVar[int]
    GAP_P90_S_FIELD_NUMBER: _ClassVar[int]
    GAP_P99_S_FIELD_NUMBER: _ClassVar[int]
    GAP_MAX_S_FIELD_NUMBER: _ClassVar[int]
    GAP_BUCKET_LE_S_FIELD_NUMBER: _ClassVar[int]
    GAP_BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    tokens_on_time: int
    first_tokens: int
    first_on_time: int
    gap_p50_s: float
    gap_p90_s: float
    gap_p99_s: float
    gap_max_s: float
    gap_bucket_le_s: _containers.RepeatedScalarFieldContainer[float]
    gap_bucket_count: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[int] = ..., tokens_on_time: _Optional[int] = ..., first_tokens: _Optional[int] = ..., first_on_time: _Optional[int] = ..., gap_p50_s: _Optional[float] = ..., gap_p90_s: _Optional[float] = ..., gap_p99_s: _Optional[float] = ..., gap_max_s: _Optional[float] = ..., gap_bucket_le_s: _Optional[_Iterable[float]] = ..., gap_bucket_count: _Optional[_Iterable[int]] = ...) -> None: ...
