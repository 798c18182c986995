"""Tool-call parsers: a model's generated text -> content text + tool calls, one parser per output format.

Design note. Pure, incremental state machines (no I/O, no tokenizer): ``feed(delta)`` takes the text as it
streams and returns events as soon as they are certain; ``finish()`` closes the stream. Where a format
marks a call with a header (Hermes/Qwen ``<tool_call>``, Mistral ``[TOOL_CALLS]``, Llama-3
``<|python_tag|>``) the parser knows "a tool call has started" the moment the header's last character
arrives (``in_call`` / :class:`CallStarted`) — the signal a later scheduler hook needs. Text that
could be the beginning of a header is held back until it cannot be.

Formats (chosen by the model's chat template, see :func:`detect_format`):

* ``hermes`` — Hermes / Qwen 2.5+ / Talaria's fallback for templates without tool support:
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number, optional text before.
* ``llama3_json`` — Llama 3.1+ JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several joined by ``;``).
* ``mistral`` — ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.

``arguments`` is returned as the exact text the model generated for the value (validated with
``json.loads``), so a client that sends the call back in the history re-renders the same text, and the next
prompt extends the KV the model produced. A claimed call that is not valid JSON (or not an object with a
string ``name`` and object arguments) makes the whole output plain text (``ParseResult.tool_calls`` empty):
never an exception. Events are only emitted for calls that validated (``eager=False``) or, with
``eager=True`` (output constrained by a grammar, so validity is guaranteed), argument text streams as it
arrives.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, exactly as generated
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    """A tool-call header has been generated (name not known yet)."""


@dataclass(frozen=True, slots=True)
class CallHeader:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


# what a streaming tool parser's feed()/finish() hand out, in order
ToolEvent = TextDelta | CallStarted | CallHeader | ArgumentsDelta


@dataclass(slots=True)
class ParseResult:
    content: str
    tool_calls: list[ToolCall]


def detect_format(chat_template: str | None, model_type: str = "") -> str:
    """The tool-call format a chat template speaks; ``hermes`` for templates without tool support (Talaria
    renders tools for them itself, in that format)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("ipython" in t and "tools" in t):
        return "llama3_json"
    return "hermes"


def _split_object(obj: object, args_keys: tuple[str, ...]) -> tuple[str, object] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    keys = [k for k in args_keys if k in obj]
    if len(keys) > 1 or set(obj) - {"name", *args_keys}:
        return None
    args = obj[keys[0]] if keys else {}
    if not isinstance(args, dict):
        return None
    return obj["name"], args


def _raw_value(text: str, key: str) -> str | None:
    """Exact text of the value of top-level ``key`` in the JSON object ``text`` (already known valid)."""
    dec = json.JSONDecoder()
    i = text.index("{") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "}":
            return None
        k, i = dec.raw_decode(text, i)
        while text[i] in " \t\r\n:":
            i += 1
        start = i
        _, i = dec.raw_decode(text, i)
        if k == key:
            return text[start:i]
    return None


