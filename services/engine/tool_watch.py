"""Tool calls seen by the engine as its output streams.

Design note (JointServe's intent prefetch: act on the caller's streamed tool-call header, before the call
ends). The engine runs the same pure incremental parser the router uses to shape OpenAI output
(``talaria/tool_parsers.py``, the format named by the model's chat template) on a call that offered tools.
The moment a tool-call header with the tool's name has streamed (arguments still coming), ``feed`` returns
that name once, and the service publishes a ``ToolIntent``; when the call ends, ``finish`` gives the names
of the calls the output made, for the completion hook (``tool_names`` / ``tool_call_count``), which keys the
router's return-gap predictor. Pure: no I/O, mutates only itself; a parse failure is never an error (plain
text: no tool names).
"""

from __future__ import annotations

from talaria.tool_parsers import CallHeader, make_parser


class ToolWatch:
    def __init__(self, tool_format: str) -> None:
        self._parser = make_parser(tool_format or "hermes", eager=True)
        self.intent: str = ""  # the first tool name seen ("" = none yet)
        self.tokens_at_intent = 0

    def feed(self, text: str, generated_tokens: int = 0) -> str:
        """Feed streamed text; returns the tool name the first time a call header completes, else ""."""
        if not text:
            return ""
        try:
            events = self._parser.feed(text)
        except Exception:  # noqa: BLE001 - a parser surprise must never fail the call
            return ""
        if self.intent:
            return ""
        for e in events:
            if isinstance(e, CallHeader) and e.name:
                self.intent, self.tokens_at_intent = e.name, generated_tokens
                return e.name
        return ""

    def finish(self) -> list[str]:
        """Names of the tool calls the whole output made (in order); [] for plain text."""
        try:
            return [c.name for c in self._parser.finish().tool_calls]
        except Exception:  # noqa: BLE001
            return [self.intent] if self.intent else []
