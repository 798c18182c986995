"""Soft-reservation leases (Talaria §3.3, §4.1): ``(session, model, instance, prefix handle, t_exp)``.

A completion hook installs a lease with ``t_exp = t_done + tau``; a matching return consumes it; an expired
lease is dropped. A lease is an admission charge, never a pin on device KV: the engine knows nothing of it.

| class | what |
|---|---|
| ``LeaseTable`` | pure local view: key -> (lease, revision); live counts per instance/model for the overlay |
| ``MemoryLeases`` | a store private to one router (tests, simulator, ``lease_store: memory``) |
| ``JetStreamLeases`` | the shared store: a JetStream key-value bucket ``<ns>_leases`` with per-key TTL tau; a watcher mirrors it into the table; consumption deletes with a revision check so exactly one replica wins |

Expiry is decided by ``t_exp_unix`` in the value (wall clock); the bucket TTL only garbage-collects (NATS
rounds message TTLs to whole seconds, so the stored copy may outlive ``t_exp`` by up to a second).
"""

from __future__ import annotations

import asyncio
import base64
import heapq
import logging
import math
from dataclasses import dataclass

from services.router.policy import LeaseView
from services.router.return_gap import lease_weight
from talaria.natsutil import open_kv_bucket
from talaria.v1 import router_pb2 as rpb

log = logging.getLogger(__name__)

GRACE_S = 30.0  # expired leases stay in the local table this long, so a late return is counted as an expiry


def lease_key(session_id: str, model: str) -> str:
    """NATS KV keys allow ``[-/_=.a-zA-Z0-9]``: base64url (no padding) of each part, joined by a dot."""

    def enc(s: str) -> str:
        return base64.urlsafe_b64encode(s.encode()).decode().rstrip("=") or "_"

    return f"{enc(session_id)}.{enc(model)}"


def view_of(lease: rpb.Lease) -> LeaseView:
    return LeaseView(
        lease_id=lease.lease_id,
        instance_id=lease.instance_id,
        model=lease.model,
        committed_tokens=lease.prefix.committed_tokens,
        t_done_unix=lease.t_done_unix,
        t_exp_unix=lease.t_exp_unix,
        epoch=lease.instance_epoch,
        gap_mu=lease.gap_mu,
        gap_sigma=lease.gap_sigma,
    )


@dataclass(slots=True)
class _Entry:
    lease: rpb.Lease
    view: LeaseView
    revision: int
    counted: bool = False  # in the live counts (alive as of the table's last ``now``)


# Design note ("placement decision under 1 ms p99 at 1,000 instances"). The live counts per instance
# and per model are kept incrementally instead of scanning every lease per decision (10,000 sessions leave
# ~10,000 leases in the table): an entry is counted while ``now < t_exp`` for the latest ``now`` asked about; a
# heap of (t_exp, seq, entry) uncounts entries as the clock passes their expiry; upsert/remove/prune/drop
# uncount what they replace or take out. A ``now`` earlier than the last one (a wall clock stepped back)
# recounts from scratch, so the answers are exactly those of a scan at every ``now``.


