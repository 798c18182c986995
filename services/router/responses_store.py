"""Stored Responses: ``store: true`` keeps a response, tenant-scoped and bounded, so that
``previous_response_id`` can continue its conversation (as the same session) and ``GET`` / ``DELETE
/v1/responses/{id}`` can read or remove it.

A record is ``{"response": <response object>, "messages": <the conversation in chat form, without the
instructions>, "session": <the session key the chain runs as>}``. Keys are ``<tenant digest>.<response id>``:
a response id of another tenant is simply absent (404), never readable.

| store | where | bounds |
|---|---|---|
| ``MemoryResponses`` | this router process (tests, one replica) | ``max_entries`` (least recently used evicted) and ``ttl_s`` (clock injected) |
| ``JetStreamResponses`` | the JetStream KV bucket ``<ns>_responses``, shared by router replicas | the bucket's ``max_age`` = ``ttl_s``, ``max_bytes``, per-record ``max_response_bytes``; a full bucket refuses new records (JetStream KV discards new): the response is answered with ``store: false`` |

Policy (what to keep, for how long) is the config's; these classes are the mechanism.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable

from talaria.natsutil import open_kv_bucket

log = logging.getLogger(__name__)

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


def key_of(tenant: str, response_id: str) -> str:
    """The bucket key of ``response_id`` for ``tenant`` (KV keys allow ``[-/_=.a-zA-Z0-9]``)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:16] + "." + response_id


class MemoryResponses:
    """Records in this process: at most ``max_entries`` (the least recently used goes first), each for
    ``ttl_s`` after it was stored. Mutates only itself."""

    def __init__(self, ttl_s: float, max_entries: int, max_response_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_entries, self.max_response_bytes, self.clock = ttl_s, max_entries, max_response_bytes, clock
        self._d: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    async def put(self, tenant: str, response_id: str, record: dict) -> bool:
        """Store ``record``; False (nothing stored) when it is over ``max_response_bytes``."""
        data = json.dumps(record, separators=(",", ":")).encode()
        if len(data) > self.max_response_bytes:
            return False
        k = key_of(tenant, response_id)
        self._d[k] = (self.clock() + self.ttl_s, data)
        self._d.move_to_end(k)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)
        return True

    async def get(self, tenant: str, response_id: str) -> dict | None:
        k = key_of(tenant, response_id)
        got = self._d.get(k)
        if got is None:
            return None
        if got[0] <= self.clock():
            del self._d[k]
            return None
        self._d.move_to_end(k)
        return json.loads(got[1])

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self._d.pop(key_of(tenant, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._d)


class JetStreamResponses:
    """Records in the JetStream KV bucket ``bucket``, shared by the router replicas of a namespace."""

    def __init__(self, nc, bucket: str, ttl_s: float, max_bytes: int, max_response_bytes: int) -> None:
        self.nc, self.bucket, self.ttl_s, self.max_bytes, self.max_response_bytes = nc, bucket, ttl_s, max_bytes, max_response_bytes
        self.kv = None

    async def start(self) -> None:
        self.kv = await open_kv_bucket(self.nc, self.bucket, history=1, ttl=self.ttl_s, max_bytes=self.max_bytes,
                                       max_value_size=self.max_response_bytes, description="Talaria stored responses")

    async def put(self, tenant: str, response_id: str, record: dict) -> bool:
        """Store ``record``; False when it is over the size cap or the bucket is full (logged)."""
        data = json.dumps(record, separators=(",", ":")).encode()
        if len(data) > self.max_response_bytes:
            return False
        try:
            await self.kv.put(key_of(tenant, response_id), data)
            return True
        except Exception as e:  # noqa: BLE001 - full bucket (discard new) or no JetStream: the answer goes on unstored
            log.warning("response %s not stored in %s: %s", response_id, self.bucket, e)
            return False

    async def get(self, tenant: str, response_id: str) -> dict | None:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            entry = await self.kv.get(key_of(tenant, response_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return json.loads(entry.value) if entry.value else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        if await self.get(tenant, response_id) is None:
            return False
        await self.kv.purge(key_of(tenant, response_id))
        return True


__all__ = ["JetStreamResponses", "MemoryResponses", "RESPONSE_ID", "key_of"]
