"""Shaping the engine's text stream into OpenAI chat output: content, ``tool_calls``, finish reasons.

Where tool calls are parsed: here, in the router, on the text the engine streams. The engine names the
model's tool-call format on its ``accepted`` chunk (``TokenChunk.tool_format``, from the chat template), and
the router runs the matching pure incremental parser from ``talaria/tool_parsers.py``. The same parser
objects can run inside the engine when the scheduler needs to know of a tool call as it streams:
they hold no router state.

Streaming follows OpenAI: text as ``delta.content``; a call as ``delta.tool_calls[{index, id, type,
function{name, arguments: ""}}]`` then ``delta.tool_calls[{index, function{arguments: "<more>"}}]``;
``finish_reason: "tool_calls"`` when the output was calls. Arguments stream as they are generated when the
output is grammar-constrained to the call format (``eager``); otherwise each call is released once it is
complete and valid, so an invalid claimed call can still come back as plain text with ``finish_reason``
``stop`` (never an error).
"""

from __future__ import annotations

import json

from talaria import reasoning_parsers
from talaria.tool_parsers import ArgumentsDelta, CallHeader, TextDelta, make_parser


class ChatOutput:
    """One choice's output. ``feed(text, tokens)`` -> list of ``delta`` dicts; ``finish(reason)`` -> (deltas, reason).

    Reasoning (a model with a reasoning format, ``TokenChunk.reasoning_format``): the text first goes through
    the reasoning parser (``talaria/reasoning_parsers.py``); its reasoning streams as ``delta.reasoning_content``
    (vLLM's field) and only the answer goes on to the tool-call parser, so reasoning always precedes content
    and a ``<tool_call>`` inside the reasoning is not a call. ``reasoning_tokens`` counts the tokens of the
    chunks that carried reasoning; a chunk that ends the reasoning and starts the answer is split by
    characters (exact when chunks are single tokens, as streamed; an estimate for a non-streaming call,
    whose tokens after the first arrive as one chunk). The engine's count by token id, where the model's
    markers are single tokens, replaces it (:func:`reasoning_usage`).

    Mutates only itself. With ``tool_format`` and ``reasoning_format`` empty the text passes through unchanged."""

    def __init__(self, tool_format: str = "", eager: bool = False, parallel: bool = True, reasoning_format: str = "",
                 reasoning_open: bool = False) -> None:
        self.parser = make_parser(tool_format, eager=eager) if tool_format else None
        self.reasoner = reasoning_parsers.make_parser(reasoning_format, reasoning_open) if reasoning_format else None
        self.parallel = parallel
        self.content = ""  # content released so far
        self.reasoning = ""  # reasoning released so far
        self.reasoning_tokens = 0
        self.calls: list[dict] = []  # finished OpenAI tool calls (non-streaming view)

    def _deltas(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, TextDelta):
                if e.text:
                    self.content += e.text
                    out.append({"content": e.text})
            elif isinstance(e, CallHeader):
                if e.index > 0 and not self.parallel:
                    continue
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ArgumentsDelta):
                if e.index > 0 and not self.parallel:
                    continue
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    def _answer(self, text: str) -> list[dict]:
        if self.parser is None:
            if text:
                self.content += text
                return [{"content": text}]
            return []
        return self._deltas(self.parser.feed(text))

    def _split(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, reasoning_parsers.ReasoningDelta):
                self.reasoning += e.text
                out.append({"reasoning_content": e.text})
            else:
                out += self._answer(e.text)
        return out

    def feed(self, text: str, tokens: int = 0) -> list[dict]:
        """The deltas of the next piece of output (``tokens``: how many tokens it is, for usage)."""
        if self.reasoner is None:
            return self._answer(text)
        before = self.reasoner.in_reasoning
        events = self.reasoner.feed(text)
        r = sum(len(e.text) for e in events if isinstance(e, reasoning_parsers.ReasoningDelta))
        c = sum(len(e.text) for e in events if isinstance(e, reasoning_parsers.ContentDelta))
        if before or self.reasoner.in_reasoning or r:
            if not c:
                self.reasoning_tokens += tokens
            else:  # the piece ends the reasoning and starts the answer: its tokens split by characters
                r += len(self.reasoner.CLOSE)
                self.reasoning_tokens += round(tokens * r / (r + c))
        return self._split(events)

    def finish(self, reason: str) -> tuple[list[dict], str]:
        """Close the output; returns the remaining deltas and the finish reason to report."""
        held = self._split(self.reasoner.finish()) if self.reasoner is not None else []
        if self.parser is None:
            return held, reason
        deltas, reason = self._finish_calls(reason)
        return held + deltas, reason

    def _finish_calls(self, reason: str) -> tuple[list[dict], str]:
        res = self.parser.finish()
        if not res.tool_calls:  # plain text, or a claimed call that did not parse: the rest as text
            rest = self.parser.raw[len(self.content) :]
            self.content += rest
            return ([{"content": rest}] if rest else []), reason
        deltas = self._deltas(self.parser.tail_events(res))
        calls = res.tool_calls if self.parallel else res.tool_calls[:1]
        self.calls = [c.openai() for c in calls]
        return deltas, ("tool_calls" if reason == "stop" else reason)

    def message(self) -> dict:
        """The non-streaming ``message`` after :meth:`finish`."""
        msg: dict = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.reasoner is not None:
            msg["reasoning_content"] = self.reasoning or None
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


