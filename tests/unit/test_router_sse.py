"""The router's SSE stream of a call, byte for byte: fixed engine chunks in, the exact ``data:`` events
out (the bytes the stream gave before its events were built from a per-call template and one write per
engine chunk; a change to either must not change a byte a client reads)."""

from __future__ import annotations

import asyncio

import pytest

from services.router.app import RouterAPI
from services.router.engine_client import EngineCall
from services.router.openai_format import ChatOutput, ChunkEvents, Logprobs
from services.router.service import make_state
from talaria.config import parse_config
from talaria.subjects import Subjects
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

TEXTS = ('He said "hi"\n', "caf\u00e9 \u2603 \\ </s>", "\U0001f600")  # quotes, escapes, non-ASCII, an astral character


def _chunks(logprobs: bool) -> list[pb.TokenChunk]:
    usage = cpb.Usage(prompt_tokens=5, completion_tokens=3)
    out = []
    for seq, text in enumerate(TEXTS, 1):
        lps = [pb.TokenLogprob(token_id=seq, token=text, logprob=-0.5)] if logprobs else []
        last = {"finished": True, "finish_reason": "length", "usage": usage} if seq == len(TEXTS) else {}
        out.append(pb.TokenChunk(seq=seq, token_ids=[seq], text=text, logprobs=lps, **last))
    return out


def _stream(chat: bool, logprobs: bool, one_by_one: bool = True) -> tuple[bytes, list[bytes]]:
    """The SSE bytes of one streamed call over ``_chunks`` (``one_by_one``: the next chunk arrives only once the
    reader has taken the last, so each is its own event; else all are queued at once and come merged), and the
    writes that carried them."""
    state = make_state(parse_config({"engines": [{"id": "e0", "models": ["m"]}]}))
    api = RouterAPI(state)
    call = EngineCall(None, Subjects("t"), "e0", pb.GenerateRequest(request_id="r1", model="m"))
    todo = _chunks(logprobs)

    def feed() -> None:
        while todo and (call._queue.empty() or not one_by_one):
            call._queue.put_nowait(todo.pop(0))

    async def go() -> list[bytes]:
        writes = []
        feed()
        async for b in api.sse(call, "cmpl-r1", 1700000000, "m", chat, True, lambda: True, ChatOutput() if chat else None, Logprobs(chat, logprobs)):
            writes.append(b)
            feed()
        await asyncio.sleep(0)  # let close_soon's task finish
        return writes

    writes = asyncio.run(go())
    return b"".join(writes), writes


GOLDEN = {
    (False, False): (
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"He said \\"hi\\"\\n","finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"caf\\u00e9 \\u2603 \\\\ </s>","finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"\\ud83d\\ude00","finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"","finish_reason":"length","logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0,"restored_tokens":0}}}\n\n'
        b'data: [DONE]\n\n'
    ),
    (False, True): (
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"He said \\"hi\\"\\n","finish_reason":null,"logprobs":{"tokens":["He said \\"hi\\"\\n"],"token_logprobs":[-0.5],"top_logprobs":[{}],"text_offset":[0]}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"caf\\u00e9 \\u2603 \\\\ </s>","finish_reason":null,"logprobs":{"tokens":["caf\\u00e9 \\u2603 \\\\ </s>"],"token_logprobs":[-0.5],"top_logprobs":[{}],"text_offset":[13]}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"\\ud83d\\ude00","finish_reason":null,"logprobs":{"tokens":["\\ud83d\\ude00"],"token_logprobs":[-0.5],"top_logprobs":[{}],"text_offset":[26]}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"","finish_reason":"length","logprobs":{"tokens":[],"token_logprobs":[],"top_logprobs":[],"text_offset":[]}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0,"restored_tokens":0}}}\n\n'
        b'data: [DONE]\n\n'
    ),
    (True, False): (
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"He said \\"hi\\"\\n"},"finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"caf\\u00e9 \\u2603 \\\\ </s>"},"finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"\\ud83d\\ude00"},"finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length","logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0,"restored_tokens":0}}}\n\n'
        b'data: [DONE]\n\n'
    ),
    (True, True): (
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"He said \\"hi\\"\\n"},"finish_reason":null,"logprobs":{"content":[{"token":"He said \\"hi\\"\\n","logprob":-0.5,"bytes":[72,101,32,115,97,105,100,32,34,104,105,34,10],"top_logprobs":[]}],"refusal":null}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"caf\\u00e9 \\u2603 \\\\ </s>"},"finish_reason":null,"logprobs":{"content":[{"token":"caf\\u00e9 \\u2603 \\\\ </s>","logprob":-0.5,"bytes":[99,97,102,195,169,32,226,152,131,32,92,32,60,47,115,62],"top_logprobs":[]}],"refusal":null}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"\\ud83d\\ude00"},"finish_reason":null,"logprobs":{"content":[{"token":"\\ud83d\\ude00","logprob":-0.5,"bytes":[240,159,152,128],"top_logprobs":[]}],"refusal":null}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length","logprobs":{"content":[],"refusal":null}}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0,"restored_tokens":0}}}\n\n'
        b'data: [DONE]\n\n'
    ),
    ('queued',): (
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"He said \\"hi\\"\\ncaf\\u00e9 \\u2603 \\\\ </s>\\ud83d\\ude00","finish_reason":null,"logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"","finish_reason":"length","logprobs":null}]}\n\n'
        b'data: {"id":"cmpl-r1","object":"text_completion","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0,"restored_tokens":0}}}\n\n'
        b'data: [DONE]\n\n'
    ),
}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_streamed_events_are_byte_for_byte_the_same(chat, logprobs):
    got, _ = _stream(chat, logprobs)
    assert got == GOLDEN[(chat, logprobs)]


def test_chunks_that_arrive_together_are_one_event_byte_for_byte():
    got, _ = _stream(False, False, one_by_one=False)
    assert got == GOLDEN[("queued",)]


@pytest.mark.parametrize("chat", [False, True])
def test_one_write_per_engine_chunk_the_last_with_done(chat):
    got, writes = _stream(chat, False)
    # chat: the role event first; then one write per token chunk; the last chunk's text, finish, usage and [DONE] together
    assert len(writes) == (1 if chat else 0) + len(TEXTS)
    assert writes[-1].endswith(b"data: [DONE]\n\n") and writes[-1].count(b"data: ") == 4
    assert all(w.count(b"data: ") == 1 for w in writes[:-1])


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", ["", "plain", 'q"\\/\n\t\x00', "\u00e9\u4e2d\U0001f600", "\ud800 lone surrogate"])
def test_template_events_equal_the_generic_encoding(chat, text):
    ev = ChunkEvents("chatcmpl-x\"y", 12, "org/model\u00e9", chat)
    fast = ev.content(text) if chat else ev.text(text)
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    assert fast == ev.event([{**choice, "finish_reason": None, "logprobs": None}])
