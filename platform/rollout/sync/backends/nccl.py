"""The ``nccl`` backend, for GPU engines: vLLM's NCCL engine on the replicas, receiving
into the live parameters.

The receiving replicas run our ``DirectNcclWeightTransferEngine`` (nccl_worker): vLLM's
``NCCLWeightTransferEngine`` (packed, double-buffered), each bucket copied straight into
the parameters where a plan baked from ``load_weights`` allows (vLLM's layerwise reload
otherwise);
the trainer's side, built from vLLM's own trainer pieces, opens the NCCL endpoint as rank 0 with vLLM's ``nccl_common.trainer_init`` and
broadcasts with ``packed_nccl_broadcast_producer``, so both sides split the stream into
the same ``bucket_bytes`` chunks. Needs a CUDA device in the publishing process.

The communicator sits on the GPU that holds the tensors, not on the process's current
device: vLLM's ``trainer_init`` uses the current device, and a trainer that sees several
GPUs (its tensors on ``cuda:1``, its current device ``cuda:0`` where a replica runs)
otherwise fails on both sides with ``NCCL error: invalid usage``.

The communicator outlives its round while membership is unchanged (see
:class:`NcclSender`): the trainer keeps its end, and each replica skips the init of a
round that names the group its engine last joined (vLLM's engine would form a new
communicator there and leak the old one).

Unlike gloo, NCCL collectives carry no deadline of their own: the coordinator's round
deadline still ends the round for the publisher, but a rank stuck inside a collective is
only freed when its peer process exits.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from rollout.contracts import net
from rollout.contracts.backend import Sender, SyncBackend, TransferRound
from rollout.contracts.sync_protocol import Member
from rollout.sync.backends.cuda_device import sending_device

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

logger = logging.getLogger(__name__)

NCCL_BUFFERS = 2  # double buffering, vLLM's default for packed NCCL transfers


@dataclass(frozen=True)
class _Formed:
    """What identifies a communicator this sender formed: a round may reuse it only where
    all of it matches (the coordinator names the group; the rest guards against a plan
    that names it over another rendezvous, world or GPU)."""

    name: str  # the round's ``plan.group``
    master_address: str
    master_port: int
    world_size: int
    device: torch.device

    @classmethod
    def of(cls, plan: TransferRound, device: torch.device) -> "_Formed":
        t = plan.transfer
        return cls(plan.group, t.master_address, t.master_port, t.world_size, device)


class NcclSender(Sender):
    """Rank 0 of the rounds' NCCL communicator, kept across rounds.

    Forming a communicator (a TCP rendezvous, then NCCL's own bootstrap and buffers) took
    ~0.2 s of every 0.42 s publish of a 1.5B model on two H100s. The communicator this
    sender formed stays while the coordinator names it in the next round
    (``transfer.group_name``, offered as :attr:`group_name`): the last committed publish
    formed it and membership is unchanged, and each replica's engine still holds its end
    (the replicas then skip ``init_weight_transfer_engine``). Any other round replaces it;
    a failed send drops it. ``phases``: seconds per step of the last send (``rendezvous``
    is ~0 where the communicator was kept).
    """

    def __init__(self) -> None:
        super().__init__()
        self._group: Optional[Any] = None  # vLLM's PyNcclCommunicator
        self._formed: Optional[_Formed] = None

    @property
    def group_name(self) -> Optional[str]:
        return self._formed.name if self._group is not None and self._formed is not None else None

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        def broadcast(group: Any, device: torch.device) -> None:
            named = ((p.name, t) for p, t in zip(plan.params, tensors))
            packed_nccl_broadcast_producer(
                iterator=named,
                group=group,
                src=0,
                post_iter_func=lambda item: item[1].to(device, non_blocking=True),
                buffer_size_bytes=plan.bucket_bytes,
                num_buffers=NCCL_BUFFERS,
            )

        self._over_communicator(plan, sending_device(tensors, "nccl"), broadcast)

    def _over_communicator(self, plan: TransferRound, device: torch.device, broadcast: Callable[[Any, torch.device], None]) -> None:
        """Run ``broadcast(communicator, device)`` on the round's communicator (kept or
        formed), the sending GPU current; ``phases`` say where the time went."""
        self.phases = {}
        t0 = time.perf_counter()
        replaced = None
        try:
            # trainer_init and the producer's buffers use the current device: make it ours.
            with torch.cuda.device(device):
                group, replaced = self._communicator(plan, device)
                t1 = time.perf_counter()
                broadcast(group, device)
                t2 = time.perf_counter()
                torch.cuda.synchronize(device)
        except BaseException:
            # Peers may be gone or out of step: the next round forms a new communicator.
            # Dropped, not destroyed: with a peer gone, destroying waits on operations
            # that never complete (its NCCL buffers stay until the process exits).
            self._group = self._formed = None
            raise
        finally:
            # The one this round replaced ended its last send cleanly: release its NCCL
            # buffers rather than keep one set per membership change, off the publish's path.
            _release(replaced)
        self.phases = {"rendezvous": t1 - t0, "broadcast": t2 - t1, "drain": time.perf_counter() - t2}

    def _communicator(self, plan: TransferRound, device: torch.device) -> tuple[Any, Optional[Any]]:
        """The communicator ``plan`` goes over: the kept one where the plan names it, else
        a new one (with the one it replaces, to release once the send is done)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        formed = _Formed.of(plan, device)
        if self._group is not None and plan.transfer.group_name and formed == self._formed:
            logger.info("%s: NCCL communicator %s kept (no rendezvous)", plan.round_id, formed.name)
            return self._group, None
        replaced, self._group, self._formed = self._group, None, None
        # NCCL's bootstrap must announce the address the plan advertised (the one the
        # replicas proved they reach), not the interface NCCL would pick by itself.
        pinned = net.pin_nccl_interface(net.Choice(plan.transfer.master_address, "the address the publisher advertised"))
        if pinned:
            logger.info("NCCL's socket interface set to %s (%s=%s), the one holding %s", pinned.lstrip("="), net.NCCL_IFNAME_ENV, pinned, plan.transfer.master_address)
        t = plan.transfer
        try:
            group = trainer_init({"master_address": t.master_address, "master_port": t.master_port, "world_size": t.world_size})
        except BaseException:
            _release(replaced)  # it ended its last send cleanly: still safe to release
            raise
        self._group, self._formed = group, formed
        logger.info("%s: NCCL communicator %s formed (world size %d)", plan.round_id, formed.name, t.world_size)
        return group, replaced

    def close(self) -> None:
        """Release the kept communicator (its last send ended cleanly)."""
        group, self._group, self._formed = self._group, None, None
        if group is not None:
            group.destroy()


