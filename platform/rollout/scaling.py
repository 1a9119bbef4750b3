"""Serve autoscaling policy driven by the engines' own load.

Serve's default policy counts ongoing *calls*; our calls carry batches, so a replica
with one call of 256 requests looks idle to it. Replicas report their engine state
(``record_autoscaling_stats``: running + waiting sequences, KV-cache usage) and this
policy sizes the deployment so each replica carries ``target_ongoing_requests``
sequences. Serve wraps custom policies with the configured bounds and the
upscale/downscale delays, which are kept >= the look-back window so a steady load
gives a steady count.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger("ray.serve")

SEQUENCES = "engine_sequences"
KV_USAGE = "kv_cache_usage"
KV_PRESSURE = 0.95  # above this, sequences get preempted: one more replica regardless


def _metrics(ctx: Any) -> dict:
    m = ctx.aggregated_metrics
    return (m() if callable(m) else m) or {}


def engine_load_policy(ctx: Any) -> tuple[float, dict]:
    current = ctx.current_num_replicas
    if current == 0:
        return ctx.target_num_replicas, {}
    metrics = _metrics(ctx)
    sequences = metrics.get(SEQUENCES, {})
    running = list(ctx.running_replicas)
    missing = [r for r in running if r not in sequences]
    target = ctx.config.get_target_ongoing_requests()
    if not sequences:
        # No engine has reported yet (all starting): keep the count rather than guess.
        logger.info("autoscaling: no engine load reported yet by %d replicas; keeping %d", len(running), ctx.target_num_replicas)
        return ctx.target_num_replicas, {}
    if missing:
        logger.info("autoscaling: %d replicas have not reported engine load; counted at the target load", len(missing))
    total = sum(sequences.values()) + target * len(missing)
    desired = total / target
    kv = metrics.get(KV_USAGE, {})
    if kv and max(kv.values()) > KV_PRESSURE:
        desired = max(desired, current + 1)
    return max(desired, 0.0) if math.isfinite(desired) else ctx.target_num_replicas, {}