def chat_output(req, accepted) -> ChatOutput:
    """The output shaper of a chat request, from the engine's accepted chunk (its ``tool_format``,
    ``reasoning_format``, ``reasoning_open`` and ``constraint_after_reasoning``)."""
    # Structured output (tool_choice required/named, a JSON response_format) is a grammar: after the reasoning
    # where the engine says so (a reasoning model whose markers are single tokens, its prompt not closing the
    # reasoning), else from the first token, when the output holds no reasoning and is not parsed for it
    constrained = bool(req.constraint_proto().kind)
    fmt = accepted.reasoning_format if not constrained or accepted.constraint_after_reasoning else ""
    reasoning = {"reasoning_format": fmt, "reasoning_open": accepted.reasoning_open}
    if not req.tools_enabled():
        return ChatOutput(**reasoning)
    constrained = req.tool_choice not in (None, "auto")  # required / named: the grammar guarantees the format
    return ChatOutput(accepted.tool_format or "hermes", eager=constrained, parallel=req.parallel_tool_calls is not False, **reasoning)


def reasoning_usage(usage: dict, out: ChatOutput | None, engine_count: int = 0) -> dict:
    """``usage`` with OpenAI's ``completion_tokens_details.reasoning_tokens`` when the model reasons: the
    engine's count by token id (``Usage.reasoning_tokens``) where it made one, else the chunks' count
    (:class:`ChatOutput`). Mutates ``usage``."""
    if out is not None and out.reasoner is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": engine_count or out.reasoning_tokens}
    return usage


class ChunkEvents:
    """The SSE events (``data: <json>\\n\\n``) of one streamed call: ``chat.completion.chunk`` or
    ``text_completion`` objects with the call's id, creation time and model.

    ``event`` encodes any choice list (plus ``usage`` and the resume token). ``text`` (completions) and
    ``content`` (chat) encode the per-token event of plain output without logprobs from a template built
    once per call, so a streamed token costs one ``json.dumps`` of its text instead of building and encoding
    the whole object; the bytes are exactly ``event``'s for the same choice (the key order and compact
    separators of ``json.dumps(..., separators=(",", ":"))``; tested). Holds no state beyond the template."""

    __slots__ = ("rid", "obj", "created", "model", "_head", "_tail")

    def __init__(self, rid: str, created: int, model: str, chat: bool) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        head = json.dumps({"id": rid, "object": self.obj, "created": created, "model": model}, separators=(",", ":"))
        self._head = b"data: " + head[:-1].encode() + b',"choices":[{"index":0,'
        self._tail = b',"finish_reason":null,"logprobs":null}]}\n\n'

    def event(self, choices: list, usage: dict | None = None, token: str | None = None) -> bytes:
        d: dict = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        if token:
            d["resume_token"] = token  # the streaming form of the X-Talaria-Resume-Token header
        return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

    def text(self, text: str) -> bytes:
        """``event([{"index": 0, "text": text, "finish_reason": None, "logprobs": None}])``."""
        return self._head + b'"text":' + json.dumps(text).encode() + self._tail

    def content(self, text: str) -> bytes:
        """``event([{"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None}])``."""
        return self._head + b'"delta":{"content":' + json.dumps(text).encode() + b"}" + self._tail


class Logprobs:
    """Token log-probabilities from the engine's chunks, formatted for chat (``{"content": [...]}``) or
    completions (``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``). ``add`` queues
    entries; ``take`` returns the queued ones formatted (None when the call did not ask) and clears them."""

    def __init__(self, chat: bool, enabled: bool) -> None:
        self.chat, self.enabled = chat, enabled
        self.pending: list = []
        self.offset = 0  # completions: text offset of the next token

    def add(self, entries) -> None:
        if self.enabled:
            self.pending.extend(entries)

    def take(self) -> dict | None:
        if not self.enabled:
            return None
        entries, self.pending = self.pending, []
        if self.chat:
            def one(t, lp):
                return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}
            return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(a.token, a.logprob) for a in e.top]} for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{a.token: a.logprob for a in e.top} for e in entries], "text_offset": offsets}


def echo_prefix(req) -> str:
    """Completions ``echo``: the prompt text before the completion ("" otherwise)."""
    return req.prompt if getattr(req, "echo", False) and isinstance(req.prompt, str) else ""
