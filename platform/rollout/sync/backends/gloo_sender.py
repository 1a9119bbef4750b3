"""Trainer-side sender of the ``gloo`` backend: rank 0 broadcasting packed buckets."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from rollout.sync.backends.gloo_group import GroupSlot
from rollout.sync.backends.gloo_stream import send_buckets
from rollout.sync.plan import RoundPlan


class GlooSender:
    def __init__(self) -> None:
        self._slot = GroupSlot()

    @property
    def group_name(self) -> Optional[str]:
        """The group this sender still holds; offered to the coordinator for reuse."""
        return self._slot.name

    def offer(self, tensors: Sequence[torch.Tensor]) -> None:
        return None  # pushed by send()

    def send(self, plan: RoundPlan, tensors: Sequence[torch.Tensor]) -> None:
        with self._slot.use(plan.group, plan.master_address, plan.master_port, 0, plan.world_size, plan.timeout_s) as group:
            send_buckets(group, plan.params, tensors, plan.bucket_bytes)

    def close(self) -> None:
        self._slot.drop()
