"""Serve autoscaling policy driven by the engines' own load.

Serve's default policy counts ongoing *calls*; our calls carry batches, so a replica
with one call of 256 requests looks idle to it. Replicas report their engine state
(``record_autoscaling_stats``: running and waiting sequences, KV-cache usage, read
back as :class:`rollout.contracts.load.ReplicaLoad`) and this
policy sizes the deployment so each replica carries ``target_ongoing_requests``
sequences. Serve wraps custom policies with the configured bounds and the
upscale/downscale delays, which are kept >= the look-back window so a steady load
gives a steady count. Replicas that slept in the window (a co-located trainer's ``/sleep``,
``rollout.sync.sleep``) hold no work on purpose: the count stays as it is.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from rollout.contracts.load import ReplicaLoad

logger = logging.getLogger("ray.serve")

KV_PRESSURE = 0.95  # above this, sequences get preempted: one more replica regardless


def _loads(ctx: Any) -> dict[Any, ReplicaLoad]:
    """The replicas' loads averaged over the look-back window, by ``ReplicaID``."""
    m = ctx.aggregated_metrics
    return ReplicaLoad.from_autoscaling_metrics((m() if callable(m) else m) or {})


def engine_load_policy(ctx: Any) -> tuple[float, dict]:
    current = ctx.current_num_replicas
    if current == 0:
        return ctx.target_num_replicas, {}
    loads = _loads(ctx)
    sequences = {r: load.sequences for r, load in loads.items() if load.sequences is not None}
    running = list(ctx.running_replicas)
    missing = [r for r in running if r not in sequences]
    target = ctx.config.get_target_ongoing_requests()
    asleep = [r for r, load in loads.items() if load.sleep_level]
    if asleep:
        # A trainer's /sleep: the engines hold no work on purpose (their GPUs train) and
        # wake with the same replicas; neither scale down nor up on that.
        logger.info("autoscaling: %d replicas slept in the window (a trainer's /sleep); keeping %d", len(asleep), ctx.target_num_replicas)
        return ctx.target_num_replicas, {}
    if not sequences:
        # No engine has reported yet (all starting): keep the count rather than guess.
        logger.info("autoscaling: no engine load reported yet by %d replicas; keeping %d", len(running), ctx.target_num_replicas)
        return ctx.target_num_replicas, {}
    if missing:
        logger.info("autoscaling: %d replicas have not reported engine load; counted at the target load", len(missing))
    total = sum(sequences.values()) + target * len(missing)
    desired = total / target
    kv = [load.kv_cache_usage for load in loads.values() if load.kv_cache_usage is not None]
    if kv and max(kv) > KV_PRESSURE:
        desired = max(desired, current + 1)
    return max(desired, 0.0) if math.isfinite(desired) else ctx.target_num_replicas, {}
