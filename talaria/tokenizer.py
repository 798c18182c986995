"""Tokenizer wrapper: ``tokenizers.Tokenizer`` (tokenizer.json) + tokenizer_config.json (special tokens,
chat template), and a per-request :class:`IncrementalDecoder` for streaming text deltas."""

from __future__ import annotations

import json
from array import array
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:
    from jinja2 import Template

    from talaria.v1 import engine_pb2 as pb

DEFAULT_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class TemplateError(Exception):
    """Raised by ``raise_exception(...)`` inside a chat template."""


def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        eos: list[int] = []
        eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is not None:
            eos.append(eos_id)
        for i in extra_eos_token_ids:
            if i not in eos:
                eos.append(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._template: Template | None = None
        self._max_token_bytes: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json + tokenizer_config.json (+ chat_template.jinja, config.json and
        generation_config.json for extra EOS ids) from a checkpoint directory."""
        p = Path(path)
        tok_file = p / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{tok_file} not found (only fast tokenizer.json files are supported)")
        tok = _HFTokenizer.from_file(str(tok_file))
        tcfg = _read_json(p / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = p / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        extra = _ids(_read_json(p / "config.json").get("eos_token_id"))
        extra += _ids(_read_json(p / "generation_config.json").get("eos_token_id"))
        return cls(
            tok,
            chat_template=template,
            bos_token=_token_content(tcfg.get("bos_token")),
            eos_token=_token_content(tcfg.get("eos_token")),
            pad_token=_token_content(tcfg.get("pad_token")),
            extra_eos_token_ids=extra,
        )

    # ----------------------------------------------------------------------------------- basic ops

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of input text one token can stand for, so a text of ``b`` bytes is
        at least ``b // max_token_bytes`` tokens (the router's early context check): the longest
        vocabulary entry (added tokens included) in UTF-8 bytes -- a byte-level entry's characters stand for
        one byte each, a SentencePiece ``▁`` or ``<0xNN>`` for one -- times 4 when the tokenizer normalizes its
        input (NFC / NFKC composition and case folding shrink no input by more than that). Computed once."""
        if self._max_token_bytes is None:
            longest = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)), default=0)
            self._max_token_bytes = longest * (4 if self._tok.normalizer is not None else 1)
        return self._max_token_bytes

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------- chat

    def _compiled_template(self) -> Template:
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                       separators: Any = None, sort_keys: bool = False) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            def strftime_now(fmt: str) -> str:
                return datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            self._template = env.from_string(self.chat_template or DEFAULT_CHATML_TEMPLATE)
        return self._template

    @property
    def supports_tools(self) -> bool:
        """The template renders ``tools`` itself (else :func:`_tools_fallback` does, in the Hermes format)."""
        return "tools" in (self.chat_template or "")

    @property
    def tool_format(self) -> str:
        """The tool-call format this model's output uses (see ``talaria/tool_parsers.py``)."""
        from talaria.tool_parsers import detect_format

        return detect_format(self.chat_template) if self.supports_tools else "hermes"

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render the chat template to text (``tools``, ``documents``… may be passed as kwargs).

        Tools are passed to the template as ``transformers``' ``apply_chat_template(tools=...)`` does (a list
        of OpenAI tool definitions); assistant ``tool_calls`` and ``tool`` messages are passed as the template
        expects them. A template without tool support gets them rendered by :func:`_tools_fallback`."""
        tools = kwargs.get("tools")
        has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if (tools or has_tool_turns) and not self.supports_tools:
            messages = _tools_fallback(messages, kwargs.pop("tools", None))
        elif tools is None:
            kwargs.pop("tools", None)
        return self._compiled_template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Render the chat template and tokenize it. Special tokens in the rendered text (e.g. a BOS the
        template writes) are parsed as such; no extra special tokens are added."""
        text = self.render_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def incremental_decoder(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)


# Variables a chat template gets from the request itself: ``chat_template_kwargs`` may not set them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token"})


