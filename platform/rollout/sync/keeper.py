"""The gloo backend's copy of the last committed weights on the coordinator, and the bytes
it moves; the committed-weights store (:mod:`rollout.sync.store`) decides when it is used.

After a publish round commits, the publisher sends this copy over a group of two of its
own, from the packed buckets it sent the replicas: the replicas never wait for it, and it
costs the coordinator's node one model's worth of host memory. (Rounds a trainer drives
through vLLM's routes know nothing of that second send: there the keeper joins the
trainer's group as one more receiving rank.) From that copy it acts as the sender of
*pull* rounds: a replica that starts after a commit catches up before it takes
traffic, and a replica whose transfer broke off mid-way reloads the committed weights
instead of serving a mix. Before the first commit the copy is the checkpoint on disk,
read lazily.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from rollout.contracts.backend import delta_base_of
from rollout.contracts.sync_protocol import DeltaBaseError, ParamSpec, PullRound, PushRound, SessionRound
from rollout.sync import delta
from rollout.sync.backends.gloo_group import GlooGroup, GroupSlot, copy_rendezvous, rendezvous
from rollout.sync.backends.gloo_stream import receive_buckets, send_buckets

logger = logging.getLogger(__name__)


class WeightKeeper:
    def __init__(self, model_path: str):
        self.model_path = model_path
        self._committed: Optional[dict[str, torch.Tensor]] = None
        # Staged copies by round: a late receive of an aborted round can never be
        # committed as another round's weights.
        self._staging: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        # The version the copy holds: 0 is the checkpoint on disk. A restarted
        # coordinator starts here again and must not pass these off as a later version.
        self.version = 0
        self._slot = GroupSlot()  # the route sessions' group (and rounds it receives in), kept like every member's

    # ---- receiving (a rank of every publish round) ----------------------------------

    def join(self, plan: SessionRound, rank: int) -> None:
        """Blocking: join a route session's group ahead of its rounds (see sessions.py)."""
        self._slot.join(rendezvous(plan), rank)

    def receive(self, plan: Union[PushRound, SessionRound], rank: int) -> None:
        """Blocking: join ``plan``'s group as ``rank`` and stage every tensor (a delta's
        pieces applied onto the copy, which must hold exactly its base)."""
        offered = plan.transfer_info if isinstance(plan, PushRound) else None
        base = delta_base_of(offered)
        if base is not None and base != self.version:
            raise DeltaBaseError(f"{plan.round_id} is a delta onto version {base}; the coordinator's copy holds version {self.version}")
        counts = list(offered.delta_counts) if base is not None else None
        wire = delta.wire_specs(plan.params, counts) if counts is not None else plan.params
        staged: dict[str, torch.Tensor] = {}
        with self._slot.use(rendezvous(plan), rank) as group:
            for named in receive_buckets(group, wire, plan.bucket_bytes):
                # One buffer per bucket stays alive; the views keep it.
                staged.update(named)
        if counts is not None:
            committed = dict(zip((p.name for p in plan.params), self.committed(plan.params)))
            staged = delta.apply(committed, plan.params, counts, staged)
        self._staging[plan.round_id] = (plan.version, staged)

    def receive_copy(self, plan: PushRound) -> dict[str, torch.Tensor]:
        """Blocking: the copy of committed ``plan`` from its publisher, over the group of
        two the plan names (rank 1); installed with :meth:`install`."""
        staged: dict[str, torch.Tensor] = {}
        group = GlooGroup(copy_rendezvous(plan), 1)
        try:
            for named in receive_buckets(group, plan.params, plan.bucket_bytes):
                staged.update(named)
        finally:
            group.close()
        return staged

    def install(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Hold ``tensors`` as committed ``version``, unless a newer copy arrived first."""
        if version < self.version:
            logger.warning("keeper: the copy of version %d arrived after version %d's; dropped", version, self.version)
            return
        self.version, self._committed = version, tensors
        logger.info("keeper holds version %d", self.version)

    def commit(self, round_id: str, version: int) -> None:
        """``round_id`` committed as ``version`` (a route session's trainer names it at the end)."""
        staged = self._staging.pop(round_id, None)
        if staged is None:
            # Never hand out weights we cannot vouch for: no restore until the next publish.
            logger.error("keeper: round %s committed without a staged copy; holding no valid copy", round_id)
            self.version, self._committed = -1, None
            return
        self.install(version, staged[1])

    def discard(self, round_id: str) -> None:
        self._staging.pop(round_id, None)

    # ---- sending (restore rounds) ------------------------------------------------------

    def committed(self, params: Sequence[ParamSpec]) -> list[torch.Tensor]:
        if self._committed is None:
            if self.version != 0:
                raise RuntimeError(f"keeper holds no copy of version {self.version}")
            self._committed = self._load_checkpoint()
        return [self._committed[p.name] for p in params]

    def send(self, plan: PullRound) -> None:
        """Blocking: act as rank 0 of a pull round (a group of its own, closed after)."""
        group = GlooGroup(rendezvous(plan), 0)
        try:
            send_buckets(group, plan.params, self.committed(plan.params), plan.bucket_bytes)
        finally:
            group.close()

    def _load_checkpoint(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(self.model_path).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        logger.info("keeper loaded the initial weights from %s (%d tensors)", self.model_path, len(tensors))
        return tensors
