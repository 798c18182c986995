"""The executor API the engine service programs against (so a mock/offline backend can stand in)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from services.engine.types import EngineRequest, RequestOutput, SamplingParams


@runtime_checkable
class Backend(Protocol):
    model_id: str
    max_context: int
    vocab_size: int
    tokenizer: Any

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request (thread-safe). Raises ValueError subclasses for invalid requests."""

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); it finishes with ``FinishReason.ABORT`` at the next step."""

    def step(self) -> list[RequestOutput]:
        """One schedule + forward + sample + postprocess. Call from a single thread."""

    def has_unfinished(self) -> bool: ...

    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]: ...

    def stats(self) -> dict[str, Any]: ...

    def session_info(self, session_id: str) -> dict[str, Any] | None: ...

    def flush_cache(self) -> int: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...