class LeaseTable:
    """What this router knows of the leases (its own or mirrored from the shared bucket). No I/O."""

    def __init__(self) -> None:
        self._by_key: dict[str, _Entry] = {}
        self._live_inst: dict[str, int] = {}
        self._live_model: dict[str, int] = {}
        self._expiry: list[tuple[float, int, _Entry]] = []  # heap of counted entries by t_exp (stale ones skipped)
        self._seq = 0
        self._at = -math.inf  # the counts are those of a scan at this ``now``
        self._touched: dict[object, set[str]] = {}  # consumer -> instances whose live count may have changed since it took them

    def __len__(self) -> int:
        return len(self._by_key)

    def _count(self, e: _Entry, sign: int) -> None:
        e.counted = sign > 0
        v = e.view
        for touched in self._touched.values():
            touched.add(v.instance_id)
        for d, k in ((self._live_inst, v.instance_id), (self._live_model, v.model)):
            n = d.get(k, 0) + sign
            if n:
                d[k] = n
            else:
                d.pop(k, None)

    def _put(self, key: str, e: _Entry) -> None:
        """Store ``e`` under ``key`` (uncounting what it replaces), counted when alive at ``_at``. Mutates all."""
        self._drop(key)
        self._by_key[key] = e
        if self._at < e.view.t_exp_unix:
            self._count(e, +1)
            self._seq += 1
            heapq.heappush(self._expiry, (e.view.t_exp_unix, self._seq, e))

    def _drop(self, key: str) -> None:
        e = self._by_key.pop(key, None)
        if e is not None and e.counted:
            self._count(e, -1)

    def _advance(self, now: float) -> None:
        """Bring the live counts to ``now``. Mutates the counts and the expiry heap."""
        if now < self._at:  # the clock went back: recount everything
            self._live_inst.clear()
            self._live_model.clear()
            for touched in self._touched.values():
                touched.update(e.view.instance_id for e in self._by_key.values())
            self._expiry.clear()
            self._at = now
            for e in self._by_key.values():
                e.counted = False
                if now < e.view.t_exp_unix:
                    self._count(e, +1)
                    self._seq += 1
                    self._expiry.append((e.view.t_exp_unix, self._seq, e))
            heapq.heapify(self._expiry)
            return
        self._at = now
        heap = self._expiry
        while heap and heap[0][0] <= now:
            e = heapq.heappop(heap)[2]
            if e.counted:
                self._count(e, -1)

    def upsert(self, lease: rpb.Lease, revision: int = 0) -> None:
        key = lease_key(lease.session_id, lease.model)
        cur = self._by_key.get(key)
        if cur is not None and cur.revision > revision > 0:
            return  # an older revision arriving late
        self._put(key, _Entry(lease, view_of(lease), revision))

    def remove(self, key: str, revision: int = 0) -> None:
        cur = self._by_key.get(key)
        if cur is not None and (revision == 0 or cur.revision <= revision):
            self._drop(key)

    def keys(self) -> list[str]:
        return list(self._by_key)

    def get(self, session_id: str, model: str) -> tuple[LeaseView, int] | None:
        """The lease of (session, model), live or recently expired, and its revision."""
        e = self._by_key.get(lease_key(session_id, model))
        return None if e is None else (e.view, e.revision)

    def prune(self, now: float) -> int:
        old = [k for k, e in self._by_key.items() if now > e.view.t_exp_unix + GRACE_S]
        for k in old:
            self._drop(k)
        return len(old)

    def live_by_instance(self, now: float) -> dict[str, int]:
        """Live leases (``now < t_exp``) per instance (a copy). Advances the live counts to ``now``."""
        self._advance(now)
        return dict(self._live_inst)

    def live_count(self, instance_id: str, now: float) -> int:
        """Live leases on one instance at ``now``. Advances the live counts to ``now``."""
        self._advance(now)
        return self._live_inst.get(instance_id, 0)

    def take_live_changes(self, now: float, consumer: object = None) -> set[str]:
        """Instances whose live count may have changed since ``consumer``'s last call (a superset; on its first
        call, every instance with a live lease). Advances the counts to ``now``; mutates the consumer's set."""
        self._advance(now)
        got = self._touched.get(consumer)
        self._touched[consumer] = set()
        return set(self._live_inst) if got is None else got

    def weighted_by_instance(self, now: float, quantum: float = 0.125) -> dict[str, float]:
        """Live leases per instance, each weighted by its decaying value (``return_gap.lease_weight``: a
        fixed-tau lease weighs 1 until it expires), rounded to ``quantum`` so that placement state is rebuilt
        only when a weight moved visibly."""
        acc: dict[str, float] = {}
        for e in self._by_key.values():
            v = e.view
            if now < v.t_exp_unix:
                acc[v.instance_id] = acc.get(v.instance_id, 0.0) + lease_weight(v.gap_mu, v.gap_sigma, v.t_done_unix, v.t_exp_unix, now)
        return {k: round(w / quantum) * quantum for k, w in acc.items() if w >= quantum / 2}

    def held_token_s(self, now: float) -> float:
        """Committed tokens x seconds held so far by the leases in the table (live ones until now, expired
        ones until their expiry): device KV reserved by leases not judged yet."""
        return sum(max(0.0, min(now, e.view.t_exp_unix) - e.view.t_done_unix) * e.view.committed_tokens for e in self._by_key.values())

    def live_by_model(self, now: float) -> dict[str, int]:
        """Live leases per model (a copy). Advances the live counts to ``now``."""
        self._advance(now)
        return dict(self._live_model)

    def live_of_model(self, model: str, now: float) -> int:
        self._advance(now)
        return self._live_model.get(model, 0)

    def drop_session(self, session_id: str) -> list[LeaseView]:
        """Remove every lease of a session (all models; it ended). Returns them."""
        gone = [(k, e.view) for k, e in self._by_key.items() if e.lease.session_id == session_id]
        for k, _ in gone:
            self._drop(k)
        return [v for _, v in gone]

    def keys_of_session(self, session_id: str) -> list[str]:
        return [k for k, e in self._by_key.items() if e.lease.session_id == session_id]

    def drop_instance(self, instance_id: str) -> int:
        gone = [k for k, e in self._by_key.items() if e.view.instance_id == instance_id]
        for k in gone:
            self._drop(k)
        return len(gone)


