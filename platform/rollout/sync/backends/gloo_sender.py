"""Trainer-side sender of the ``gloo`` backend: rank 0 broadcasting packed buckets."""

from __future__ import annotations

from typing import Sequence

import torch

from rollout.sync.backends.gloo_group import GlooGroup
from rollout.sync.plan import RoundPlan
from rollout.sync.wire import pack, plan_buckets


class GlooSender:
    def send(self, plan: RoundPlan, tensors: Sequence[torch.Tensor]) -> None:
        group = GlooGroup(plan.master_address, plan.master_port, 0, plan.world_size, plan.timeout_s, plan.round_id)
        try:
            for bucket in plan_buckets(plan.params, plan.bucket_bytes):
                group.broadcast(pack(tensors[i] for i in bucket), root=0)
        finally:
            group.close()
