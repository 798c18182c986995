"""Structured output: a request's ``Constraint`` -> a compiled xgrammar grammar the sampler enforces.

Design note. Constrained decoding as in XGrammar (Dong et al., 2024, §3: a byte-level pushdown automaton
whose per-step allowed-token set is a bitmask over the vocabulary, precomputed for context-independent
tokens). Compilation happens once per call at intake, off the event loop, with a time bound; per step the
sampler asks each constrained sequence's matcher for its bitmask and masks only those rows (see
``sampling.py``), so unconstrained sequences in the batch pay nothing.

Kinds (wire ``Constraint.kind``):

* ``json_object`` — any JSON object; ``json_schema`` — the schema (``strict`` or not, the output always
  matches it: there is nothing weaker to enforce);
* ``tool_call`` — ``tool_choice`` ``required`` / named: exactly one call in the model's tool-call format
  (``talaria/tool_parsers.py``), ``{"name": <one of the tools>, "arguments": <its parameters schema>}``.

JSON is generated compactly with Python's default separators (``", "``, ``": "``), the form
``json.dumps`` and the chat templates write, so a constrained tool call re-renders to the same text.

Strings are strict JSON (RFC 8259 §7/§8): no raw control character (U+0000-U+001F) and no UTF-16 surrogate
inside a string, so every answer passes a strict ``json.loads`` and decodes to the characters the grammar
counted. xgrammar's (0.2.x) free strings exclude controls but admit surrogates (invalid UTF-8, decoded to
U+FFFD); a string with ``minLength``/``maxLength`` (an object key under ``propertyNames`` too) is compiled to a
character rule ``[^"\\\r\n]`` that admits TAB and the other controls, and no escapes.
:func:`strict_json_grammar` rewrites both to "a character that is not a control, quote, backslash or
surrogate, or one escape" (an escape is one character of the decoded string, as ``minLength``/``maxLength``
count). ``pattern`` and ``format`` strings go through xgrammar's JSON-string regex, which excludes controls.
A schema xgrammar cannot compile, or that takes longer than ``COMPILE_TIMEOUT_S``, is a
:class:`GrammarError` (the engine answers 400 naming the field).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from typing import Any

SEPARATORS = (", ", ": ")
COMPILE_TIMEOUT_S = 5.0
MAX_SCHEMA_BYTES = 64 * 1024

# format -> (text before the call object, text after it, key of the arguments)
_CALL_SYNTAX = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"),
    "llama3_json": ("", "", "parameters"),
    "mistral": ("[TOOL_CALLS][", "]", "arguments"),
}


class GrammarError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarFactory:
    """Compiles constraints for one tokenizer/vocabulary. Thread-safe; compilations run on a small pool so a
    pathological schema cannot occupy more than its worker (and is abandoned after the time bound)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._busy = threading.BoundedSemaphore(workers)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer._tok)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, kind: str, json_schema: str = "", tools: list[dict] | None = None, tool_choice: str = "", tool_format: str = "hermes"):
        """A compiled grammar for the constraint, or None for no constraint. Raises :class:`GrammarError`."""
        if not kind:
            return None
        param = "tool_choice" if kind == "tool_call" else "response_format"
        if not self._busy.acquire(blocking=False):
            raise GrammarError("too many grammars are compiling on this instance; retry", param)
        fut = self._pool.submit(self._compile, kind, json_schema, tools or [], tool_choice, tool_format)
        fut.add_done_callback(lambda _f: self._busy.release())
        try:
            return fut.result(timeout=COMPILE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the {param} grammar did not compile within {COMPILE_TIMEOUT_S:.0f}s", param) from None
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar's errors are the caller's schema
            raise GrammarError(f"the {param} schema cannot be enforced: {e}", param) from None

    def _compile(self, kind: str, json_schema: str, tools: list[dict], tool_choice: str, tool_format: str):
        import xgrammar as xgr

        compiler = self._get_compiler()
        if kind == "json_object":
            return compiler.compile_grammar(strict_json_grammar(xgr, {"type": "object"}))
        if kind == "json_schema":
            if len(json_schema) > MAX_SCHEMA_BYTES:
                raise GrammarError(f"json_schema is larger than {MAX_SCHEMA_BYTES} bytes", "response_format")
            return compiler.compile_grammar(strict_json_grammar(xgr, json_schema))
        if kind == "tool_call":
            return compiler.compile_grammar(tool_call_grammar(xgr, tools, tool_choice, tool_format))
        raise GrammarError(f"unknown constraint kind {kind!r}", "response_format")


# xgrammar's (0.2.x) printed character rules for strings, and their strict replacements. A free string's
# character class excludes controls but not UTF-16 surrogates (U+D800-U+DFFF, which are not characters: their
# UTF-8 form is invalid and decodes to U+FFFD, three per surrogate, breaking length bounds); a length-bounded
# string's rule admits controls and no escapes.
_FREE_STRING_CLASS = r'[^\0-\x1f\"\\\r\n]'
_STRICT_CLASS = r'[^\0-\x1f\"\\\ud800-\udfff]'
_LOOSE_STRING_CHAR = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_ESCAPE_RULE = r'talaria_json_escape ::= ([\"\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])'


def strict_json_grammar(xgr, schema: str | dict):
    """xgrammar's grammar for ``schema`` (compact, Python's separators, strict mode) with every string
    character rule strict (see the module note). Pure: returns a new ``xgr.Grammar``; raises what xgrammar
    raises for a schema it cannot convert."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS, strict_mode=True))
    ebnf = ebnf.replace(_FREE_STRING_CLASS, _STRICT_CLASS)
    ebnf, n = _LOOSE_STRING_CHAR.subn(lambda m: f'{m.group(1)} ::= (({_STRICT_CLASS}) | ("\\\\" talaria_json_escape))', ebnf)
    return xgr.Grammar.from_ebnf(ebnf + ("\n" + _ESCAPE_RULE + "\n" if n else ""))


def call_schema(tool: dict, args_key: str) -> dict[str, Any]:
    """JSON schema of one call object ``{"name": <const>, <args_key>: <parameters>}`` (name first)."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def tool_call_grammar(xgr, tools: list[dict], tool_choice: str, tool_format: str):
    """Exactly one call, in ``tool_format``'s syntax, to ``tool_choice`` (a function name) or any tool."""
    before, after, key = _CALL_SYNTAX.get(tool_format, _CALL_SYNTAX["hermes"])
    chosen = [t for t in tools if tool_choice in ("required", "") or t["function"]["name"] == tool_choice]
    if not chosen:
        raise GrammarError(f"tool_choice names no function in tools: {tool_choice!r}", "tool_choice")
    objects = [strict_json_grammar(xgr, call_schema(t, key)) for t in chosen]
    body = objects[0] if len(objects) == 1 else xgr.Grammar.union(*objects)
    parts = [body]
    if before:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(before)}"))
    if after:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(after)}"))
    return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)