def continue_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """vLLM's ``continue_final_message``: the rendered ``text`` cut right after the final message's content,
    so the model continues that (assistant) message instead of starting a new turn. Raises ValueError when
    the final message has no text content or the template did not render it verbatim."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content:
        raise ValueError("continue_final_message needs a final message with text content")
    at = text.rfind(content)
    if at < 0:
        raise ValueError("the chat template does not render the final message's content verbatim")
    return text[: at + len(content)]


def align_to_previous(tok: "Tokenizer", previous: Sequence[int] | None, text: str) -> list[int]:
    """Token ids of the rendered prompt ``text``, reusing ``previous`` (the session's last prompt + output)
    when their text is a prefix of ``text``.

    Why: a model's output is not always the canonical tokenization of its text (a grammar-constrained call,
    or a sampled split of a word), so re-tokenizing the history would diverge from the KV the session holds
    right after the previous prompt. Keeping the generated ids makes the next prompt a prefix extension of
    what the model produced, and the tokens are exactly the ones the KV was computed for."""
    if previous:
        prev_text = tok.decode(previous)
        if prev_text and text.startswith(prev_text) and "\ufffd" not in prev_text:
            return list(previous) + tok.encode(text[len(prev_text) :], add_special_tokens=False)
    return tok.encode(text, add_special_tokens=False)


class SessionTokens:
    """Bounded LRU of each session's last call ids (prompt + output), per model, stored compactly (4 bytes a
    token: 1024 sessions of 8k tokens are 32 MiB). Mutated by ``put``."""

    def __init__(self, capacity: int = 1024) -> None:
        from collections import OrderedDict

        self.capacity = capacity
        self._d: "OrderedDict[tuple[str, str], array[int]]" = OrderedDict()

    def put(self, session_id: str, model: str, ids: list[int]) -> None:
        key = (session_id, model)
        self._d[key] = array("I", ids)
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def get(self, session_id: str, model: str) -> list[int] | None:
        ids = self._d.get((session_id, model)) if session_id else None
        return list(ids) if ids is not None else None

    def pop(self, session_id: str, model: str) -> list[int] | None:
        """Forget the session (every model); returns its ids for ``model`` (the session ended)."""
        ids = self.get(session_id, model)
        for key in [k for k in self._d if k[0] == session_id]:
            del self._d[key]
        return ids


def chat_message_dict(m: pb.ChatMessage) -> dict[str, Any]:
    """A wire ``ChatMessage`` as the dict a chat template reads (tool calls parsed, null content kept null)."""
    null = not m.has_content and not m.content and bool(m.tool_calls_json)  # an assistant turn of tool calls only
    d: dict[str, Any] = {"role": m.role, "content": None if null else m.content}
    if m.name:
        d["name"] = m.name
    if m.tool_calls_json:
        d["tool_calls"] = json.loads(m.tool_calls_json)
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        d["reasoning_content"] = m.reasoning_content
    return d


_FALLBACK_TOOLS_INTRO = (
    "You can call functions to help answer. Their signatures are listed as JSON inside <tools></tools>:\n<tools>\n"
)
_FALLBACK_TOOLS_OUTRO = (
    "\n</tools>\n\nTo call a function, answer with one block per call, each holding a JSON object with the function's "
    "name and its arguments:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>"
)


def _tools_fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Tools and tool turns as plain messages, for a chat template that cannot render them: the tool list
    joins the (first) system message, an assistant's calls become ``<tool_call>`` blocks after its text
    (exactly as ``talaria.tool_parsers.render_call`` writes what the Hermes parser reads, so a turn the
    model generated re-renders to the same text), a tool result becomes a user turn in ``<tool_response>``."""
    from talaria.tool_parsers import render_call

    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(render_call(c) for c in m.pop("tool_calls"))
            m["content"] = (m.get("content") or "") + calls
        elif m.get("role") == "tool":
            m = {"role": "user", "content": "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"}
        if m.get("content") is None:
            m["content"] = ""
        m.pop("tool_call_id", None)
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = _FALLBACK_TOOLS_INTRO + listing + _FALLBACK_TOOLS_OUTRO
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas (one instance per request).

    Prefix/read offsets: ``decode(ids[prefix:read])`` is text already emitted (kept as left context so
    decoders that depend on neighbours, e.g. SentencePiece's leading-space handling, behave); a delta is
    ``decode(ids[prefix:])`` minus that. While the decoded tail ends with U+FFFD (an incomplete UTF-8
    sequence split across byte-level tokens) nothing is emitted; the text is released once the character
    completes (or by :meth:`flush` at the end).
    """

    _PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self._read = len(self.ids)
        self._prefix = max(0, self._read - self._PROMPT_CONTEXT)
        self.text = ""  # everything emitted so far (generated part only)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def step(self, new_ids: Iterable[int]) -> str:
        """Append ``new_ids`` and return the newly completed text (possibly "")."""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full_text = self._decode(self.ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full_text = self._decode(self.ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
