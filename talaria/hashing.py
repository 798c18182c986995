"""Cumulative page hashes: the identity of a KV prefix.

Page ``i`` of a token sequence is identified by ``h_i = H(h_{i-1} || tokens[i*P:(i+1)*P])`` with ``h_{-1}``
a *salt* derived from the model identity (model id + weights revision) and, with API keys, the caller's
tenant (``tenant_salt``: tenants never share a page). Two sequences share page ``i`` of
KV exactly when their hashes at ``i`` agree, so a prefix is a chain of hashes and the longest common
prefix is found by walking the chain (Talaria §4.3: entries keyed by cumulative prefix hash). Only full
pages are hashed: a partial tail page has no identity and is never shared or published.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_MASK63 = (1 << 63) - 1


def model_salt(model_id: str, revision: str = "") -> int:
    """Salt that separates hash chains of different models or weight revisions."""
    d = hashlib.blake2b(f"{model_id}\x00{revision}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") & _MASK63


def tenant_salt(salt: int, tenant: str) -> int:
    """Salt of ``tenant``'s hash chains for a model whose salt is ``salt``.

    Derived on the server from the tenant the router authenticated, never from anything a client sends
    (a client-chosen salt lets a client join another's chain). Tenant ``""`` (no API keys) keeps ``salt``,
    so an open stack hashes exactly as before and sharing within a tenant is unchanged: every call of one
    tenant starts its chain from the same value.
    """
    if not tenant:
        return salt
    d = hashlib.blake2b(struct.pack("<q", salt) + tenant.encode(), digest_size=8, person=b"talaria-tenant").digest()
    return int.from_bytes(d, "little") & _MASK63


def cache_salt(salt: int, salt_text: str) -> int:
    """Salt of the chains of calls that name ``salt_text`` as their ``cache_salt`` (vLLM's meaning:
    such calls share cached pages only with calls of the same salt), on top of ``salt`` (the tenant's: a
    client's salt never reaches another tenant's chains). ``""`` keeps ``salt``."""
    if not salt_text:
        return salt
    d = hashlib.blake2b(struct.pack("<q", salt) + salt_text.encode(), digest_size=8, person=b"talaria-csalt").digest()
    return int.from_bytes(d, "little") & _MASK63


def next_page_hash(prev: int, page_tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", prev))
    h.update(struct.pack(f"<{len(page_tokens)}i", *page_tokens))
    return int.from_bytes(h.digest(), "little") & _MASK63


def page_hashes(token_ids: Sequence[int], page_size: int, salt: int = 0, start: int = 0, prev: int | None = None) -> list[int]:
    """Hashes of the full pages of ``token_ids`` from page ``start`` on.

    ``prev`` is the hash of page ``start - 1`` (``salt`` when ``start == 0``), so a caller can extend a
    chain it already has without rehashing it.
    """
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    h = salt if prev is None else prev
    out: list[int] = []
    n_full = len(token_ids) // page_size
    for i in range(start, n_full):
        h = next_page_hash(h, token_ids[i * page_size : (i + 1) * page_size])
        out.append(h)
    return out
