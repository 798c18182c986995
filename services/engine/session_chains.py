"""Which hash chains a session's calls left behind (the end of a session releases them).

A session's calls do not always extend one another: a chat template that closes the user turn differently, a
rewritten history or a tool turn re-rendered makes call k+1's prompt diverge from call k's committed tokens at
some page, so the session leaves a *tree* of chains in the radix cache and the host store. The session entry
only knows the newest chain; this bounded record keeps the last few chains per session (their full-page hashes)
so that an explicit end can release every branch, newest first: releasing the newest chain's own tail makes the
fork page a leaf again, so the older branch's release then goes down to the shared prefix of other sessions.
Pure, no locks (the executor thread owns it, under its step lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SessionChains:
    def __init__(self, max_sessions: int = 4096, max_chains: int = 8) -> None:
        self.max_sessions, self.max_chains = max_sessions, max_chains
        self._d: OrderedDict[str, list[list[int]]] = OrderedDict()

    def record(self, session_id: str, hashes: Sequence[int]) -> None:
        """A call of the session committed full pages with these hashes (page 0 first). Mutates the record:
        a chain that is a prefix of the new one is replaced by it; oldest chains / sessions go past the bounds."""
        if not session_id or not hashes:
            return
        new = list(hashes)
        chains = [c for c in self._d.pop(session_id, []) if c != new[: len(c)]]
        chains.append(new)
        self._d[session_id] = chains[-self.max_chains :]
        while len(self._d) > self.max_sessions:
            self._d.popitem(last=False)

    def pop(self, session_id: str) -> list[list[int]]:
        """Forget the session; its chains, oldest first."""
        return self._d.pop(session_id, [])

    def __len__(self) -> int:
        return len(self._d)
