"""Which replica should serve a request: affinity first, load as the tie-breaker.

Requests that share a prefix (the ``n`` samples of a GRPO group, a system prompt) or a
``session_id`` (the turns of one episode) should land on the replica whose prefix cache
already holds their KV. Rendezvous hashing gives every key a stable preferred replica
that only moves when that replica leaves. When the preferred replica is loaded more
than ``max_imbalance`` above the least-loaded one, the request goes to the least-loaded
replica instead: a cache hit is not worth a queue.

Loads are ``(running + waiting) / max_num_seqs`` from each replica's own report
(:attr:`rollout.contracts.load.ReplicaLoad.relative_load`). A replica without one has an
*unknown* load (logged): it keeps its affinity keys, is never taken for the least-loaded
one, and is ranked after the replicas that report.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Optional, Sequence

from rollout.contracts.load import ReplicaLoad

logger = logging.getLogger(__name__)
_logged_unknown: set[str] = set()


def affinity_key(request: Any, prefix_tokens: int, prefix_chars: int) -> Optional[str]:
    """A stable key for a request: its session, else its prompt's prefix."""
    get = request.get if isinstance(request, dict) else lambda k, d=None: getattr(request, k, d)
    session = get("session_id")
    if session:
        return f"session:{session}"
    ids = get("prompt_token_ids")
    if ids:
        return "tokens:" + ",".join(map(str, list(ids)[:prefix_tokens]))
    prompt = get("prompt")
    if prompt:
        return "text:" + prompt[:prefix_chars]
    messages = get("messages")
    if messages:
        first = [m if isinstance(m, dict) else m.model_dump() for m in list(messages)[:2]]
        return "chat:" + json.dumps(first, sort_keys=True)[:prefix_chars]
    return None


def _score(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest(), "big")


def rank(key: Optional[str], replicas: Sequence[ReplicaLoad], max_imbalance: float) -> list[str]:
    """Replica ids, best first."""
    if not replicas:
        return []
    known = sorted((r for r in replicas if r.relative_load is not None), key=lambda r: (r.relative_load, r.replica_id))
    unknown = sorted((r for r in replicas if r.relative_load is None), key=lambda r: r.replica_id)
    new_unknown = [r.replica_id for r in unknown if r.replica_id not in _logged_unknown]
    if new_unknown:
        # Once per replica, not once per request: a starting replica is asked about often.
        _logged_unknown.update(new_unknown)
        logger.info("no engine stats from %s: their load counts as unknown", new_unknown)
    by_load = [r.replica_id for r in known] + [r.replica_id for r in unknown]
    if key is None:
        return by_load
    preferred = max(replicas, key=lambda r: _score(key, r.replica_id))
    # Affinity yields only to evidence: a known load above the least-loaded replica's
    # by more than max_imbalance. An unknown load is no evidence of overload.
    if preferred.relative_load is not None and known and preferred.relative_load - known[0].relative_load > max_imbalance:
        return by_load
    return [preferred.replica_id] + [rid for rid in by_load if rid != preferred.replica_id]