def parse_call_object(text: str, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """One ``{"name": ..., "arguments": {...}}`` object -> ToolCall, or None if it is not one."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    split = _split_object(obj, args_keys)
    if split is None:
        return None
    key = next((k for k in args_keys if k in obj), None)
    raw = _raw_value(text, key) if key else "{}"
    return ToolCall(split[0], raw if raw is not None else json.dumps(split[1], ensure_ascii=False))


class ToolParser:
    """Base: text outside calls streams through; subclasses define the call syntax."""

    format = ""
    headers: tuple[str, ...] = ()

    def __init__(self, eager: bool = False) -> None:
        self.eager = eager
        self.buffer = ""  # text not yet released (possible header prefix, or the calls region)
        self.content = ""  # text released as content
        self.in_call = False
        self.failed = False
        self.raw = ""  # everything fed
        self.headers_out = 0  # calls whose CallHeader was emitted
        self.args_out: dict[int, int] = {}  # call index -> argument characters emitted

    def _header(self, i: int, cid: str, name: str) -> CallHeader:
        self.headers_out = max(self.headers_out, i + 1)
        return CallHeader(i, cid, name)

    def _args(self, i: int, text: str) -> ArgumentsDelta:
        self.args_out[i] = self.args_out.get(i, 0) + len(text)
        return ArgumentsDelta(i, text)

    def tail_events(self, result: ParseResult) -> list[ToolEvent]:
        """After :meth:`finish`: the header/argument events of ``result``'s calls not emitted yet (formats
        that can only validate at the end emit everything here)."""
        out: list[ToolEvent] = []
        for i, c in enumerate(result.tool_calls):
            if i >= self.headers_out:
                out.append(self._header(i, c.id, c.name))
            sent = self.args_out.get(i, 0)
            if len(c.arguments) > sent:
                out.append(self._args(i, c.arguments[sent:]))
        return out

    def _held_prefix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a header."""
        best = 0
        for h in self.headers:
            for k in range(min(len(h) - 1, len(text)), 0, -1):
                if text.endswith(h[:k]):
                    best = max(best, k)
                    break
        return best

    def feed(self, delta: str) -> list[ToolEvent]:
        self.raw += delta
        if self.in_call:
            self.buffer += delta
            return self._in_call_events()
        text = self.buffer + delta
        hit = min(((text.find(h), h) for h in self.headers if h in text), default=None)
        if hit is not None and self._header_allowed(text, hit[0]):
            pos, h = hit
            self.in_call = True
            out = [TextDelta(text[:pos])] if pos else []
            self.content += text[:pos]
            self.buffer = text[pos:]
            return out + [CallStarted()] + self._in_call_events()
        keep = self._held_prefix(text)
        release, self.buffer = text[: len(text) - keep], text[len(text) - keep :]
        self.content += release
        return [TextDelta(release)] if release else []

    def _header_allowed(self, text: str, pos: int) -> bool:
        return True

    def _in_call_events(self) -> list[ToolEvent]:
        return []

    def finish(self) -> ParseResult:
        """End of output: the parsed result. Invalid calls -> the whole output as text, no calls."""
        if not self.in_call:
            self.content += self.buffer
            self.buffer = ""
            return ParseResult(self.content, [])
        calls = self._parse_calls(self.buffer)
        if calls is None:
            self.failed = True
            return ParseResult(self.raw, [])
        return ParseResult(self.content, calls)

    def _parse_calls(self, region: str) -> list[ToolCall] | None:
        raise NotImplementedError


