"""Reasoning parsers: a reasoning model's generated text -> reasoning text + answer text, one parser per format.

Design note. Like the tool-call parsers (``talaria/tool_parsers.py``) these are pure, incremental state
machines (no I/O, no tokenizer): ``feed(delta)`` takes the text as it streams and returns
:class:`ReasoningDelta` / :class:`ContentDelta` events as soon as they are certain; ``finish()`` releases
what was held back. Text that could be the beginning of a delimiter is held until it cannot be, so a
delimiter split across stream deltas (``"</thi"`` + ``"nk>"``) never leaks into either side. They run in the
router, before the tool-call parser: the answer text (never the reasoning) is what is parsed for tool calls.

Formats (which one a model uses is configuration: ``engines[].reasoning_parsers`` names it per model, and
by default it is detected from the chat template, :func:`detect_format`):

* ``think`` — Qwen3 / QwQ / DeepSeek-R1 / SmolLM3: ``<think>reasoning</think>answer``. The reasoning is
  open from the start when the rendered prompt itself ends inside an unclosed ``<think>`` (DeepSeek-R1's
  and newer Qwen templates put ``<think>\\n`` in the generation prompt; ``prompt_opens``); otherwise only a
  ``<think>`` at the very start of the output (after white space) opens it. Output that never closes its
  reasoning (cut by ``max_tokens``) is all reasoning; the white space right after ``</think>`` is dropped
  (templates put ``\\n\\n`` there), as is a leading ``<think>`` the model repeats after the prompt opened it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

FORMATS = ("think",)
NONE = "none"  # configuration value: the model's output is never parsed for reasoning


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


# what a reasoning parser's feed()/finish() hand out, in order
ReasoningEvent = ReasoningDelta | ContentDelta


def detect_format(chat_template: str | None) -> str:
    """The reasoning format a chat template speaks ("" = none): ``think`` when it mentions ``<think>``."""
    return "think" if "<think>" in (chat_template or "") else ""


def prompt_opens_reasoning(prompt_text: str, fmt: str) -> bool:
    """Whether a rendered prompt ends inside an unclosed reasoning block of ``fmt`` (so the output starts
    inside the reasoning)."""
    if fmt != "think":
        return False
    return prompt_text.rfind(ThinkParser.OPEN) > prompt_text.rfind(ThinkParser.CLOSE)


def prompt_closes_reasoning(prompt_text: str, fmt: str) -> bool:
    """Whether a rendered prompt ends with a closed reasoning block of ``fmt``, white space aside: the template
    turned reasoning off (Qwen3's ``enable_thinking: false`` puts ``<think></think>`` in the generation prompt),
    so the output is all answer."""
    return fmt == "think" and prompt_text.rstrip().endswith(ThinkParser.CLOSE)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ThinkParser:
    """``<think>…</think>``. States: ``start`` (nothing but white space seen: a ``<think>`` may still open
    the reasoning), ``reasoning``, ``content``. Mutates only itself."""

    format = "think"
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, prompt_opens: bool = False) -> None:
        self.state = "start"
        self.opened_by_prompt = prompt_opens
        if prompt_opens:
            self.state = "reasoning"
        self.buffer = ""  # text held back (a possible marker prefix, or leading white space)
        self.reasoning = ""  # reasoning released so far
        self.content = ""  # answer released so far
        self._strip_ws = False  # after </think>: drop the white space that follows it
        self._at_reasoning_start = prompt_opens  # a repeated <think> right after the prompt's is dropped

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def _emit_reasoning(self, text: str) -> list[ReasoningEvent]:
        if not text:
            return []
        self.reasoning += text
        return [ReasoningDelta(text)]

    def _emit_content(self, text: str) -> list[ReasoningEvent]:
        if self._strip_ws:
            text = text.lstrip()
            if not text:
                return []
            self._strip_ws = False
        if not text:
            return []
        self.content += text
        return [ContentDelta(text)]

    def feed(self, delta: str) -> list[ReasoningEvent]:
        text = self.buffer + delta
        self.buffer = ""
        out: list[ReasoningEvent] = []
        while text:
            if self.state == "start":
                s = text.lstrip()
                if not s:
                    self.buffer = text  # only white space so far: still undecided
                    return out
                if s.startswith(self.OPEN):
                    self.state, text = "reasoning", s[len(self.OPEN):]
                    continue
                if self.OPEN.startswith(s):
                    self.buffer = text  # a possible "<think>" still arriving
                    return out
                self.state = "content"
                continue
            if self.state == "reasoning":
                if self._at_reasoning_start:
                    s = text.lstrip()
                    if not s or (self.OPEN.startswith(s) and s != self.OPEN):
                        self.buffer = text
                        return out
                    self._at_reasoning_start = False
                    if s.startswith(self.OPEN):
                        text = s[len(self.OPEN):]
                        continue
                end = text.find(self.CLOSE)
                if end >= 0:
                    out += self._emit_reasoning(text[:end])
                    self.state, self._strip_ws = "content", True
                    text = text[end + len(self.CLOSE):]
                    continue
                keep = _held(text, self.CLOSE)
                out += self._emit_reasoning(text[: len(text) - keep])
                self.buffer = text[len(text) - keep:]
                return out
            out += self._emit_content(text)  # content: everything after the reasoning is the answer
            return out
        return out

    def finish(self) -> list[ReasoningEvent]:
        """End of output: release what was held (a partial marker is text of the side it was held on)."""
        text, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return self._emit_reasoning(text)
        return self._emit_content(text)


class TokenCounter:
    """Reasoning tokens of an output counted by token id, for a model whose ``<think>`` and ``</think>`` are
    single tokens (Qwen3, DeepSeek-R1): from the start (``prompt_opens``) or a leading ``<think>`` up to and
    including the first ``</think>``, i.e. every token :class:`ReasoningGate` does not hand the answer, the markers
    included. Exact where the text parser's view of a merged chunk is not. Mutates only itself."""

    def __init__(self, open_id: int, close_id: int, prompt_opens: bool) -> None:
        self.gate = ReasoningGate(open_id, close_id, prompt_opens)
        self.count = 0

    def feed(self, ids: Iterable[int]) -> None:
        for t in ids:
            if self.gate.state == "answer":
                return
            was = self.gate.state
            self.gate.feed(t)
            if "reasoning" in (was, self.gate.state):  # <think>, a token inside, or </think>
                self.count += 1


class ReasoningGate:
    """Structured output after the reasoning (as vLLM does for a reasoning model): the call's grammar governs
    the answer only, for a model whose ``<think>`` and ``</think>`` are single tokens. States: ``start`` (the
    first token may open the reasoning: the grammar's tokens plus ``<think>`` are allowed), ``reasoning``
    (nothing constrained, up to and including ``</think>``), ``answer`` (the grammar; a first token other than
    ``<think>`` goes straight there). A prompt that opened the reasoning starts in ``reasoning``. A gate built
    for a prompt that closed it is never made (the grammar starts at the first token: ``prompt_closes_reasoning``).
    ``budget`` (vLLM's ``thinking_token_budget``; 0 = none): once that many tokens are inside the reasoning
    (the markers not counted), the next token must be ``</think>`` (``must_close``), as vLLM and llama.cpp
    force the end of a reasoning that outgrows its budget. Pure; ``feed`` mutates only its state."""

    def __init__(self, open_id: int, close_id: int, prompt_opens: bool, budget: int = 0) -> None:
        self.open_id, self.close_id = open_id, close_id
        self.state = "reasoning" if prompt_opens else "start"
        self.budget = budget
        self.spent = 0  # tokens inside the reasoning so far

    @property
    def must_close(self) -> bool:
        """The reasoning has used its budget: the next token is ``close_id``."""
        return self.state == "reasoning" and 0 < self.budget <= self.spent

    @property
    def constrained(self) -> bool:
        """The next token is masked by the grammar (with ``open_id`` also allowed in ``start``)."""
        return self.state != "reasoning"

    def feed(self, token: int) -> bool:
        """Advance by a sampled token; True when it is the answer's, i.e. the grammar's matcher takes it."""
        if self.state == "start":
            if token == self.open_id:
                self.state = "reasoning"
                return False
            self.state = "answer"
            return True
        if self.state == "reasoning":
            if token == self.close_id:
                self.state = "answer"
            else:
                self.spent += 1
            return False
        return True


def marker_ids(fmt: str, token_to_id: Callable[[str], int | None]) -> tuple[int, int] | None:
    """The token ids of ``fmt``'s open and close markers when both are single tokens of the vocabulary."""
    if fmt != "think":
        return None
    open_id, close_id = token_to_id(ThinkParser.OPEN), token_to_id(ThinkParser.CLOSE)
    if open_id is None or close_id is None:
        return None
    return open_id, close_id


def token_counter(fmt: str, token_to_id: Callable[[str], int | None], prompt_opens: bool) -> TokenCounter | None:
    """A :class:`TokenCounter` for ``fmt`` when its markers are single tokens of the vocabulary, else None."""
    ids = marker_ids(fmt, token_to_id)
    return TokenCounter(*ids, prompt_opens) if ids is not None else None


_PARSERS = {"think": ThinkParser}


def make_parser(fmt: str, prompt_opens: bool = False) -> ThinkParser:
    try:
        return _PARSERS[fmt](prompt_opens=prompt_opens)
    except KeyError:
        raise ValueError(f"unknown reasoning format {fmt!r}; known: {', '.join(FORMATS)}") from None


def split(fmt: str, text: str, prompt_opens: bool = False) -> tuple[str, str]:
    """Whole-output convenience: (reasoning, content)."""
    p = make_parser(fmt, prompt_opens)
    p.feed(text)
    p.finish()
    return p.reasoning, p.content


# Template switches for reasoning effort, in the order they are tried: the chat-template variable a
# template reads, and the value it gets for a requested effort ("none" turns reasoning off).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's ReasoningEffort


def effort_kwargs(chat_template: str | None, effort: str) -> dict[str, Any] | None:
    """The chat-template variables that set ``effort`` on a template that has a switch for it, or None when
    it has none: ``reasoning_effort`` (gpt-oss and others: the effort itself), else ``enable_thinking``
    (Qwen3, SmolLM3: on unless the effort is ``none``)."""
    t = chat_template or ""
    if "reasoning_effort" in t:
        return {"reasoning_effort": effort}
    if "enable_thinking" in t:
        return {"enable_thinking": effort != "none"}
    return None
