"""Trainer-side sender of the ``nccl`` backend, built from vLLM's own trainer pieces.

The receiving replicas run vLLM's ``NCCLWeightTransferEngine`` (packed, double-buffered);
this side opens the NCCL endpoint as rank 0 with vLLM's ``nccl_common.trainer_init`` and
broadcasts with ``packed_nccl_broadcast_producer``, so both sides split the stream into
the same ``bucket_bytes`` chunks. Needs a CUDA device in the publishing process.

Unlike gloo, NCCL collectives carry no deadline of their own: the coordinator's round
deadline still ends the round for the publisher, but a rank stuck inside a collective is
only freed when its peer process exits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rollout.sync.plan import NCCL_BUFFERS, RoundPlan


class NcclSender:
    # vLLM's NCCL engine forms a new communicator at every init: nothing to reuse.
    group_name = None

    def close(self) -> None:
        pass

    def offer(self, tensors: Sequence[torch.Tensor]) -> None:
        return None  # pushed by send()

    def send(self, plan: RoundPlan, tensors: Sequence[torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        if not torch.cuda.is_available():
            raise RuntimeError("backend: 'nccl' needs a CUDA device in the publishing process")
        group = trainer_init({"master_address": plan.master_address, "master_port": plan.master_port, "world_size": plan.world_size})
        device = torch.device("cuda", torch.cuda.current_device())
        named = ((p.name, t) for p, t in zip(plan.params, tensors))
        packed_nccl_broadcast_producer(
            iterator=named,
            group=group,
            src=0,
            post_iter_func=lambda item: item[1].to(device, non_blocking=True),
            buffer_size_bytes=plan.bucket_bytes,
            num_buffers=NCCL_BUFFERS,
        )
        torch.cuda.synchronize()
