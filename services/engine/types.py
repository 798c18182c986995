"""Plain data types at the boundary of the executor (no torch, no I/O).

The engine service decodes a protobuf ``GenerateRequest`` into an :class:`EngineRequest`, hands it to the
executor, and encodes each :class:`RequestOutput` back into a protobuf ``TokenChunk``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from talaria.attribution import CallAttribution, PhaseClock

# One sampled token's log-probabilities: (token id, logprob, [(alternative id, logprob), ...] most likely first).
Logprob = tuple[int, float, list[tuple[int, float]]]


# Temperatures below this sample greedily: dividing logits by a denormal temperature overflows to inf/nan
# (``temperature=1e-45`` crashed the sampler), and any temperature this small is argmax anyway.
GREEDY_TEMPERATURE = 1e-5


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop string/token
    LENGTH = "length"  # max_tokens reached (or the context limit)
    ABORT = "abort"  # cancelled by the caller or the engine shutting down
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 => disabled
    seed: int | None = None  # per-request generator seed; None => engine-derived from request id
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: object = field(default=None, compare=False)  # compiled xgrammar grammar (services/engine/grammar.py)
    # a reasoning model's constrained or budgeted call: (<think> id, </think> id, the prompt opened the reasoning,
    # the thinking_token_budget, 0 = none); the grammar starts after the reasoning, which ends at the budget
    # (reasoning_parsers.ReasoningGate; built by the engine service from the wire, as ``grammar`` is)
    reasoning_gate: tuple[int, int, bool, int] | None = None
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: logits of prompt + generated tokens divided (>0) / multiplied (<0)
    min_p: float = 0.0  # drop tokens with probability < min_p * the most likely token's
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int = -1  # -1 off; k >= 0: the sampled token's log-probability and the k most likely
    skip_special_tokens: bool = False  # vLLM's: the output text leaves out special tokens
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string ends the text (else cut)

    @property
    def shapes_logits(self) -> bool:
        """The request changes logits before sampling (penalties, bias): it needs its token history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str = ""  # empty => no session cache entry is kept after the call
    arrival_time: float = 0.0
    model: str = ""  # catalog model of the call (a cold engine serves several; a hot engine ignores it)
    trace_context: object = None  # OpenTelemetry context of the call (its engine span): parent of host-KV spans
    tenant: str = ""  # the router-authenticated tenant; its prefix hashes get their own salt
    cache_salt: str = ""  # vLLM's cache_salt: salts the prefix hashes further, within the tenant
    # per-call token deadline hints (seconds; 0 = the engine's configured T_TTFT / T_TPOT)
    ttft_target_s: float = 0.0
    tpot_target_s: float = 0.0
    phases: PhaseClock | None = None  # the call's phase clock (set by the engine at intake)
    priority: int = 0  # call hint: larger = admitted earlier among waiting calls (ties: arrival order)
    latency_sensitivity_s: float = 0.0  # Dynamo's hint: queue as if arrived this much earlier


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix/session cache (not recomputed)
    restored_tokens: int = 0  # of the cached tokens, those restored from the host KV store at admission


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """Incremental output of one request after one engine step.

    ``new_token_ids``/``new_text`` hold only what was produced since the previous output of this request.
    Text withheld because it might be the beginning of a stop string is released later (or dropped when
    the stop string completes).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set on the final output
    error: str = ""
    logprobs: list[Logprob] | None = None  # per new token (logprobs requested)
    attribution: CallAttribution | None = None  # on the final output: the engine's phases
    stop_reason: str = ""  # vLLM's, on the final output: the stop string that ended it ("" = none)
