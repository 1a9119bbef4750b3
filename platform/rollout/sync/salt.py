"""Prefix-cache salts by weight version (``sync.prefix_cache: salt``).

vLLM folds a request's ``cache_salt`` into the hash of its first KV block, and block
hashes chain, so a request reuses only blocks that requests with the same salt computed
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``; the scheduler's
prefix cache, the same on CPU and GPU). Each request handed to vLLM carries the version
the replica serves as it is handed over: after a commit no request reuses KV computed
under older weights, and nothing is flushed at the update. Older blocks are never hit
again and age out as new blocks need their room (vLLM evicts free blocks oldest first).

Two cases the version alone would get wrong, and what is done instead:

- A request handed over while an update (or a trainer's ``/pause``) holds the engine
  starts under a version not decided yet: it gets a salt of that pause's own, shared with
  no block computed before it.
- A request already in the engine when an update pauses it runs on with the blocks it
  holds. ``keep`` promises it continues on the new weights, so its KV must be computed
  again: the update still flushes then (:meth:`CacheSalts.pause` says when). With
  ``wait`` such requests finish before the update, with ``abort`` they end, and nothing
  is flushed. A request is in the engine before the update's pause reaches it whenever
  its salt was taken first: the replica takes the salt and adds the request to vLLM in
  one step of the event loop (no await between them), and vLLM sends adds and the pause
  over one socket, in order.

One per replica: the sync agent holds it, and the replica takes every request's salt
from it (through its sync gate).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator, Optional

SALT_PREFIX = "rollout-v"


class CacheSalts:
    """Which ``cache_salt`` each request gets, and how many requests that got one are
    still unfinished."""

    def __init__(self, salting: bool) -> None:
        self.salting = salting  # False: requests keep the caller's salt (or none); updates flush
        self._pauses = 0  # pauses begun: names the one in progress
        self._depth = 0  # pauses in progress (a trainer's hold and the rounds inside it)
        self.active = 0  # requests handed over with a salt from here and not finished

    def salt(self, version: int, caller: Optional[str] = None) -> Optional[str]:
        """The salt of a request handed to vLLM now, while the replica serves ``version``.

        A caller's own salt (vLLM's OpenAI ``cache_salt``) is kept apart, not replaced:
        it is folded in as a digest, which keeps the whole under vLLM's 128 characters
        and free of the characters it refuses, and no caller's salt can spell another's.
        """
        if not self.salting:
            return caller
        ours = f"{SALT_PREFIX}{version}"
        if self._depth:
            ours += f"-p{self._pauses}"
        if caller is None:
            return ours
        return f"{ours}.{hashlib.sha256(caller.encode()).hexdigest()[:32]}"

    @contextlib.contextmanager
    def request(self, version: int, caller: Optional[str] = None) -> Iterator[Optional[str]]:
        """The salt of one request, counted as unfinished until the block ends (hold it
        from before the request is added to vLLM until vLLM is done with it)."""
        self.active += 1
        try:
            yield self.salt(version, caller)
        finally:
            self.active -= 1

    def pause(self) -> bool:
        """An update or a trainer's hold begins: requests handed over from now until its
        :meth:`resume` get this pause's own salt. Returns whether requests handed over
        before are unfinished: ``keep`` carries them across, so the update must flush."""
        self._pauses += 1
        self._depth += 1
        return self.active > 0

    def resume(self) -> None:
        self._depth = max(0, self._depth - 1)
