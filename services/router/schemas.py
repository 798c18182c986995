"""Request bodies of the OpenAI-compatible API (pydantic, validated at the edge).

Every field of the ``openai`` package's chat-completion and completion request types is declared here and
either honoured (carried to the engine on the wire, or acted on by the router) or rejected with a 400 naming
it when it carries a value we cannot honour (:data:`UNSUPPORTED`). Fields the OpenAI API does not know and
that are not one of our extensions are rejected too (``extra="forbid"``): nothing is ever ignored silently.

Bounds the wire cannot carry are checked here, before any protobuf is built: ``top_k`` and
token ids are ``uint32``, ``seed`` is ``int64``, and every string must be encodable as UTF-8 (a lone UTF-16
surrogate such as ``"\\udc80"`` is valid JSON but not a protobuf string).

Extensions (vLLM-style, sent via the client's ``extra_body``): ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos`` (fixed-length replays), ``session_id``; ``skip_special_tokens``,
``include_stop_str_in_output``, ``cache_salt`` and, for chat, ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, ``thinking_token_budget`` (vLLM's meanings; docs/protocols.md), and OpenAI's
``reasoning_effort`` through the model's template switch; the per-call agent hints ``priority``, ``expected_output_tokens``, ``expected_tool_s``,
``cache_ttl_s`` and their Dynamo aliases ``nvext.agent_hints`` / ``cache_control`` (``hints.py``). The session key of a call is the ``X-Session-ID`` header, else ``session_id``, else
``prompt_cache_key`` (OpenAI's own cache-affinity key), else ``user``, else ``safety_identifier``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from services.router.errors import APIError
from services.router.hints import HintFields
from talaria.v1 import engine_pb2 as pb

UINT32_MAX = (1 << 32) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _absent(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v in (None, False)


def _zero(v: Any) -> bool:
    return v is None or v == 0


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


# Field -> predicate "this value needs nothing we lack". A value failing its predicate is a 400 naming the
# field. As a feature lands, its entry leaves this table (and the field is carried on the wire instead).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # sampling surface not implemented yet
    "best_of": (lambda v: v in (None, 1), "best_of other than 1 is not supported"),
    "suffix": (_absent, "suffix (insertion) is not supported"),
    "n": (lambda v: v in (None, 1), "n > 1 is served by services/router/fanout.py before parsing"),
    # structured output / tools
    # OpenAI platform features with no equivalent here
    "functions": (_empty, "functions/function_call are deprecated and not supported; use tools"),
    "function_call": (_absent, "functions/function_call are deprecated and not supported; use tools"),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "metadata": (_empty, "metadata needs stored completions, which are not supported"),
    "store": (_false, "stored completions are not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default service tier exists"),
    "verbosity": (_absent, "verbosity is not supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "prompt_cache_retention": (_absent, "prompt_cache_retention is not supported (retention is the engine's policy)"),
    "prompt_cache_options": (_absent, "prompt_cache_options is not supported (retention is the engine's policy)"),
    "moderation": (_absent, "moderation is not supported"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # obfuscation pads deltas on OpenAI's side; none here (accepted, no-op by definition)


class _Common(HintFields):  # per-call hints and their Dynamo aliases (services/router/hints.py)
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # extensions (vLLM-style)
    top_k: int = Field(0, ge=0, le=UINT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    session_id: str | None = None
    # vLLM's output options and cache salt (wire: SamplingParams / GenerateRequest.cache_salt)
    skip_special_tokens: bool | None = None  # default: special tokens stay in the text (vLLM's default is true)
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.isdigit() or int(k) > UINT32_MAX:
                raise ValueError(f"keys must be token ids, got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"biases must be within [-100, 100], got {b}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(not 0 <= t <= UINT32_MAX for t in v):
            raise ValueError(f"token ids must be in [0, {UINT32_MAX}]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def session_key(self, header: str | None) -> str:
        """The call's session: the ``X-Session-ID`` header, else ``session_id``, ``prompt_cache_key``, ``user``,
        ``safety_identifier``. With a ``cache_salt`` the session is the salt's own (a session's KV
        is reused by session, so calls of another salt must not find it): ``<key>#salt-<digest>``."""
        key = header or self.session_id or getattr(self, "prompt_cache_key", None) or self.user
        key = (key or getattr(self, "safety_identifier", None) or "")[:256]
        if key and self.cache_salt:
            key += "#salt-" + hashlib.sha256(self.cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return key

    def sampling_proto(self, max_tokens: int) -> pb.SamplingParams:
        """The honoured sampling fields as their wire message (``max_tokens`` resolved by the caller)."""
        sp = pb.SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            stop_token_ids=self.stop_token_ids or [],
            skip_special_tokens=bool(self.skip_special_tokens),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )
        for k, b in (self.logit_bias or {}).items():
            sp.logit_bias[int(k)] = b
        if self.seed is not None:
            sp.has_seed, sp.seed = True, self.seed
        return sp


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs 'json_schema'", code="missing_field", param="response_format.json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise APIError(400, f"'json_schema' does not go with response_format type {self.type}", code="invalid_value", param="response_format.json_schema")
        return self


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: str


