"""Request state inside the engine (pure Python, no torch)."""

from __future__ import annotations

import itertools
from enum import Enum

from services.engine.types import SamplingParams

_counter = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request's tokens and KV bookkeeping.

    ``token_ids`` = prompt + generated tokens. ``num_computed_tokens`` tokens have their KV written into
    ``pages`` (a decoding sequence has ``num_tokens - 1`` computed: its last sampled token is written by
    the next step). ``num_cached_tokens`` prompt tokens were served from a cache at the latest admission.
    """

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "sampling", "session_id", "arrival_order",
        "num_computed_tokens", "num_cached_tokens", "pages", "locked_hashes", "hashes", "status",
        "num_preemptions", "trace_context", "num_restored_tokens", "salt", "kv_hold", "phases", "priority", "queue_at",
        "num_published_pages",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None, session_id: str = "") -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling or SamplingParams()
        self.session_id = session_id
        self.arrival_order = next(_counter)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.pages: list[int] = []
        self.locked_hashes: list[int] = []
        self.hashes: list[int] = []  # cumulative hashes of full pages of token_ids (grown lazily)
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.trace_context = None  # OpenTelemetry context of the call (host-KV spans are its children)
        self.num_restored_tokens = 0  # prompt tokens restored from the host KV store at admission
        self.salt: int | None = None  # start of this sequence's hash chain; None = the KV manager's (model) salt
        self.kv_hold: list[int] = []  # radix path of a host restore, locked until admission (KVManager.adopt_restore)
        self.phases = None  # talaria.attribution.PhaseClock, moved by the executor (exact time split)
        self.priority = 0  # call hint: waiting order (larger first, ties by arrival); see Scheduler.add
        self.queue_at = 0.0  # arrival time minus the latency-sensitivity hint (order within a priority)
        self.num_published_pages = 0  # full pages of ``hashes`` in the radix cache while it runs (Scheduler._publish_running)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, pages={self.pages})"
        )