class HermesParser(ToolParser):
    format = "hermes"
    headers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, eager: bool = False) -> None:
        super().__init__(eager)
        self._emitted: list[ToolCall] = []
        self._ids: list[str] = []  # ids given to calls whose header streamed before they closed

    def _blocks(self, region: str) -> tuple[list[str], str]:
        """Complete ``<tool_call>…</tool_call>`` bodies in ``region`` and the unfinished rest."""
        bodies: list[str] = []
        rest = region
        while True:
            rest = rest.lstrip()
            if not rest.startswith(self.OPEN) or self.CLOSE not in rest:
                return bodies, rest
            end = rest.index(self.CLOSE)
            bodies.append(rest[len(self.OPEN) : end])
            rest = rest[end + len(self.CLOSE) :]

    def _in_call_events(self) -> list[ToolEvent]:
        bodies, rest = self._blocks(self.buffer)
        out: list[ToolEvent] = []
        for body in bodies[len(self._emitted) :]:
            call = parse_call_object(body.strip())
            if call is None:
                return out  # invalid: finish() turns everything into text; nothing more is emitted
            i = len(self._emitted)
            call = ToolCall(call.name, call.arguments, self._ids[i] if i < len(self._ids) else call.id)
            self._emitted.append(call)
            if i >= self.headers_out:
                out.append(self._header(i, call.id, call.name))
            rest_args = call.arguments[self.args_out.get(i, 0) :]
            if rest_args:
                out.append(self._args(i, rest_args))
        if self.eager and rest.startswith(self.OPEN):
            out += self._eager_events(rest[len(self.OPEN) :])
        return out

    def _eager_events(self, body: str) -> list[ToolEvent]:
        """Stream the open call's name and argument text before its closing tag (grammar-constrained)."""
        s = body.lstrip()
        prefix = '{"name": '
        if not s.startswith(prefix):
            return []
        try:
            name, j = json.JSONDecoder().raw_decode(s, len(prefix))
        except ValueError:
            return []
        marker = ', "arguments": '
        if not s.startswith(marker, j) or not isinstance(name, str):
            return []
        out: list[ToolEvent] = []
        i = len(self._emitted)
        if i >= self.headers_out:
            cid = "call_" + uuid.uuid4().hex[:24]
            self._ids.append(cid)
            out.append(self._header(i, cid, name))
        args = s[j + len(marker) :]
        for k in range(len(self.CLOSE), 0, -1):  # a closing tag (or the start of one) is not argument text
            if args.endswith(self.CLOSE[:k]):
                args = args[:-k]
                break
        safe = len(args.rstrip()) - 1  # hold back the object's closing "}" and trailing spaces
        sent = self.args_out.get(i, 0)
        if safe > sent:
            out.append(self._args(i, args[sent:safe]))
        return out

    def _parse_calls(self, region: str) -> list[ToolCall] | None:
        bodies, rest = self._blocks(region)
        if rest.strip() or not bodies:
            return None
        calls = []
        for k, body in enumerate(bodies):
            c = parse_call_object(body.strip())
            if c is None:
                return None
            cid = self._emitted[k].id if k < len(self._emitted) else (self._ids[k] if k < len(self._ids) else c.id)
            calls.append(ToolCall(c.name, c.arguments, cid))
        return calls


class Llama3JsonParser(ToolParser):
    """The whole output is the call(s): decided only when the output starts with ``{`` or the python tag."""

    format = "llama3_json"
    TAG = "<|python_tag|>"
    headers = (TAG, "{")

    def _header_allowed(self, text: str, pos: int) -> bool:
        return not text[:pos].strip()  # only at the start of the output

    def feed(self, delta: str) -> list[ToolEvent]:
        if not self.in_call and self.content.strip():
            self.raw += delta
            self.content += delta
            return [TextDelta(delta)] if delta else []
        return super().feed(delta)

    def _parse_calls(self, region: str) -> list[ToolCall] | None:
        body = region[len(self.TAG) :] if region.startswith(self.TAG) else region
        calls = []
        for part in _split_top_level(body.strip(), ";"):
            c = parse_call_object(part.strip(), ("parameters", "arguments"))
            if c is None:
                return None
            calls.append(c)
        return calls or None


class MistralParser(ToolParser):
    format = "mistral"
    headers = ("[TOOL_CALLS]",)

    def _parse_calls(self, region: str) -> list[ToolCall] | None:
        body = region[len(self.headers[0]) :].strip()
        try:
            arr, end = json.JSONDecoder().raw_decode(body)
        except (ValueError, RecursionError):
            return None
        if body[end:].strip() or not isinstance(arr, list) or not arr:
            return None
        calls = []
        for item in arr:
            text = json.dumps(item, ensure_ascii=False)
            c = parse_call_object(text)
            if c is None:
                return None
            calls.append(c)
        return calls


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def make_parser(fmt: str, eager: bool = False) -> ToolParser:
    try:
        return _PARSERS[fmt](eager=eager)
    except KeyError:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}") from None


def parse(fmt: str, text: str) -> ParseResult:
    """Whole-output convenience: feed everything, finish."""
    p = make_parser(fmt)
    p.feed(text)
    return p.finish()


def render_call(call: dict[str, Any]) -> str:
    """A history tool call (OpenAI shape) in the Hermes form the parser reads and the model generates."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {}, ensure_ascii=False)
    return '<tool_call>\n{"name": ' + json.dumps(fn.get("name", ""), ensure_ascii=False) + ', "arguments": ' + args + "}\n</tool_call>"