class ToolCallMsg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMsg] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning sent back (vLLM's field): to the template
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("refusal", "audio", "function_call")
    @classmethod
    def _unsupported_parts(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(f"assistant '{info.field_name}' in the history is not supported")
        return v

    def check_tool_turn(self, i: int) -> None:
        if self.tool_calls and self.role != "assistant":
            raise APIError(400, "only assistant messages carry tool_calls", code="invalid_value", param=f"messages.{i}.tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise APIError(400, "only assistant messages carry reasoning_content", code="invalid_value", param=f"messages.{i}.reasoning_content")
        if self.role == "tool" and not self.tool_call_id:
            raise APIError(400, "a tool message needs tool_call_id", code="missing_field", param=f"messages.{i}.tool_call_id")

    def proto(self) -> pb.ChatMessage:
        m = pb.ChatMessage(role=self.role, content=self.text(), has_content=self.content is not None)
        if self.name:
            m.name = self.name
        if self.tool_calls:
            m.tool_calls_json = json.dumps([c.model_dump() for c in self.tool_calls], ensure_ascii=False)
        if self.tool_call_id:
            m.tool_call_id = self.tool_call_id
        if self.reasoning_content:
            m.reasoning_content = self.reasoning_content
        return m

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # set through the model's chat-template switch (ChatTemplateOptions.reasoning_effort); the engine
    # answers 400 naming it for a model with no reasoning parser or no switch (talaria/reasoning_parsers.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's cap on the reasoning (tokens inside it; then its close marker is forced): the engine's 400 for a
    # model where it cannot be enforced (no reasoning parser, or markers that are not single tokens)
    thinking_token_budget: int | None = Field(None, ge=1, le=UINT32_MAX)
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    safety_identifier: str | None = None  # an end-user id: the session key of last resort (after `user`)
    prompt_cache_key: str | None = None  # honoured as the session key (see module docstring)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: Any = None
    # vLLM's chat-template options (wire: GenerateRequest.chat_template)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _template_options(self) -> "ChatCompletionRequest":
        """vLLM's rules: ``continue_final_message`` ends the prompt inside the final message, so it cannot go
        with an explicit ``add_generation_prompt: true``; it needs a final assistant message with text."""
        from talaria.tokenizer import RESERVED_TEMPLATE_VARS  # the router imports the tokenizer lazily

        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_VARS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set '{reserved[0]}': the request itself sets it", code="invalid_value", param=f"chat_template_kwargs.{reserved[0]}")
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true", code="invalid_value", param="continue_final_message")
            last = self.messages[-1]
            if last.role != "assistant" or not isinstance(last.content, (str, list)) or not last.text():
                raise APIError(400, "continue_final_message needs a final assistant message with text content", code="invalid_value", param="continue_final_message")
        return self

    def template_proto(self) -> pb.ChatTemplateOptions | None:
        """The chat-template options as their wire message; None when all are the defaults."""
        if self.chat_template_kwargs is None and self.add_generation_prompt and not self.continue_final_message and self.reasoning_effort is None:
            return None
        return pb.ChatTemplateOptions(
            kwargs_json=json.dumps(self.chat_template_kwargs, ensure_ascii=False) if self.chat_template_kwargs is not None else "",
            no_generation_prompt=not self.add_generation_prompt or self.continue_final_message,
            continue_final_message=self.continue_final_message,
            reasoning_effort=self.reasoning_effort or "",
        )

    @model_validator(mode="after")
    def _tool_consistency(self) -> "ChatCompletionRequest":
        """Raises :class:`APIError` (it passes through pydantic) so the 400 names the exact field."""
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise APIError(400, f"tool_choice {self.tool_choice!r} needs tools", code="invalid_value", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(400, f"tool_choice names function '{self.tool_choice.function.name}', which is not in tools", code="invalid_value", param="tool_choice")
        if len(set(names)) != len(names):
            raise APIError(400, "tools has duplicate function names", code="invalid_value", param="tools")
        for i, m in enumerate(self.messages):
            m.check_tool_turn(i)
        if self.constraint_proto().kind and self.ignore_eos:
            raise APIError(400, "ignore_eos cannot be combined with structured output (the grammar ends the output)", code="invalid_value", param="ignore_eos")
        if self.tools_enabled() and self.tool_choice in (None, "auto") and self.response_format and self.response_format.type != "text":
            raise APIError(400, "response_format json with tools and tool_choice auto is not supported: the grammar would forbid the tool calls", code="unsupported_parameter", param="response_format")
        return self

    def constraint_proto(self) -> pb.Constraint:
        """Structured output to enforce: tool_choice required/named, else a JSON response_format."""
        tc = self.tool_choice
        if self.tools and tc not in (None, "none", "auto"):
            name = tc.function.name if isinstance(tc, NamedToolChoice) else "required"
            return pb.Constraint(kind="tool_call", tool_choice=name, parallel_tool_calls=self.parallel_tool_calls is not False)
        rf = self.response_format
        if rf is None or rf.type == "text":
            return pb.Constraint()
        if rf.type == "json_object":
            return pb.Constraint(kind="json_object")
        js = rf.json_schema
        schema = js.schema_ if js is not None and js.schema_ is not None else {}
        return pb.Constraint(kind="json_schema", json_schema=json.dumps(schema, ensure_ascii=False))

    def sampling_proto(self, max_tokens: int) -> pb.SamplingParams:
        sp = super().sampling_proto(max_tokens)
        sp.constraint.CopyFrom(self.constraint_proto())
        sp.logprobs, sp.top_logprobs = bool(self.logprobs), self.top_logprobs or 0
        sp.thinking_token_budget = self.thinking_token_budget or 0
        return sp

    def tools_enabled(self) -> bool:
        """Output is parsed for tool calls (tools given and ``tool_choice`` is not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tools_json(self) -> str:
        """Tool definitions for the chat template (rendered whenever given, so the prompt prefix is stable)."""
        return json.dumps([t.model_dump(exclude_none=True) for t in self.tools], ensure_ascii=False) if self.tools else ""

    def messages_proto(self) -> pb.ChatMessages:
        out = []
        for i, m in enumerate(self.messages):
            try:
                out.append(m.proto())
            except ValueError as e:
                raise APIError(400, str(e), code="invalid_value", param=f"messages.{i}.content") from None
        return pb.ChatMessages(messages=out)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)):
                if len(v) != 1:
                    raise ValueError("batched prompts are not supported; send one prompt per request")
                v = v[0]
        if isinstance(v, str) and v == "":
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any((not isinstance(t, int)) or not 0 <= t <= UINT32_MAX for t in v):
            raise ValueError(f"token ids must be integers in [0, {UINT32_MAX}]")
        return v

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _echo(self) -> "CompletionRequest":
        if self.echo and not isinstance(self.prompt, str):
            raise APIError(400, "echo is supported for text prompts only", code="unsupported_parameter", param="echo")
        if self.echo and self.stream:
            raise APIError(400, "echo is supported without stream only", code="unsupported_parameter", param="echo")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt log-probabilities) is not supported", code="unsupported_parameter", param="echo")
        return self

    def sampling_proto(self, max_tokens: int) -> pb.SamplingParams:
        sp = super().sampling_proto(max_tokens)
        if self.logprobs is not None:
            sp.logprobs, sp.top_logprobs = True, self.logprobs
        return sp


# --------------------------------------------------------------------------------------------- parsing


def _bad_string(v: Any, path: str) -> str | None:
    """Path of the first string (key or value) in ``v`` that is not valid Unicode for UTF-8 (lone surrogate)."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(v, dict):
        for k, x in v.items():
            sub = f"{path}.{k}" if path else str(k)
            bad = _bad_string(k, sub) or _bad_string(x, sub)
            if bad:
                return bad
    elif isinstance(v, list):
        for i, x in enumerate(v):
            bad = _bad_string(x, f"{path}.{i}")
            if bad:
                return bad
    return None


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as an OpenAI 400 naming the field."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "missing":
        return APIError(400, f"missing required field '{loc}'", code="missing_field", param=loc)
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unrecognized request argument '{loc}'", code="unknown_parameter", param=loc)
    msg = err["msg"]
    return APIError(400, f"invalid value for '{loc}': {msg}" if loc else msg, code="invalid_value", param=loc)


def parse_request(cls: type[_Common], data: dict[str, Any]) -> Any:
    """Validate a JSON body into ``cls``; every failure is an :class:`APIError` 400 naming the field."""
    bad = _bad_string(data, "")
    if bad is not None:
        raise APIError(400, f"'{bad}' contains a lone UTF-16 surrogate (not valid Unicode)", code="invalid_value", param=bad)
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    for name in cls.model_fields:
        rule = UNSUPPORTED.get(name)
        if rule is not None and name in data and not rule[0](data[name]):
            raise APIError(400, rule[1], code="unsupported_parameter", param=name)
    return req
