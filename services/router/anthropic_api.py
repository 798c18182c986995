"""Anthropic Messages API <-> chat completions: pure translation, no I/O.

``/v1/messages`` is served like ``/v1/responses``: the request becomes a chat-completion body, so it gets
exactly the chat path's validation, placement, session KV, tool parsing and constrained decoding
(``tool_choice`` any/tool), and the chat output becomes a ``message`` object, or, streaming, Anthropic's
event sequence (``message_start``, ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``) / ``content_block_stop``, ``message_delta`` with ``stop_reason`` and usage,
``message_stop``).

Mapping (every field honoured or a 400 naming it, by its Anthropic name):

- ``system`` (string or text blocks) -> a system message; ``messages``: text blocks, ``tool_use`` (assistant)
  -> ``tool_calls``, ``tool_result`` (user) -> ``tool`` messages (``is_error: true`` prefixes ``Error: ``);
  a final assistant message (prefill) -> ``continue_final_message``: the answer continues it.
- ``tools`` (custom tools: ``name``, ``description``, ``input_schema``, ``strict``) -> function tools;
  ``tool_choice`` auto/any/tool/none -> auto/required/named/none, ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``.
- ``stop_sequences`` -> ``stop`` (the matched one comes back as ``stop_sequence``, from the engine's
  ``stop_reason``); ``temperature`` [0, 1], ``top_p``, ``top_k``, ``max_tokens`` (>= 1) as themselves.
- ``cache_control`` breakpoints (top level, on system/message/tool blocks): the longest TTL becomes the
  call's ``cache_control`` hint (``hints.py``): an upper bound of the session's lease after the call.
- The session: the ``X-Session-ID`` header (read by the chat handler) wins, else ``metadata.user_id``, else
  a hash of the system prompt and the first user turn (an agent loop's calls share both).
- ``thinking``: ``{"type": "enabled", "budget_tokens": n}`` turns the model's reasoning on through its chat
  template's switch (chat ``reasoning_effort: medium``), ``{"type": "disabled"}`` off (``none``: a no-op for
  a model that does not reason); a model with no reasoning parser or no switch is a 400 naming ``thinking``.
  ``budget_tokens`` must be below ``max_tokens``, as Anthropic asks (its floor of 1024 is not imposed: a
  router's ``max_tokens_limit`` may be lower), and caps the thinking: it becomes the chat
  ``thinking_token_budget``, which the engine enforces by forcing the end of the reasoning once that many
  tokens are in it (a 400 naming ``thinking.budget_tokens`` where it cannot); ``max_tokens`` bounds thinking
  and text together. The reasoning comes back as a ``thinking`` block before
  the text (streamed as ``thinking_delta``; ``signature`` is empty: nothing is signed); ``thinking``
  blocks sent back in assistant turns become the turn's ``reasoning_content`` for the chat template (which
  renders or drops it, as the model was trained); ``redacted_thinking`` blocks are accepted (nothing to render).
- usage: ``input_tokens`` = prompt tokens not read from cache, ``cache_read_input_tokens`` = the engine's
  cached tokens, ``cache_creation_input_tokens`` = 0 (nothing is billed for writing: every prompt is cached).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any

from services.router.errors import APIError
from services.router.hints import parse_ttl

# Request fields: honoured, or accepted only with the value that needs nothing we lack (else 400 naming it).
_FIELDS = {"model", "max_tokens", "messages", "system", "metadata", "stop_sequences", "stream", "temperature", "top_p", "top_k",
           "tools", "tool_choice", "cache_control", "thinking"}
_NOOP = {
    "service_tier": (lambda v: v in (None, "auto", "standard_only"), "only the standard service tier exists"),
    "container": (lambda v: v is None, "containers (code execution) are not supported"),
    "mcp_servers": (lambda v: not v, "MCP servers are not supported: send the tools themselves"),
    "context_management": (lambda v: v is None, "context management is not supported"),
    "output_config": (lambda v: not v, "output_config is not supported"),
    "inference_geo": (lambda v: v is None, "inference_geo is not supported"),
    "speed": (lambda v: v in (None, "standard"), "only the standard speed exists"),
    "diagnostics": (lambda v: v is None, "diagnostics are not supported"),
}
_COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "cache_control"}  # /v1/messages/count_tokens
_TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type", "strict"}
_MAX_STOPS = 4  # the chat path's bound (the engine's stop buffer holds them back per token)


def bad(msg: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {msg}", code=code, param=param)


class Translation:
    """The chat body of a Messages request and what the answer needs: where each chat message came from
    (``origin[i]``, to name Anthropic fields in errors), the model, whether the answer continues a prefill."""

    def __init__(self) -> None:
        self.chat: dict = {}
        self.origin: list[str] = []
        self.ttls: list[float] = []

    def add(self, msg: dict, origin: str) -> None:
        self.chat.setdefault("messages", []).append(msg)
        self.origin.append(origin)

    def anthropic_param(self, param: str | None) -> str | None:
        """A chat field name (from an error of the chat path) as the Anthropic field it came from."""
        if not param:
            return param
        m = re.match(r"^messages\.(\d+)(\..*)?$", param)
        if m and int(m.group(1)) < len(self.origin):
            return self.origin[int(m.group(1))]
        m = re.match(r"^tools\.(\d+)\.function\.(name|parameters|description|strict)(\..*)?$", param)
        if m:
            field = {"parameters": "input_schema"}.get(m.group(2), m.group(2))
            return f"tools.{m.group(1)}.{field}{m.group(3) or ''}"
        return {"stop": "stop_sequences", "session_id": "metadata.user_id", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
                "continue_final_message": "messages", "max_completion_tokens": "max_tokens", "reasoning_effort": "thinking",
                "thinking_token_budget": "thinking.budget_tokens"}.get(param.split(".")[0], param)


def _cache_control(v: Any, param: str, tr: Translation) -> None:
    if v is None:
        return
    if not isinstance(v, dict) or v.get("type") != "ephemeral" or set(v) - {"type", "ttl"}:
        raise bad("cache_control must be {\"type\": \"ephemeral\", \"ttl\"?: \"5m\" | \"1h\"}", param)
    if not isinstance(v.get("ttl", "5m"), (str, int, float)):
        raise bad("ttl must be a duration such as \"5m\" or \"1h\"", f"{param}.ttl")
    tr.ttls.append(parse_ttl(v.get("ttl", "5m"), f"{param}.ttl") or 300.0)


def _text_block(b: Any, param: str, tr: Translation) -> str:
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
        raise bad("expected a text block {\"type\": \"text\", \"text\": ...}", param)
    extra = set(b) - {"type", "text", "cache_control", "citations"}
    if extra:
        raise bad(f"unknown text block field '{sorted(extra)[0]}'", f"{param}.{sorted(extra)[0]}", "unknown_parameter")
    if b.get("citations"):
        raise bad("citations are not supported", f"{param}.citations", "unsupported_parameter")
    _cache_control(b.get("cache_control"), f"{param}.cache_control", tr)
    return b["text"]


def _system(v: Any, tr: Translation) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad("system must be a string or a list of text blocks", "system")
    return "\n\n".join(_text_block(b, f"system.{i}", tr) for i, b in enumerate(v))


def _tool_result_text(b: dict, param: str, tr: Translation) -> str:
    c = b.get("content", "")
    if isinstance(c, str):
        text = c
    elif isinstance(c, list):
        text = "".join(_text_block(x, f"{param}.content.{k}", tr) for k, x in enumerate(c))
    else:
        raise bad("tool_result content must be a string or a list of text blocks", f"{param}.content")
    if b.get("is_error") not in (None, False, True):
        raise bad("is_error must be a boolean", f"{param}.is_error")
    return "Error: " + text if b.get("is_error") else text


def _message(m: Any, i: int, tr: Translation) -> None:
    param = f"messages.{i}"
    if not isinstance(m, dict):
        raise bad("each message must be an object", param)
    extra = set(m) - {"role", "content"}
    if extra:
        raise bad(f"unknown message field '{sorted(extra)[0]}'", f"{param}.{sorted(extra)[0]}", "unknown_parameter")
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise bad("role must be 'user' or 'assistant'", f"{param}.role")
    if isinstance(content, str):
        tr.add({"role": role, "content": content}, param)
        return
    if not isinstance(content, list):
        raise bad("content must be a string or a list of content blocks", f"{param}.content")
    texts: list[str] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for j, b in enumerate(content):
        bp = f"{param}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text_block(b, bp, tr))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if kind == "thinking" and isinstance(b.get("thinking"), str):  # to the template (see above); redacted: nothing to render
                thoughts.append(b["thinking"])
        elif kind == "tool_use" and role == "assistant":
            extra = set(b) - {"type", "id", "name", "input", "cache_control"}
            if extra or not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad("a tool_use block is {type, id, name, input (an object)}", f"{bp}.{sorted(extra)[0]}" if extra else bp)
            _cache_control(b.get("cache_control"), f"{bp}.cache_control", tr)
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            extra = set(b) - {"type", "tool_use_id", "content", "is_error", "cache_control"}
            if extra or not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                raise bad("a tool_result block is {type, tool_use_id, content?, is_error?}", f"{bp}.{sorted(extra)[0]}" if extra else f"{bp}.tool_use_id")
            _cache_control(b.get("cache_control"), f"{bp}.cache_control", tr)
            if texts:  # text before a result: its own user turn, in order
                tr.add({"role": "user", "content": "".join(texts)}, param)
                texts = []
            tr.add({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b, bp, tr)}, bp)
        else:
            what = f"'{kind}' blocks in {role} messages" if isinstance(kind, str) else "blocks without a type"
            raise bad(f"{what} are not supported (text, tool_use in assistant turns, tool_result in user turns)", f"{bp}.type", "unsupported_parameter")
    if role == "assistant":
        msg: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if thoughts:
            msg["reasoning_content"] = "".join(thoughts)
        tr.add(msg, param)
    elif texts or not content:
        tr.add({"role": "user", "content": "".join(texts)}, param)


def _tools(tools: Any, tr: Translation) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        p = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad("each tool must be an object", p)
        if t.get("type") not in (None, "custom"):
            raise bad(f"server tools ('{t.get('type')}') are not supported: only custom tools", f"{p}.type", "unsupported_parameter")
        extra = set(t) - _TOOL_FIELDS
        if extra:
            raise bad(f"unknown or unsupported tool field '{sorted(extra)[0]}'", f"{p}.{sorted(extra)[0]}", "unsupported_parameter")
        if not isinstance(t.get("name"), str):
            raise bad("a tool needs a name", f"{p}.name", "missing_field")
        if not isinstance(t.get("input_schema"), dict):
            raise bad("a tool needs input_schema (a JSON schema object)", f"{p}.input_schema", "missing_field")
        _cache_control(t.get("cache_control"), f"{p}.cache_control", tr)
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        for k in ("description", "strict"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any, chat: dict) -> None:
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice.type" if isinstance(tc, dict) else "tool_choice")
    extra = set(tc) - {"type", "name", "disable_parallel_tool_use"}
    if extra:
        raise bad(f"unknown tool_choice field '{sorted(extra)[0]}'", f"tool_choice.{sorted(extra)[0]}", "unknown_parameter")
    kind = tc["type"]
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise bad("tool_choice of type tool needs the tool's name", "tool_choice.name", "missing_field")
        chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    dp = tc.get("disable_parallel_tool_use")
    if dp not in (None, False, True):
        raise bad("disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use")
    if dp:
        chat["parallel_tool_calls"] = False


def _thinking(v: Any, max_tokens: int) -> tuple[str, int | None]:
    """``thinking`` -> the chat ``reasoning_effort`` and ``thinking_token_budget`` (enabled: ``budget_tokens``,
    enforced by the engine as a cap on the tokens inside the reasoning). Raises 400 naming the field."""
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled"):
        raise bad("thinking must be {\"type\": \"enabled\", \"budget_tokens\": n} or {\"type\": \"disabled\"}", "thinking.type")
    extra = set(v) - {"type", "budget_tokens"}
    if extra:
        raise bad(f"unknown thinking field '{sorted(extra)[0]}'", f"thinking.{sorted(extra)[0]}", "unknown_parameter")
    if v["type"] == "disabled":
        if "budget_tokens" in v:
            raise bad("budget_tokens goes with type enabled", "thinking.budget_tokens")
        return "none", None
    b = v.get("budget_tokens")
    if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b < max_tokens:
        raise bad("budget_tokens must be a positive integer less than max_tokens", "thinking.budget_tokens")
    return "medium", b


def _session_of(chat: dict) -> str:
    """The session of last resort: a hash of the system prompt and the first user turn."""
    msgs = chat.get("messages", [])
    system = next((m["content"] for m in msgs if m["role"] == "system"), "")
    first = next((m.get("content") or "" for m in msgs if m["role"] == "user"), "")
    return "anthropic-" + hashlib.sha256(json.dumps([system, first]).encode("utf-8", "surrogatepass")).hexdigest()[:24]


def to_chat(body: dict, count_only: bool = False) -> Translation:
    """A Messages (or ``count_tokens``) request body -> its chat-completion body. Raises :class:`APIError`
    400 naming the Anthropic field."""
    known = _COUNT_FIELDS | {"thinking", "mcp_servers", "context_management", "output_config"} if count_only else _FIELDS | set(_NOOP)
    for k in body:
        if k not in known:
            raise bad(f"unrecognized request argument '{k}'", k, "unknown_parameter")
    for k, (ok, why) in _NOOP.items():
        if k in body and not ok(body[k]):
            raise bad(why, k, "unsupported_parameter")
    tr = Translation()
    chat = tr.chat
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad("model is required", "model", "missing_field")
    chat["model"] = body["model"]
    if not count_only:
        mt = body.get("max_tokens")
        if mt is None:
            raise bad("max_tokens is required", "max_tokens", "missing_field")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise bad("max_tokens must be an integer >= 1 (0, cache pre-warming, is not supported)", "max_tokens")
        chat["max_tokens"] = mt
    if body.get("system") is not None:
        tr.add({"role": "system", "content": _system(body["system"], tr)}, "system")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages", "missing_field" if msgs is None else "invalid_value")
    for i, m in enumerate(msgs):
        _message(m, i, tr)
    if msgs[-1].get("role") == "assistant":  # prefill: the answer continues the final assistant message
        if chat["messages"][-1].get("tool_calls") or not chat["messages"][-1].get("content"):
            raise bad("a final assistant message (prefill) must be text", f"messages.{len(msgs) - 1}.content")
        chat["continue_final_message"] = True
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"], tr)
    if body.get("thinking") is not None:
        chat["reasoning_effort"], budget = _thinking(body["thinking"], chat.get("max_tokens", 1 << 62))
        if budget is not None:
            chat["thinking_token_budget"] = budget
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    _cache_control(body.get("cache_control"), "cache_control", tr)
    if tr.ttls:
        chat["cache_control"] = {"type": "ephemeral", "ttl": max(tr.ttls)}
    if count_only:
        return tr
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop_sequences must be a list of non-empty strings", "stop_sequences")
        if len(stops) > _MAX_STOPS:
            raise bad(f"at most {_MAX_STOPS} stop sequences are supported", "stop_sequences")
        if stops:
            chat["stop"] = stops
    t = body.get("temperature")
    if t is not None:
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t <= 1.0:
            raise bad("temperature must be within [0, 1]", "temperature")
        chat["temperature"] = t
    for k, kinds in (("top_p", (int, float)), ("top_k", (int,)), ("stream", (bool,))):
        v = body.get(k)
        if v is not None:  # the chat schema checks the ranges; the types are checked strictly here
            if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
                raise bad(f"{k} must be a {'boolean' if k == 'stream' else 'number'}", k)
            chat[k] = v
    md = body.get("metadata")
    if md is not None:
        if not isinstance(md, dict):
            raise bad("metadata must be an object", "metadata")
        extra = set(md) - {"user_id"}
        if extra:
            raise bad(f"unknown metadata field '{sorted(extra)[0]}' (only user_id)", f"metadata.{sorted(extra)[0]}", "unknown_parameter")
        if md.get("user_id") is not None and (not isinstance(md["user_id"], str) or len(md["user_id"]) > 256):
            raise bad("user_id must be a string of at most 256 characters", "metadata.user_id")
    chat["session_id"] = (md or {}).get("user_id") or _session_of(chat)
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return tr


# ----------------------------------------------------------------------------------------------- output


def usage(u: dict | None) -> dict:
    """Chat usage -> Anthropic usage (``input_tokens`` excludes the tokens read from cache)."""
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return {"input_tokens": max(0, u.get("prompt_tokens", 0) - cached), "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_of(finish_reason: str | None, stop_string: str | None) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat finish reason and the engine's matched stop string."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and stop_string:
        return "stop_sequence", stop_string
    return "end_turn", None


def _input(arguments: str) -> dict:
    try:
        v = json.loads(arguments) if arguments else {}
    except ValueError:
        v = None
    return v if isinstance(v, dict) else {"arguments": arguments}  # the model's text kept, never dropped


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def from_chat(model: str, chat: dict) -> dict:
    """A non-streaming chat completion -> a Messages ``message`` object."""
    choice = chat["choices"][0]
    m = choice["message"]
    content: list[dict] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    for c in m.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(c["function"]["arguments"])})
    reason, seq = stop_of(choice.get("finish_reason"), choice.get("stop_reason"))
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(chat.get("usage"))}


class StreamTranslator:
    """Chat stream chunks -> Anthropic stream events (dicts with ``type``). Mutates only itself: the open
    content block, the tool calls seen, the finish reason and usage."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = message_id()
        self.index = -1  # index of the open (or last) content block
        self.open: str | None = None  # "thinking" | "text" | "tool_use" | None
        self.calls: dict[int, int] = {}  # chat tool-call index -> content block index
        self.reason: str | None = None
        self.stop: str | None = None
        self.usage: dict | None = None

    def start(self) -> list[dict]:
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [], "stop_reason": None,
               "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}
        return [{"type": "message_start", "message": msg}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict) -> list[dict]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def feed(self, chunk: dict) -> list[dict]:
        out: list[dict] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            d = c.get("delta") or {}
            if d.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                out.append({"type": "content_block_delta", "index": self.index, "delta": {"type": "thinking_delta", "thinking": d["reasoning_content"]}})
            if d.get("content"):
                if self.open != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append({"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": d["content"]}})
            for tc in d.get("tool_calls") or []:
                if tc["index"] not in self.calls:
                    fn = tc.get("function") or {}
                    out += self._open({"type": "tool_use", "id": tc.get("id"), "name": fn.get("name"), "input": {}})
                    self.calls[tc["index"]] = self.index
                args = (tc.get("function") or {}).get("arguments") or ""
                if args:
                    out.append({"type": "content_block_delta", "index": self.calls[tc["index"]], "delta": {"type": "input_json_delta", "partial_json": args}})
            if c.get("finish_reason"):
                self.reason, self.stop = c["finish_reason"], c.get("stop_reason")
        return out

    def finish(self) -> list[dict]:
        out = self._close()
        reason, seq = stop_of(self.reason, self.stop)
        out.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(self.usage)})
        out.append({"type": "message_stop"})
        return out


__all__ = ["StreamTranslator", "Translation", "from_chat", "stop_of", "to_chat", "usage"]
