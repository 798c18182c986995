"""The token path from the executor thread to NATS: fold the step outputs that are ready into one
message per call.

Design NOTE (issue 20 §5). The executor thread hands each step's outputs to the asyncio loop through a
queue; one publisher task turns them into ``TokenChunk`` messages. When the publisher keeps up, every
step becomes one message per call (lowest latency). When it lags (the loop was busy with other calls,
or steps are faster than NATS round trips), several steps are waiting: :func:`next_coalesced` takes all
of them at once and :func:`coalesce_outputs` merges each call's outputs into one (tokens and text
concatenated in order, the terminal fields of its last output), so a lagging reader gets fewer, larger
messages instead of falling further behind. Nothing is delayed to wait for more tokens: coalescing only
uses what is already queued. Pure code; no I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.engine.types import RequestOutput


def coalesce_outputs(batches: list[list[RequestOutput]]) -> list[RequestOutput]:
    """One output per request, in order of first appearance, merging its outputs across ``batches``.

    Token ids, text and log-probabilities (one entry per token) are concatenated in step order; ``finished``/``finish_reason``/``usage``/``error``
    come from the request's last output. An output after a finished one carries nothing (the executor makes
    none; the service's stream-interval timer may queue an empty one) and is dropped. Mutates nothing.
    """
    merged: dict[str, RequestOutput] = {}
    for batch in batches:
        for o in batch:
            prev = merged.get(o.request_id)
            if prev is None:
                merged[o.request_id] = o
            elif not prev.finished:
                lps = (prev.logprobs or []) + (o.logprobs or []) if (prev.logprobs or o.logprobs) else None
                merged[o.request_id] = replace(
                    o, new_token_ids=prev.new_token_ids + o.new_token_ids, new_text=prev.new_text + o.new_text, logprobs=lps,
                )
    return list(merged.values())


async def next_coalesced(queue: asyncio.Queue[list[RequestOutput]]) -> tuple[list[RequestOutput], int]:
    """Wait for the next step's outputs, take every other step already queued, and return the merged
    outputs with the number of steps they cover. Consumes those items from ``queue``."""
    batches = [await queue.get()]
    while not queue.empty():
        batches.append(queue.get_nowait())
    return (batches[0] if len(batches) == 1 else coalesce_outputs(batches)), len(batches)
