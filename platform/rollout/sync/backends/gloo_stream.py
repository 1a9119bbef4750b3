"""Pipelined bucket transfer over a :class:`GlooGroup`, in the packed wire format.

The sender packs bucket k+1 while bucket k is on the wire; a receiver keeps the next
buckets in flight while it loads one.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterator, Optional, Sequence

import torch

from rollout.contracts.sync_protocol import ParamSpec
from rollout.sync import digest
from rollout.sync.backends.gloo_group import GlooGroup
from rollout.sync.wire import bucket_bytes_of, pack, plan_buckets, unpack

IN_FLIGHT = 2  # buckets a receiver has posted ahead of the one it is loading


class SentDigests:
    """The per-tensor digests of what :func:`send_buckets` put on the wire (see
    :mod:`rollout.sync.digest`), and the seconds spent hashing."""

    def __init__(self) -> None:
        self.digests: digest.TensorDigests = {}
        self.seconds = 0.0

    def add(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        # The tensors a bucket was packed from (its bytes, copied), digested where they live
        # while gloo's thread broadcasts the bucket: a GPU trainer's on its GPU (one pass at
        # device speed, not a second pass over host memory), a CPU trainer's by numpy, which
        # releases the GIL.
        t0 = time.perf_counter()
        digest.digest_all(named, into=self.digests)
        self.seconds += time.perf_counter() - t0


def send_buckets(
    group: GlooGroup,
    params: Sequence[ParamSpec],
    tensors: Sequence[torch.Tensor],
    bucket_bytes: int,
    keep: Optional[list[torch.Tensor]] = None,
    *,
    digests: Optional[SentDigests] = None,
) -> None:
    """Broadcast ``tensors`` in packed buckets; ``keep``, when given, receives every packed
    bucket (a copy of the weights that later changes to ``tensors`` do not touch);
    ``digests``, when given, each tensor's digest of the bytes sent."""
    plan = plan_buckets(params, bucket_bytes)
    on_sent = (lambda k, packed: digests.add([(params[i].name, tensors[i]) for i in plan[k]])) if digests is not None else None
    _broadcast_pipelined(group, (pack(tensors[i] for i in bucket) for bucket in plan), keep, on_sent)


def send_packed(group: GlooGroup, buffers: Sequence[torch.Tensor]) -> None:
    """Broadcast buckets :func:`send_buckets` kept, in the same wire format."""
    _broadcast_pipelined(group, iter(buffers), None)


def _broadcast_pipelined(group: GlooGroup, buffers: Iterator[torch.Tensor], keep: Optional[list[torch.Tensor]], on_sent=None) -> None:
    in_flight = None
    for k, packed in enumerate(buffers):  # the next bucket is packed while the last one is on the wire
        work = group.broadcast_async(packed)
        if keep is not None:
            keep.append(packed)
        if on_sent is not None:
            on_sent(k, packed)  # while this bucket is on the wire
        if in_flight is not None:
            in_flight[0].wait()
        in_flight = (work, packed)  # the buffer must outlive its broadcast
    if in_flight is not None:
        in_flight[0].wait()


def receive_buckets(
    group: GlooGroup, params: Sequence[ParamSpec], bucket_bytes: int, device: Optional[torch.device] = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield each bucket's ``(name, tensor)`` views, in order, with the next ``IN_FLIGHT``
    buckets posted meanwhile. Every bucket has a buffer of its own, so a consumer may
    keep the views. With an accelerator ``device``, each bucket is copied there whole
    before it is unpacked (gloo receives into host memory): one copy per bucket, which
    the consumer's load would otherwise make tensor by tensor, and what it then reads
    (a digest, the load) runs at the device's speed."""
    buckets = [[params[i] for i in b] for b in plan_buckets(params, bucket_bytes)]

    def post(specs: list[ParamSpec]):
        buffer = torch.empty(bucket_bytes_of(specs), dtype=torch.uint8)
        return buffer, group.broadcast_async(buffer)

    posted = deque(post(specs) for specs in buckets[:IN_FLIGHT])
    for k, specs in enumerate(buckets):
        buffer, work = posted.popleft()
        work.wait()
        if k + IN_FLIGHT < len(buckets):
            posted.append(post(buckets[k + IN_FLIGHT]))
        if device is not None and device.type != "cpu":
            buffer = buffer.to(device)
        yield list(unpack(buffer, specs))
