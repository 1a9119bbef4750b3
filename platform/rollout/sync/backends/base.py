"""What every weight-sync backend provides, in the shape of vLLM's weight-transfer engines.

A backend is one file in this package holding a :class:`SyncBackend` (what the
coordinator, the replicas and the publisher need to know about it) and its trainer-side
:class:`Sender`. The receiving side is a vLLM weight-transfer engine, vLLM's own or one
registered through :mod:`rollout.sync.vllm_plugin`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional, Protocol, Sequence

from rollout.sync.protocol import Member, RoundPlan


class Sender(Protocol):
    """The trainer's end of a backend (rank 0 of the round)."""

    def offer(self, tensors: Sequence[Any]) -> Optional[dict]:
        """Before the round opens: what replicas need to pull the weights themselves
        (it becomes the plan's ``transfer_info``), or None when :meth:`send` pushes them."""

    @property
    def group_name(self) -> Optional[str]:
        """The transfer group kept from the last round, if the transport can reuse it."""

    def send(self, plan: RoundPlan, tensors: Sequence[Any]) -> None:
        """Deliver ``tensors`` (in ``plan.params`` order) to every rank of the round."""

    def close(self) -> None:
        """Release the transfer group."""

    # Backends that keep a copy (``SyncBackend.keeps_copy``) also have ``copy_offer(ports, setting)``
    # (where the coordinator's copy goes: a group name and a port of ``ports``, when set), ``send_copy(plan)``
    # (after the commit, the round's weights to that copy) and ``drop_kept()``.
    #
    # Optional: ``phases``, seconds per step of the last send, where a transport reports
    # them; the publisher adds them to ``last_phases`` as ``send.<step>``.


class SyncBackend(ABC):
    name: ClassVar[str]
    # Whether the coordinator keeps a copy of the committed weights (the keeper, on the
    # coordinator's CPU), sent by the publisher after each commit. Without it, replicas
    # can catch up only from a checkpoint the publisher named.
    keeps_copy: ClassVar[bool] = False
    # Environment the replicas' engine processes need (inherited by vLLM's workers).
    engine_env: ClassVar[dict[str, str]] = {}
    # Whether the transport ends a step whose peer is gone by itself (a timeout of its
    # own). Without one (NCCL), an engine call still running past the round's deadline
    # is a worker blocked for good, and the replica must be replaced.
    transport_has_deadline: ClassVar[bool] = False

    @abstractmethod
    def make_sender(self) -> Sender:
        """The trainer-side end, made in the publishing process."""

    @abstractmethod
    def init_info(self, plan: RoundPlan, member: Member) -> dict:
        """``init_weight_transfer_engine``'s init info for ``member`` in ``plan``, in the
        shape the receiving vLLM engine expects."""

    def check_transfer_info(self, transfer_info: Optional[dict]) -> None:
        """Reject what a publisher offered, naming the field, before any round opens.
        Push backends take none."""
        from rollout.errors import InvalidRequestError

        if transfer_info is not None:
            raise InvalidRequestError("transfer_info", f"the {self.name!r} backend takes no transfer_info")

    @staticmethod
    def group_fields(plan: RoundPlan, member: Member) -> dict:
        """The fields every group-forming backend's init info starts from."""
        return dict(master_address=plan.master_address, master_port=plan.master_port, rank_offset=member.rank_offset, world_size=plan.world_size)
