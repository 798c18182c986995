"""Request bodies of the OpenAI-compatible API (pydantic, validated at the edge).

Unknown fields are accepted and ignored (clients send vendor extras); fields we do not support with a
non-default value (``n > 1``, ``logprobs``, tools) are rejected with a clear 422 rather than ignored.
Extensions: ``top_k``, ``ignore_eos`` (fixed-length replays), ``session_id``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    session_id: str | None = None
    ignore_eos: bool = False
    logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

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
    max_completion_tokens: int | None = None

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)):
                if len(v) != 1:
                    raise ValueError("batched prompts are not supported; send one prompt per request")
                v = v[0]
        if isinstance(v, str) and v == "":
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any((not isinstance(t, int)) or t < 0 for t in v):
            raise ValueError("token ids must be non-negative integers")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens
