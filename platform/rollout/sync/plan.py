"""Messages between publisher, coordinator and replicas for one sync round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rollout.sync.wire import ParamSpec

PauseMode = Literal["keep", "wait", "abort"]
NCCL_BUFFERS = 2  # double buffering, vLLM's default for packed NCCL transfers


@dataclass(frozen=True)
class Member:
    replica_id: str
    rank_offset: int
    ranks: int  # tensor * pipeline parallel workers of this replica


@dataclass(frozen=True)
class RoundPlan:
    """Everything a participant needs to join round ``round_id`` committing ``version``."""

    round_id: str
    version: int
    backend: str
    master_address: str
    master_port: int
    world_size: int
    members: tuple[Member, ...]
    params: tuple[ParamSpec, ...]
    bucket_bytes: int
    pause_mode: PauseMode
    timeout_s: float
    keeper_rank: Optional[int] = None  # the coordinator's copy receives as this rank
    restore: bool = False  # sent by the keeper to bring members to the committed version
    # The transfer group this round runs on: an earlier round's, kept by every
    # participant while membership is unchanged, or (empty) a new one named after this round.
    group_name: str = ""
    # What the publisher offered for the replicas to read the weights from, for
    # backends where replicas pull instead of receiving a broadcast: ``ipc`` carries
    # one CUDA IPC handle per parameter (``ipc_handles``, in ``params`` order).
    transfer_info: Optional[dict] = None
    # Restore rounds only: a directory of the committed weights (safetensors, on storage
    # every replica reads) that the member reloads with vLLM's ``reload_weights``
    # instead of receiving them from the keeper.
    checkpoint: Optional[str] = None

    @property
    def group(self) -> str:
        return self.group_name or self.round_id

    def member(self, replica_id: str) -> Member:
        for m in self.members:
            if m.replica_id == replica_id:
                return m
        raise KeyError(f"replica {replica_id} is not in round {self.round_id}")

    def init_info(self, replica_id: str) -> dict:
        """The worker-side init info for vLLM's ``init_weight_transfer_engine``, in the
        shape the round's backend expects (ours for gloo, vLLM's own for nccl)."""
        common = dict(
            master_address=self.master_address,
            master_port=self.master_port,
            rank_offset=self.member(replica_id).rank_offset,
            world_size=self.world_size,
        )
        if self.backend == "gloo":
            return {**common, "group_name": self.group, "timeout_s": self.timeout_s, "bucket_bytes": self.bucket_bytes}
        if self.backend == "nccl":
            return {**common, "packed": True, "packed_buffer_size_bytes": self.bucket_bytes, "packed_num_buffers": NCCL_BUFFERS}
        if self.backend == "ipc":
            # No rendezvous: every parameter has its own handle (zero-copy for the trainer).
            return {"packed": False}
        raise ValueError(f"backend: no init info for {self.backend!r}")

    def update_info(self) -> dict:
        return dict(
            names=[p.name for p in self.params],
            dtype_names=[p.dtype for p in self.params],
            shapes=[list(p.shape) for p in self.params],
            **(self.transfer_info or {}),
        )


def assign_ranks(replicas: dict[str, int]) -> tuple[tuple[Member, ...], int]:
    """Trainer is rank 0; each replica gets a contiguous block of its worker count."""
    members = []
    offset = 1
    for rid in sorted(replicas):
        members.append(Member(rid, offset, replicas[rid]))
        offset += replicas[rid]
    return tuple(members), offset


@dataclass
class RoundOutcome:
    round_id: str
    committed: bool
    version: int
    error: str = ""
    failed_replicas: list[str] = field(default_factory=list)
    # replica -> seconds per step of the round (pause, join, receive, ...), as each reports
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