class MemoryLeases:
    """Leases private to one router process (same interface as ``JetStreamLeases``)."""

    shared = False

    def __init__(self, table: LeaseTable):
        self.table = table
        self._rev = 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def resync(self, timeout: float = 5.0) -> bool:
        return True  # nothing shared to catch up with

    def install_now(self, lease: rpb.Lease) -> None:
        self._rev += 1
        self.table.upsert(lease, self._rev)

    async def install(self, lease: rpb.Lease, ttl_s: float) -> None:
        self.install_now(lease)

    def consume_now(self, session_id: str, model: str, revision: int) -> bool:
        got = self.table.get(session_id, model)
        if got is None or got[1] != revision:
            return False
        self.table.remove(lease_key(session_id, model))
        return True

    async def consume(self, session_id: str, model: str, revision: int) -> bool:
        return self.consume_now(session_id, model, revision)

    async def discard(self, session_id: str, model: str, revision: int) -> None:
        self.consume_now(session_id, model, revision)

    async def drop_session(self, session_id: str, models=()) -> int:
        """The session ended; remove its leases. Returns how many."""
        return len(self.table.drop_session(session_id))


class JetStreamLeases:
    """Leases in the JetStream KV bucket shared by all router replicas of a namespace."""

    shared = True

    def __init__(self, nc, bucket: str, table: LeaseTable, ttl_s: float):
        self.nc = nc
        self.bucket = bucket
        self.table = table
        self.ttl_s = ttl_s
        self.kv = None
        self._watcher = None
        self._task: asyncio.Task | None = None
        self._synced = asyncio.Event()  # the current watcher delivered the bucket's values at its start
        self.resyncs = 0

    async def start(self) -> None:
        # max_age only sweeps old delete markers; leases expire by their own per-key TTL.
        self.kv = await open_kv_bucket(self.nc, self.bucket, history=1, ttl=3600, description="Talaria soft reservations")
        await self._watch(resync=False)

    async def _watch(self, resync: bool) -> None:
        assert self.kv is not None
        self._synced = asyncio.Event()
        try:  # the bucket's last sequence now: the mirror is in sync once it has applied an entry that recent
            target = (await self.kv.status()).stream_info.state.last_seq
        except Exception:  # noqa: BLE001 - unknown: trust the watcher's end-of-initial-values marker alone
            target = 0
        self._watcher = await self.kv.watchall()
        self._task = asyncio.create_task(self._mirror(self._watcher, self._synced, resync, target), name=f"lease-mirror-{self.bucket}")

    async def resync(self, timeout: float = 5.0) -> bool:
        """Rebuild the mirror from the bucket now (call after a NATS reconnect: the old watcher can lag for
        tens of seconds). Replaces the watcher; keys no longer in the bucket leave the
        table (mutates it). Returns whether the bucket's values arrived within ``timeout``."""
        await self._stop_watch()
        self.resyncs += 1
        await self._watch(resync=True)
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("lease mirror resync of %s: no initial values within %.1fs", self.bucket, timeout)
            return False
        return True

    async def _mirror(self, watcher, synced: asyncio.Event, resync: bool, target: int = 0) -> None:
        """Apply the watcher's entries to the table. In sync (``synced``) once the end-of-initial-values marker
        came *and* an entry at least as recent as ``target`` (the bucket's last sequence when the watch began)
        was applied: the client library can emit its marker before initial values already in flight (it
        compares the consumer's pending count with what its callback has delivered so far), so the marker
        alone may come first. On a resync, keys not among the initial values then leave the table."""
        seen: set[str] = set()
        marker, latest = False, 0

        def settle() -> None:
            if synced.is_set() or not marker or latest < target:
                return
            if resync:
                for key in self.table.keys():
                    if key not in seen:
                        self.table.remove(key)
            synced.set()

        try:
            async for entry in watcher:
                if entry is None:  # the library's end of the initial values
                    marker = True
                    settle()
                    continue
                if not synced.is_set():
                    seen.add(entry.key)
                self._apply(entry)
                latest = max(latest, entry.revision or 0)
                settle()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            log.warning("lease mirror stopped: %s", e)

    def _apply(self, entry) -> None:
        """Mirror one bucket entry into the table (mutates it)."""
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.table.remove(entry.key, entry.revision or 0)
            return
        try:
            lease = rpb.Lease.FromString(entry.value)
        except Exception:  # noqa: BLE001 - a foreign or corrupt value must not stop the mirror
            log.warning("undecodable lease under %s", entry.key)
            return
        self.table.upsert(lease, entry.revision or 0)

    async def _stop_watch(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:  # noqa: BLE001
                pass
            self._watcher = None

    async def stop(self) -> None:
        await self._stop_watch()

    async def install(self, lease: rpb.Lease, ttl_s: float) -> None:
        """Create the key with a per-key TTL; if a lease is there already, the newer one wins."""
        assert self.kv is not None
        key = lease_key(lease.session_id, lease.model)
        ttl = max(1.0, float(int(ttl_s + 0.999)))  # NATS message TTLs are whole seconds (>= 1 s)
        data = lease.SerializeToString()
        try:
            rev = await self.kv.create(key, data, msg_ttl=ttl)
        except Exception:  # noqa: BLE001 - key exists: another replica installed this lease, or an older one is live
            try:
                cur = await self.kv.get(key)
                old = rpb.Lease.FromString(cur.value) if cur.value else None
            except Exception:  # noqa: BLE001 - it vanished meanwhile
                old = None
            if old is not None and (old.lease_id == lease.lease_id or old.t_done_unix >= lease.t_done_unix):
                # a peer's lease (or the same one): record it now rather than wait for the watcher
                self.table.upsert(old, cur.revision or 0)
                return
            try:
                await self.kv.purge(key)
                rev = await self.kv.create(key, data, msg_ttl=ttl)
            except Exception as e:  # noqa: BLE001
                log.info("lease for %s not installed (raced): %s", key, e)
                return
        self.table.upsert(lease, rev)

    async def consume(self, session_id: str, model: str, revision: int) -> bool:
        """Delete the key iff it is still at ``revision``; True for exactly one consumer."""
        assert self.kv is not None
        key = lease_key(session_id, model)
        try:
            await self.kv.delete(key, last=revision)
        except Exception as e:  # noqa: BLE001 - wrong last sequence: consumed by another replica or replaced
            log.info("lease %s not consumed at revision %d: %s", key, revision, e)  # the store's own words (its last sequence)
            self.table.remove(key, revision)
            return False
        self.table.remove(key, revision)
        return True

    async def discard(self, session_id: str, model: str, revision: int) -> None:
        await self.consume(session_id, model, revision)

    async def drop_session(self, session_id: str, models=()) -> int:
        """The session ended; delete its leases from the bucket (every replica's mirror follows) and
        the table: the keys this mirror knows plus those of ``models`` (a lease installed by a peer that the
        watcher has not delivered yet). Unconditional and idempotent: any replica may do it, several may.
        Returns keys deleted."""
        assert self.kv is not None
        keys = set(self.table.keys_of_session(session_id)) | {lease_key(session_id, m) for m in models}
        for key in sorted(keys):
            try:
                await self.kv.delete(key)
            except Exception as e:  # noqa: BLE001 - gone already, or the store is down: the mirror/TTL ends it
                log.info("lease %s not deleted: %s", key, e)
            self.table.remove(key)
        return len(keys)
