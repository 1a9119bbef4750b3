"""A replica's load, in one type: what its engine holds and how full it is.

The replica builds a :class:`ReplicaLoad` from its scheduler snapshot; the request
router, the autoscaling policy, the replica's gauges, ``rollout status`` and
``RolloutClient.stats()`` all read that one type. Ray Serve carries a load between
processes only as a plain dict (routing stats) or as numbers by metric name
(autoscaling metrics), so the converters for those two boundaries live here and no
other module reads a load by string keys.

A signal that was not reported stays ``None`` and is left out of what crosses a
boundary: a replica that has not reported has an *unknown* load, not a zero one. What an
unknown load means is for its reader to decide (the router ranks the replica last, the
autoscaler counts it at the target load).

Imports pydantic only: routers and ``rollout status`` load it without vLLM or torch.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

# A number of sequences. The replica reports whole numbers; read back from Serve's
# autoscaling metrics it is a mean over the look-back window, so it may be fractional.
Count = Union[int, float]

# Serve's names of the custom autoscaling metrics, by the field each one carries.
# Running and waiting travel apart so that they come back apart: Serve's time-weighted
# mean is linear, so their sum is still the mean number of sequences.
AUTOSCALING_METRICS = {"running": "engine_running", "waiting": "engine_waiting", "kv_cache_usage": "kv_cache_usage", "sleep_level": "engine_sleep_level"}


class ReplicaLoad(BaseModel):
    """One replica's load and state; ``RolloutClient.stats()`` returns it as is.

    The fields and their order are the public shape of ``stats()``: keep them.
    """

    model_config = ConfigDict(frozen=True)

    replica_id: str
    running: Optional[Count] = None  # sequences the engine is running
    waiting: Optional[Count] = None  # sequences waiting for a place in the engine's batch
    kv_cache_usage: Optional[float] = None  # fraction of KV-cache blocks in use, 0-1
    prefix_cache_queries: Optional[int] = None  # prompt tokens looked up in the prefix cache, since the start
    prefix_cache_hits: Optional[int] = None  # of those, tokens found there
    inflight_requests: Optional[int] = None  # requests of the calls the replica is serving
    unfinished_requests: Optional[int] = None  # requests vLLM holds
    weight_version: Optional[str] = None  # policy version served, as vLLM labels it (rollout.contracts.version)
    max_num_seqs: Optional[int] = None  # sequences the engine batches at most
    updated_at: Optional[float] = None  # wall-clock time of the last engine step seen
    # The highest kv_cache_usage the engine reported since the replica's current run of
    # in-flight requests began (idle: in its last one), 0-1: what a burst of work used.
    kv_cache_usage_peak: Optional[float] = None
    # vLLM's sleep level of its engine (a trainer's /sleep): 0 awake, 1 or 2 asleep. Read
    # back from the autoscaler it is a mean over the window: above 0, it slept in it.
    sleep_level: Optional[Count] = None

    @property
    def sequences(self) -> Optional[Count]:
        """Running + waiting: the work the engine holds."""
        if self.running is None or self.waiting is None:
            return None
        return self.running + self.waiting

    @property
    def relative_load(self) -> Optional[float]:
        """``(running + waiting) / max_num_seqs``: the load routers compare across replicas."""
        if self.sequences is None or not self.max_num_seqs:
            return None
        return self.sequences / self.max_num_seqs

    @property
    def prefix_cache_hit_rate(self) -> Optional[float]:
        """Share of looked-up prompt tokens found in the prefix cache; none before the first lookup."""
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    # ---- Serve's request routers: ``record_routing_stats`` -> ``RunningReplica.routing_stats``

    def to_routing_stats(self) -> dict[str, Any]:
        """What ``record_routing_stats`` returns: Serve pickles it to every router, where
        Serve documents a dict. The router knows the replica's id; unknown signals are left out."""
        return self.model_dump(exclude={"replica_id"}, exclude_none=True)

    @classmethod
    def from_routing_stats(cls, replica_id: str, stats: Optional[Mapping[str, Any]]) -> ReplicaLoad:
        """The load a router reads from ``RunningReplica.routing_stats`` (empty before the
        replica's first report)."""
        known = {name: value for name, value in (stats or {}).items() if name in _REPORTED_FIELDS}
        try:
            return cls(replica_id=replica_id, **known)
        except ValidationError as e:
            # A replica of another version (mid-update) may report a field this code
            # cannot read: that field is unknown, the rest of its report still counts.
            unreadable = {error["loc"][0] for error in e.errors() if error["loc"]}
            return cls(replica_id=replica_id, **{name: value for name, value in known.items() if name not in unreadable})

    # ---- Serve's autoscaler: ``record_autoscaling_stats`` -> ``AutoscalingContext.aggregated_metrics``

    def to_autoscaling_metrics(self) -> dict[str, float]:
        """What ``record_autoscaling_stats`` returns. Serve takes only numbers by metric name
        (it disables custom metrics on any other value), so unknown signals are left out."""
        values = {metric: getattr(self, name) for name, metric in AUTOSCALING_METRICS.items()}
        return {metric: float(value) for metric, value in values.items() if value is not None}

    @classmethod
    def from_autoscaling_metrics(cls, metrics: Mapping[str, Mapping[Hashable, float]]) -> dict[Hashable, ReplicaLoad]:
        """Each replica's load from Serve's ``{metric: {replica: mean over the look-back
        window}}``, keyed as Serve keys it (a ``ReplicaID``). A replica absent from every
        metric has not reported: it is absent here too."""
        fields: dict[Hashable, dict[str, float]] = {}
        for name, metric in AUTOSCALING_METRICS.items():
            for replica, value in (metrics.get(metric) or {}).items():
                fields.setdefault(replica, {})[name] = value
        return {replica: cls(replica_id=_replica_id(replica), **values) for replica, values in fields.items()}


# What a replica reports about itself; Serve's boundaries carry its id apart. A set, as
# routers look fields up for every replica of every call they route.
_REPORTED_FIELDS = frozenset(ReplicaLoad.model_fields) - {"replica_id"}


def _replica_id(replica: Hashable) -> str:
    # Serve's ReplicaID; routers see its unique_id, which is what the replica reports as its own.
    return str(getattr(replica, "unique_id", replica))