def _release(group: Optional[Any]) -> None:
    """Destroy ``group`` (a communicator whose last send completed) in the background."""
    if group is not None:
        threading.Thread(target=group.destroy, name="nccl-destroy", daemon=True).start()


class NcclBackend(SyncBackend):
    name = "nccl"
    sender_cls = NcclSender
    engine_keeps_group = True  # vLLM's engine (ours inherits it) holds its communicator until the next init
    # Replicas receive with vLLM's NCCL engine less its per-round layerwise reload: the
    # packed buckets copied straight into the live parameters where a plan baked from
    # load_weights allows, vLLM's own path otherwise (nccl_worker). Registered under a
    # name of its own: "nccl" in vLLM's factory is vLLM's engine.
    worker_engine = "rollout.sync.backends.nccl_worker:DirectNcclWeightTransferEngine"
    engine_name = "rollout-nccl-direct"

    def init_info(self, plan: TransferRound, member: Member) -> "NCCLWeightTransferInitInfo":
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

        # Packed, in the trainer's bucket size: both ends must split the stream alike.
        return NCCLWeightTransferInitInfo(**self.group_fields(plan, member), packed=True, packed_buffer_size_bytes=plan.bucket_bytes, packed_num_buffers=NCCL_BUFFERS)

    def prepare_engine_process(self) -> None:
        super().prepare_engine_process()
        # vLLM's NCCL engine would otherwise announce whichever interface NCCL picks, not
        # the node's address the trainer reaches this host by.
        net.pin_nccl_interface(net.choose())

    def engine_init_info(self, plan: TransferRound, member: Member) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.nccl_common import worker_init_payload

        # vLLM's own serialization: only the rendezvous mode in use (no unset unique id).
        return worker_init_payload(self.init_info(plan, member))
