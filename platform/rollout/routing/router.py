"""Ray Serve request router for the engine deployment: prefix and session affinity.

Plugged in through Serve's request-router extension point (``RequestRouterConfig``).
Replicas report their load (:class:`rollout.contracts.load.ReplicaLoad`) through
``record_routing_stats`` every ``deployment.routing.stats_period_s``; the decision itself
is :func:`rollout.routing.affinity.rank`.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from rollout.contracts.load import ReplicaLoad
from rollout.episodes import replica_of
from rollout.routing.affinity import affinity_key, rank

logger = logging.getLogger(__name__)


class AffinityRouter(RequestRouter):
    # No FIFOMixin: it hands the replica chosen for one request to the oldest pending
    # request, whatever its key. The base router fulfils exactly the request it chose for.

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Optional[Any] = None) -> None:
        # Give the replica to the very request it was chosen for. The base router looks
        # that request up by internal_request_id, but every handle call made while
        # serving one HTTP request inherits that request's id: the ingress's concurrent
        # chunks of one batch share it, the lookup finds only the first, and the others
        # would be routed forever without ever being sent.
        for pr in self._pending_requests_to_fulfill:
            if pr.metadata is request_metadata and not pr.future.done():
                self._record_queue_wait_time(pr)
                pr.future.set_result(replica)
                if self._pending_requests_by_id.get(request_metadata.internal_request_id) is pr:
                    self._remove_pending_request_from_indices(pr)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def initialize_state(self, max_imbalance: float = 0.25, prefix_tokens: int = 32, prefix_chars: int = 128, **kwargs):
        self.max_imbalance = max_imbalance
        self.prefix_tokens = prefix_tokens
        self.prefix_chars = prefix_chars

    def _key(self, pending_request: Optional[PendingRequest]) -> Optional[str]:
        if pending_request is None or not pending_request.args:
            return None
        first = pending_request.args[0]
        if isinstance(first, (list, tuple)):
            # A batch (one chunk of a client call): its first request stands for it.
            first = first[0] if first else None
        return affinity_key(first, self.prefix_tokens, self.prefix_chars) if first is not None else None

    @staticmethod
    def _pinned(pending_request: Optional[PendingRequest]) -> Optional[str]:
        """The replica an episode call must go to: the one its episode id names."""
        if pending_request is None or not pending_request.args:
            return None
        first = pending_request.args[0]
        episode_id = first.get("episode_id") if isinstance(first, dict) else getattr(first, "episode_id", None)
        return replica_of(episode_id) if isinstance(episode_id, str) else None

    @staticmethod
    def _avoided(pending_request: Optional[PendingRequest]) -> Optional[str]:
        """The replica a retried call names as having refused it (``avoid_replica``,
        :class:`~rollout.errors.NotServingError`'s ``replica_id``): ranked last, so the
        retry goes to another replica where one can take it, affinity or not."""
        if pending_request is None or not pending_request.kwargs:
            return None
        avoid = pending_request.kwargs.get("avoid_replica")
        return avoid if isinstance(avoid, str) else None

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = self._pinned(pending_request)
        if pinned in by_id:
            # Only that replica holds the episode's tokens: wait for it rather than go elsewhere.
            return [[by_id[pinned]]]
        # (A pinned replica that is gone: any replica answers EpisodeLostError.)
        loads = [ReplicaLoad.from_routing_stats(rid, r.routing_stats) for rid, r in by_id.items()]
        ranked = rank(self._key(pending_request), loads, self.max_imbalance)
        avoid = self._avoided(pending_request)
        if avoid in by_id:
            ranked = [rid for rid in ranked if rid != avoid] + [avoid]
        # One replica per rank: Serve tries them in order if one is at max_ongoing_requests.
        return [[by_id[rid]] for rid in ranked]
