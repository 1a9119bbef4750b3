"""Trainer-side senders, one module per transport, picked by name.

The receiving side of each transport is a vLLM weight-transfer engine (vLLM's own
``nccl`` and ``ipc``, our ``gloo`` in :mod:`rollout.sync.backends.gloo_worker`).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from rollout.sync.plan import RoundPlan


class Sender(Protocol):
    def offer(self, tensors: Sequence[torch.Tensor]) -> Optional[dict]:
        """Before the round opens: what replicas need to pull the weights themselves
        (it becomes the plan's ``transfer_info``), or None when :meth:`send` pushes them."""

    @property
    def group_name(self) -> Optional[str]:
        """The transfer group kept from the last round, if the transport can reuse it."""

    def send(self, plan: RoundPlan, tensors: Sequence[torch.Tensor]) -> None:
        """Deliver ``tensors`` (in ``plan.params`` order) to every rank of the round."""

    def close(self) -> None:
        """Release the transfer group."""


def make_sender(backend: str) -> Sender:
    if backend == "gloo":
        from rollout.sync.backends.gloo_sender import GlooSender

        return GlooSender()
    if backend == "nccl":
        from rollout.sync.backends.nccl_sender import NcclSender

        return NcclSender()
    if backend == "ipc":
        from rollout.sync.backends.ipc_sender import IpcSender

        return IpcSender()
    raise ValueError(f"backend: no trainer-side sender for {backend!r} (available: 'gloo', 'nccl', 'ipc')")
