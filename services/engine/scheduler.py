"""Continuous batching with chunked prefill (pure Python, no torch).

Design NOTE. Every ``schedule()`` builds one flat batch under two limits: ``max_num_batched_tokens`` new
tokens and ``max_num_seqs`` running sequences.

1. Decodes first: each running sequence with exactly one uncomputed token (its last sampled token) gets
   one token, oldest first. If it needs a new page and none is free, the block manager evicts cache
   entries (radix leaves, then session entries, LRU); if that is not enough the *newest* running sequence
   is preempted (pages released without caching, requeued at the head of the waiting queue, recomputed
   later: its prompt + generated tokens are prefilled again, which yields the next token exactly as a
   decode would).
2. Then prefill chunks: running sequences with a partial prefill continue, then waiting sequences are
   admitted FCFS (in priority order first — a call's ``priority`` hint queues it ahead of waiting
   calls of lower priority, never ahead of a preempted one; equal priorities keep arrival order). Admission is check-then-commit against the block manager: prefix match (session entry or
   radix), pages for the whole remaining prompt (evicting caches if needed, never preempting), then
   commit. A sequence whose prefill does not fit the remaining token budget gets a chunk and continues
   next step. No admission happens in a step that preempted.
   Prefix-aware admission (the effect of vLLM's and SGLang's prefix caching on calls that
   arrive together): a running sequence's computed full prompt pages are published into the radix cache
   (``_publish_running``, at the top of a schedule with calls waiting, once the executor said the last
   forward completed: ``forward_done``; never those of a failed forward), and a waiting sequence whose next uncached page is one that
   a running sequence is still computing (same cumulative hash: same tokens up to there) is *deferred*:
   it stays waiting, later ones may be admitted, and it is admitted once those pages are published, with
   the shared prefix as a cache hit. Eight agent sessions that start together behind one system prompt
   compute it once instead of eight times. A deferred call waits for the leader's chunk that covers the
   shared part (one step when it fits the budget), which the leader's own prefill was going to take anyway.
3. A step in which nothing decodes gives its first prefill chunk up to ``lone_prefill_tokens`` (when that
   is larger than ``max_num_batched_tokens``); the step's other chunks share what is left of the normal
   budget. Chunking bounds the stall of decoding sequences (Sarathi-Serve's argument); with none decoding, a
   long prompt in 512-token chunks only pays more steps (``python -m bench.lone_prefill_bench``, SmolLM2 bf16,
   2 cores of an AMD EPYC without AMX, three runs of medians of 3 interleaved repetitions: TTFT of a lone
   2,048-token prompt 1.09-1.16x, 1,024 tokens 1.05-1.12x, eight 800-token prompts at once mean TTFT
   1.02-1.04x). A call arriving during such a step waits for it, as it waits for any step.

``schedule()`` advances ``num_computed_tokens`` of the scheduled sequences (the executor runs exactly what
was scheduled); the caller appends the sampled token of every entry with ``sample=True`` and ends
sequences with ``finish``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.kv.manager import CopyOp, KVManager
from services.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # num_computed_tokens before this step (position of the first new token)
    num_new_tokens: int
    sample: bool  # this step computes the last uncomputed token: sample the next one

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start > 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefill chunks
    copies: list[CopyOp] = field(default_factory=list)  # copy-on-write to run before the forward
    preempted: list[str] = field(default_factory=list)  # request ids
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def summary(self) -> list[tuple[str, int]]:
        """``(request_id, num_new_tokens)`` per scheduled sequence, in batch order (for tests and logs)."""
        return [(s.seq.request_id, s.num_new_tokens) for s in self.scheduled]


def _before(a: Sequence, b: Sequence) -> bool:
    """``a`` is admitted before ``b`` (call hints): higher priority, then earlier effective arrival."""
    return a.priority > b.priority or (a.priority == b.priority and a.queue_at < b.queue_at)


NEVER_PUBLISH = 1 << 62  # num_published_pages of a sequence whose forward failed (forward_failed)


class Scheduler:
    def __init__(self, kv: KVManager, *, max_num_seqs: int = 32, max_num_batched_tokens: int = 512, lone_prefill_tokens: int = 0) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or lone_prefill_tokens < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive, lone_prefill_tokens not negative")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lone_prefill_tokens = lone_prefill_tokens  # first prefill chunk's limit in a step with no decode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0
        self._forward_ok = False  # the last scheduled forward completed (forward_done): running KV is written

    # ---------------------------------------------------------------- intake
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting sequence that goes first: a higher ``priority``, or the same one
        and an earlier ``queue_at`` (call hints; no hints = FCFS), and never ahead of a preempted one (they
        resume first). Mutates ``waiting``."""
        seq.status = SequenceStatus.WAITING
        i = len(self.waiting)
        while i > 0 and not self.waiting[i - 1].num_preemptions and _before(seq, self.waiting[i - 1]):
            i -= 1
        self.waiting.insert(i, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        self.kv.finish_copies()  # the previous step's copies have run
        if self.waiting and self._forward_ok:
            self._publish_running()
        self._forward_ok = False  # until the executor says this step's forward completed
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        # 1. decodes, oldest first
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1 or seq.num_computed_tokens == 0:
                continue
            if not self._reserve_decode_page(seq, out):
                continue  # seq itself was preempted
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, True))
            seq.num_computed_tokens += 1
            scheduled.add(id(seq))
            budget -= 1

        # a step in which nothing decodes: its first prefill chunk may be longer (chunking protects decoding
        # sequences only; with none, a long prompt takes fewer, larger, more efficient steps)
        limit = budget if out.scheduled else max(budget, self.lone_prefill_tokens)

        # 2a. running sequences in the middle of a chunked prefill
        for seq in self.running:
            if limit == 0:
                break
            if id(seq) in scheduled or seq.num_uncomputed == 0:
                continue
            n = self._schedule_chunk(seq, limit, out)
            budget = max(0, budget - n)
            limit = budget

        # 2b. admissions, FCFS; a call whose next page a running prefill is computing waits for it (deferred)
        i = 0
        inflight: set[int] | None = None
        while i < len(self.waiting) and limit > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[i]
            if inflight is None:
                inflight = self._inflight_hashes()
            admitted = self._admit(seq, out, inflight)
            if admitted is None:
                i += 1  # deferred: its prefix is being computed by a running call
                continue
            if not admitted:
                break
            del self.waiting[i]
            self.running.append(seq)
            inflight.update(seq.hashes[seq.num_published_pages :])
            n = self._schedule_chunk(seq, limit, out)
            budget = max(0, budget - n)
            limit = budget

        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        n = min(seq.num_uncomputed, budget)
        start = seq.num_computed_tokens
        seq.num_computed_tokens += n
        out.scheduled.append(ScheduledSeq(seq, start, n, seq.num_uncomputed == 0))
        return n

    def _reserve_decode_page(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make sure ``seq`` has a slot for its next token: evict caches, then preempt newest sequences.
        Returns False when ``seq`` itself had to be preempted."""
        kv = self.kv
        while not kv.can_append(len(seq.pages), seq.num_tokens):
            if kv.ensure_free(1):
                break
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        kv.append(seq.pages, seq.num_tokens)
        return True

    def _inflight_hashes(self) -> set[int]:
        """Full-page hashes running sequences hold but have not published yet (being computed, or computed by
        the step being scheduled now). Read-only."""
        out: set[int] = set()
        for s in self.running:
            out.update(s.hashes[s.num_published_pages :])
        return out

    def forward_done(self) -> None:
        """The executor ran the last scheduled forward without error: the KV of every running sequence's
        ``num_computed_tokens`` is written. Mutates: the flag ``schedule`` publishes by."""
        self._forward_ok = True

    def forward_failed(self, sched: SchedulerOutput) -> None:
        """The forward of ``sched`` raised: what it was to write cannot be trusted, so those sequences never
        publish pages (their calls are failed). Mutates: their ``num_published_pages``."""
        self._forward_ok = False
        for sc in sched.scheduled:
            sc.seq.num_published_pages = NEVER_PUBLISH

    def _publish_running(self) -> None:
        """Publish every running sequence's computed full pages (of its hashed tokens: the prompt, or prompt +
        generated for a preempted call) into the radix cache. Only at the top of a schedule with calls
        waiting (nobody else could use them sooner) and after a forward that completed. Mutates: the radix
        cache, ``num_published_pages``."""
        P = self.kv.page_size
        for seq in self.running:
            n = min(seq.num_computed_tokens // P, len(seq.hashes))
            if seq.num_published_pages < n:
                self.kv.publish(seq.hashes, seq.pages, n)
                seq.num_published_pages = n

    def _admit(self, seq: Sequence, out: SchedulerOutput, inflight: set[int] = frozenset()) -> bool | None:
        """Check-then-commit one admission. Returns True when admitted, False when its pages do not fit,
        None when deferred (its next uncached page is in ``inflight``: a running call is computing it)."""
        kv = self.kv
        kv.extend_hashes(seq.hashes, seq.token_ids, seq.salt)
        match = kv.match_prefix(seq.token_ids, seq.hashes, seq.session_id)
        nxt = match.num_tokens // kv.page_size
        if inflight and nxt < len(seq.hashes) and seq.hashes[nxt] in inflight:
            return None
        need = kv.pages_needed(match, seq.num_tokens)
        if not kv.can_allocate(need):
            protect_sid = seq.session_id if match.from_session else ""
            if not kv.ensure_free(need, match, protect_sid):
                return False
        alloc = kv.admit(match, seq.num_tokens, seq.session_id, seq.num_prompt_tokens)
        if seq.kv_hold:  # restored pages: the admission holds them now
            kv.release_hold(seq.kv_hold)
            seq.kv_hold = []
        seq.pages = alloc.pages
        seq.locked_hashes = alloc.locked_hashes
        seq.num_computed_tokens = alloc.num_cached_tokens
        seq.num_cached_tokens = min(alloc.num_cached_tokens, seq.num_prompt_tokens)
        seq.num_published_pages = len(alloc.locked_hashes)  # its radix-matched pages are in the cache already
        seq.status = SequenceStatus.RUNNING
        out.copies += alloc.copies
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.release(seq.pages, seq.locked_hashes, cache=False)
        seq.pages = []
        seq.locked_hashes = []
        seq.num_computed_tokens = 0
        seq.num_published_pages = 0  # what it published stays cached (the radix cache holds its own reference)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.request_id)

    # ---------------------------------------------------------------- endings
    def finish(self, seq: Sequence, cache: bool = True) -> None:
        """End a running or waiting sequence: release its pages (full pages into the radix cache and a
        session entry when ``cache``), mark it finished."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.release(
                seq.pages, seq.locked_hashes, seq.token_ids, seq.num_computed_tokens, seq.hashes,
                seq.session_id, cache=cache, salt=seq.salt,
            )
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if seq.kv_hold:
                self.kv.release_hold(seq.kv_hold)
                seq.kv_hold = []
        seq.pages = []
        seq.locked_hashes = []
        seq.status = SequenceStatus.FINISHED

    def check_integrity(self) -> None:
        self.kv.check_integrity([s.pages for s in self.running])
        for s in self.running:
            need = -(-s.num_computed_tokens // self.kv.page_size)
            assert len(s.pages) >= need, f"{s.request_id}: {len(s.pages)} pages for {s.num_computed_tokens} computed"
        for s in self.waiting:
            assert not s.pages, f"waiting {s.request_id} holds pages"
