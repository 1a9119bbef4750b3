"""The ``nccl`` backend, for GPU engines: vLLM's own NCCL engine on the replicas.

The receiving replicas run vLLM's ``NCCLWeightTransferEngine`` (packed, double-buffered);
the trainer's side, built from vLLM's own trainer pieces, opens the NCCL endpoint as rank 0 with vLLM's ``nccl_common.trainer_init`` and
broadcasts with ``packed_nccl_broadcast_producer``, so both sides split the stream into
the same ``bucket_bytes`` chunks. Needs a CUDA device in the publishing process.

The communicator sits on the GPU that holds the tensors, not on the process's current
device: vLLM's ``trainer_init`` uses the current device, and a trainer that sees several
GPUs (its tensors on ``cuda:1``, its current device ``cuda:0`` where a replica runs)
otherwise fails on both sides with ``NCCL error: invalid usage``.

Unlike gloo, NCCL collectives carry no deadline of their own: the coordinator's round
deadline still ends the round for the publisher, but a rank stuck inside a collective is
only freed when its peer process exits.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from rollout.sync import net
from rollout.sync.backends.base import Sender, SyncBackend, TransferRound
from rollout.sync.backends.cuda_device import sending_device
from rollout.sync.protocol import Member

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

logger = logging.getLogger(__name__)

NCCL_BUFFERS = 2  # double buffering, vLLM's default for packed NCCL transfers


class NcclSender(Sender):
    # vLLM's NCCL engine forms a new communicator at every init: nothing to reuse
    # (group_name stays None). ``phases``: seconds per step of the last send. On two
    # H100s the send ended 0.5 s after the replica had received everything, in every
    # round; these say where that goes.

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        self.phases = {}
        device = sending_device(tensors, "nccl")
        # NCCL's bootstrap must announce the address the plan advertised (the one the
        # replicas proved they reach), not the interface NCCL would pick by itself.
        pinned = net.pin_nccl_interface(net.Choice(plan.transfer.master_address, "the address the publisher advertised"))
        if pinned:
            logger.info("NCCL's socket interface set to %s (%s=%s), the one holding %s", pinned.lstrip("="), net.NCCL_IFNAME_ENV, pinned, plan.transfer.master_address)
        t0 = time.perf_counter()
        # trainer_init and the producer's buffers use the current device: make it ours.
        with torch.cuda.device(device):
            t = plan.transfer
            group = trainer_init({"master_address": t.master_address, "master_port": t.master_port, "world_size": t.world_size})
            t1 = time.perf_counter()
            named = ((p.name, t) for p, t in zip(plan.params, tensors))
            packed_nccl_broadcast_producer(
                iterator=named,
                group=group,
                src=0,
                post_iter_func=lambda item: item[1].to(device, non_blocking=True),
                buffer_size_bytes=plan.bucket_bytes,
                num_buffers=NCCL_BUFFERS,
            )
            t2 = time.perf_counter()
            torch.cuda.synchronize(device)
        t3 = time.perf_counter()
        # A communicator per round (the replicas form a new one at every init): release its
        # NCCL buffers rather than keep one set per publish, off the publish's path. Only
        # after a clean send: with a peer gone, destroying waits on operations that never
        # complete.
        threading.Thread(target=group.destroy, name="nccl-destroy", daemon=True).start()
        self.phases = {"rendezvous": t1 - t0, "broadcast": t2 - t1, "drain": t3 - t2, "release": time.perf_counter() - t3}


class NcclBackend(SyncBackend):
    name = "nccl"
    sender_cls = NcclSender

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
