"""OpenAI Responses API <-> chat completions: pure translation, no I/O.

``/v1/responses`` is served by translating the request into a chat-completion body (so it gets exactly the
same validation, placement, tool parsing and structured output as ``/v1/chat/completions``) and the chat
output back into a ``response`` object, or, when streaming, chat chunks into Responses stream events
(``response.created`` … ``response.output_text.delta`` / ``response.function_call_arguments.delta`` …
``response.completed``). Enough for the OpenAI Agents SDK's default model (``OpenAIResponsesModel``): text
and function tools; built-in tools are 400 naming the field. Reasoning: ``reasoning.effort`` becomes
the chat ``reasoning_effort`` (the model's template switch, else a 400 naming ``reasoning.effort``); the
model's reasoning comes back as a ``reasoning`` output item before the message (``reasoning_text``
content; no summaries: ``reasoning.summary`` other than ``auto`` is a 400), streamed as
``response.reasoning_text.delta``; ``reasoning`` items in ``input`` become the next assistant turn's ``reasoning_content`` (the chat
template renders or drops it). Server-side state
(``store``, ``previous_response_id``) is the route's (``openai_routes.py`` with
``responses_store.py``): ``to_chat`` takes the stored conversation as ``history`` and the chain's session.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from services.router.errors import APIError

# Responses field -> chat field, passed through unchanged (validated by the chat schema).
_PASS = {"model": "model", "temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens",
         "stream": "stream", "user": "user", "parallel_tool_calls": "parallel_tool_calls", "prompt_cache_key": "prompt_cache_key",
         "safety_identifier": "safety_identifier", "service_tier": "service_tier", "top_logprobs": "top_logprobs",
         "session_id": "session_id", "top_k": "top_k", "seed": "seed"}
# field -> predicate "nothing to do" (else 400 naming it)
_NOOP = {
    "conversation": lambda v: v is None,
    "truncation": lambda v: v in (None, "disabled"),
    "include": lambda v: not v,
    "metadata": lambda v: not v,
    "background": lambda v: v in (None, False),
    "prompt": lambda v: v is None,
    "max_tool_calls": lambda v: v is None,
    "stream_options": lambda v: v is None or v == {} or v == {"include_obfuscation": False},
}


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, code="invalid_value", param=param)


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of parts", param)
    out = []
    for i, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str):
            raise _bad("only text content parts are supported", f"{param}.{i}")
        out.append(p["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    msgs: list[dict] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input must be a string or a non-empty list of items", "input")
    for i, it in enumerate(items):
        param = f"input.{i}"
        if not isinstance(it, dict):
            raise _bad("input items must be objects", param)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"unknown role {role!r}", f"{param}.role")
            text = _text(it.get("content", ""), f"{param}.content")
            if role == "assistant" and msgs and _thought_only(msgs[-1]):
                msgs[-1]["content"] = text  # the reasoning item before it was this turn's
            else:
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function", "function": {"name": it.get("name"), "arguments": it.get("arguments", "")}}
            if msgs and msgs[-1]["role"] == "assistant":  # one assistant turn: its reasoning, its text, then its calls
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":  # a previous turn's reasoning: the next assistant turn's reasoning_content
            parts = it.get("content") or []
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)) if isinstance(parts, list) else ""
            if text:
                msgs.append({"role": "assistant", "content": None, "reasoning_content": text})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": out if isinstance(out, str) else _text(out, f"{param}.output")})
        else:
            raise _bad(f"input items of type {kind!r} are not supported (text messages and function calls only)", f"{param}.type")
    return [m for m in msgs if not _thought_only(m)]  # reasoning no turn followed: nothing to render it with


def _thought_only(m: dict) -> bool:
    """An assistant turn so far holding only a reasoning item's text."""
    return m["role"] == "assistant" and m.get("content") is None and not m.get("tool_calls") and "reasoning_content" in m


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad("only function tools are supported", f"tools.{i}.type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        extra = set(t) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise _bad(f"unknown tool field {sorted(extra)[0]!r}", f"tools.{i}.{sorted(extra)[0]}")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None or isinstance(tc, str):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise _bad("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")


_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _reasoning(v: Any) -> str | None:
    """``reasoning`` -> the chat ``reasoning_effort`` (None: not asked). Raises 400 naming the field."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("reasoning must be an object", "reasoning")
    extra = set(v) - {"effort", "summary", "generate_summary"}
    if extra:
        raise APIError(400, f"unrecognized request argument 'reasoning.{sorted(extra)[0]}'", code="unknown_parameter", param=f"reasoning.{sorted(extra)[0]}")
    for k in ("summary", "generate_summary"):
        if v.get(k) not in (None, "auto"):
            raise APIError(400, "reasoning summaries are not supported (the reasoning itself comes back as reasoning_text)", code="unsupported_parameter", param=f"reasoning.{k}")
    effort = v.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise _bad(f"reasoning.effort must be one of {', '.join(_EFFORTS)}", "reasoning.effort")
    return effort


def _format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _bad("text supports only 'format'", "text")
    if text.get("verbosity") is not None:
        raise _bad("verbosity is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    raise _bad(f"unknown text format {fmt.get('type')!r}", "text.format.type")


def to_chat(body: dict, history: list[dict] | None = None, session: str | None = None) -> dict:
    """A Responses request body -> a chat-completion request body: the instructions, then ``history`` (a
    stored conversation in chat form, ``previous_response_id``), then the input; ``session`` (the chain's)
    is its ``session_id``. Raises :class:`APIError` 400."""
    known = set(_PASS) | set(_NOOP) | {"input", "instructions", "tools", "tool_choice", "text", "store", "previous_response_id", "reasoning"}
    for k in body:
        if k not in known:
            raise APIError(400, f"unrecognized request argument '{k}'", code="unknown_parameter", param=k)
    for k, ok in _NOOP.items():
        if k in body and not ok(body[k]):
            raise APIError(400, f"'{k}' is not supported (docs/protocols.md)", code="unsupported_parameter", param=k)
    chat: dict = {_PASS[k]: v for k, v in body.items() if k in _PASS and v is not None}
    msgs = _messages(body)
    if history:
        at = 1 if body.get("instructions") else 0
        msgs[at:at] = history
    chat["messages"] = msgs
    if session:
        chat["session_id"] = session
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    rf = _format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    effort = _reasoning(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def responses_param(param: str | None) -> str | None:
    """A chat field name (from an error of the chat path) as the Responses field it came from."""
    return "reasoning.effort" if param == "reasoning_effort" else param


def _usage(u: dict | None) -> dict:
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0), "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
            "total_tokens": u.get("total_tokens", 0)}


def conversation(body: dict, chat: dict, resp: dict) -> list[dict]:
    """The conversation after ``resp`` in chat form, without the instructions (a continuation does not
    inherit them): what a stored response keeps for ``previous_response_id``."""
    msgs = list(chat["messages"][1:] if body.get("instructions") else chat["messages"])
    turn: dict | None = None  # this response's assistant turn: its text, then its calls
    for item in resp["output"]:
        if item["type"] == "reasoning":  # the turn's reasoning, for templates that render it
            turn = {"role": "assistant", "content": None, "reasoning_content": "".join(p.get("text", "") for p in item.get("content") or [])}
            msgs.append(turn)
        elif item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            if turn is not None and _thought_only(turn):
                turn["content"] = text
            else:
                turn = {"role": "assistant", "content": text}
                msgs.append(turn)
        elif item["type"] == "function_call":
            if turn is None:
                turn = {"role": "assistant", "content": None}
                msgs.append(turn)
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}})
    return msgs


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _skeleton(body: dict, rid: str, created: int, status: str) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": body.get("model"),
        "output": [], "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "metadata": {}, "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None} if body.get("reasoning") else None,
        "store": body.get("store") is True, "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled", "usage": None,
        "user": body.get("user"),
    }


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _finish(resp: dict, reason: str | None) -> None:
    if reason == "length":
        resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"


def from_chat(body: dict, chat: dict, rid: str | None = None) -> dict:
    """A non-streaming chat completion -> a ``response`` object (id ``rid``, else a new one)."""
    resp = _skeleton(body, rid or new_id(), int(time.time()), "completed")
    choice = chat["choices"][0]
    msg = choice["message"]
    if msg.get("reasoning_content"):
        resp["output"].append(_reasoning_item(msg["reasoning_content"]))
    if msg.get("content"):
        resp["output"].append(_message_item(msg["content"]))
    for call in msg.get("tool_calls") or []:
        resp["output"].append(_call_item(call))
    _finish(resp, choice.get("finish_reason"))
    resp["usage"] = _usage(chat.get("usage"))
    return resp


class StreamTranslator:
    """Chat stream chunks -> Responses stream events (dicts with ``type`` and ``sequence_number``).

    Mutates only itself: the response being built, the open message item and the open call items."""

    def __init__(self, body: dict, rid: str | None = None) -> None:
        self.resp = _skeleton(body, rid or new_id(), int(time.time()), "in_progress")
        self.seq = 0
        self.msg: dict | None = None  # open message item
        self.thought: dict | None = None  # open reasoning item
        self.calls: dict[int, dict] = {}  # chat tool-call index -> open function_call item
        self.reason: str | None = None

    def _ev(self, type_: str, **kw) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **kw}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        return [self._ev("response.created", response=dict(self.resp)), self._ev("response.in_progress", response=dict(self.resp))]

    def _open_message(self) -> list[dict]:
        self.msg = _message_item("", status="in_progress")
        self.resp["output"].append(self.msg)
        idx = len(self.resp["output"]) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._ev("response.output_item.added", output_index=idx, item={**self.msg, "content": []}),
                self._ev("response.content_part.added", item_id=self.msg["id"], output_index=idx, content_index=0, part=part)]

    def _reasoning_delta(self, text: str) -> list[dict]:
        out: list[dict] = []
        if self.thought is None:
            self.thought = _reasoning_item("", status="in_progress")
            self.resp["output"].append(self.thought)
            out.append(self._ev("response.output_item.added", output_index=len(self.resp["output"]) - 1, item={**self.thought, "content": []}))
            part = {"type": "reasoning_text", "text": ""}
            out.append(self._ev("response.content_part.added", item_id=self.thought["id"], output_index=len(self.resp["output"]) - 1, content_index=0, part=part))
        self.thought["content"][0]["text"] += text
        out.append(self._ev("response.reasoning_text.delta", item_id=self.thought["id"], output_index=self.resp["output"].index(self.thought), content_index=0, delta=text))
        return out

    def _close_reasoning(self) -> list[dict]:
        if self.thought is None:
            return []
        r, self.thought = self.thought, None
        idx = self.resp["output"].index(r)
        r["status"] = "completed"
        return [self._ev("response.reasoning_text.done", item_id=r["id"], output_index=idx, content_index=0, text=r["content"][0]["text"]),
                self._ev("response.content_part.done", item_id=r["id"], output_index=idx, content_index=0, part=r["content"][0]),
                self._ev("response.output_item.done", output_index=idx, item=r)]

    def _close_message(self) -> list[dict]:
        if self.msg is None:
            return []
        m, self.msg = self.msg, None
        idx = self.resp["output"].index(m)
        text = m["content"][0]["text"]
        m["status"] = "completed"
        return [self._ev("response.output_text.done", item_id=m["id"], output_index=idx, content_index=0, text=text, logprobs=[]),
                self._ev("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0, part=m["content"][0]),
                self._ev("response.output_item.done", output_index=idx, item=m)]

    def feed(self, chunk: dict) -> list[dict]:
        out: list[dict] = []
        if chunk.get("usage"):
            self.resp["usage"] = _usage(chunk["usage"])
        for c in chunk.get("choices") or []:
            d = c.get("delta") or {}
            if d.get("reasoning_content"):
                out += self._reasoning_delta(d["reasoning_content"])
            if d.get("content"):
                out += self._close_reasoning()
                if self.msg is None:
                    out += self._open_message()
                self.msg["content"][0]["text"] += d["content"]
                idx = self.resp["output"].index(self.msg)
                out.append(self._ev("response.output_text.delta", item_id=self.msg["id"], output_index=idx, content_index=0, delta=d["content"], logprobs=[]))
            for tc in d.get("tool_calls") or []:
                out += self._call_delta(tc)
            if c.get("finish_reason"):
                self.reason = c["finish_reason"]
        return out

    def _call_delta(self, tc: dict) -> list[dict]:
        out = self._close_reasoning() + self._close_message()
        item = self.calls.get(tc["index"])
        if item is None:
            item = _call_item({"id": tc.get("id"), "function": {"name": tc["function"].get("name"), "arguments": ""}}, status="in_progress")
            self.calls[tc["index"]] = item
            self.resp["output"].append(item)
            out.append(self._ev("response.output_item.added", output_index=len(self.resp["output"]) - 1, item=dict(item)))
        delta = tc["function"].get("arguments") or ""
        if delta:
            item["arguments"] += delta
            out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=self.resp["output"].index(item), delta=delta))
        return out

    def finish(self) -> list[dict]:
        out = self._close_reasoning() + self._close_message()
        for item in self.calls.values():
            idx = self.resp["output"].index(item)
            item["status"] = "completed"
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx, arguments=item["arguments"]))
            out.append(self._ev("response.output_item.done", output_index=idx, item=item))
        _finish(self.resp, self.reason)
        out.append(self._ev("response.completed" if self.resp["status"] == "completed" else "response.incomplete", response=self.resp))
        return out
