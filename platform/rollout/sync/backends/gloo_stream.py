"""Pipelined bucket transfer over a :class:`GlooGroup`, in the packed wire format.

The sender packs bucket k+1 while bucket k is on the wire; a receiver keeps the next
buckets in flight while it loads one. A replica posts its first receives when it joins
the round, so they arrive while its engine pauses.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Optional, Sequence

import torch

from rollout.sync.backends.gloo_group import GlooGroup
from rollout.sync.wire import ParamSpec, bucket_bytes_of, bucket_sizes, pack, plan_buckets, unpack

IN_FLIGHT = 2  # buckets a receiver has posted ahead of the one it is loading


def send_buckets(group: GlooGroup, params: Sequence[ParamSpec], tensors: Sequence[torch.Tensor], bucket_bytes: int) -> None:
    in_flight = None
    for bucket in plan_buckets(params, bucket_bytes):
        packed = pack(tensors[i] for i in bucket)
        work = group.broadcast_async(packed)
        if in_flight is not None:
            in_flight[0].wait()
        in_flight = (work, packed)  # the buffer must outlive its broadcast
    if in_flight is not None:
        in_flight[0].wait()


class BucketReceiver:
    """Receives a round's buckets (of ``sizes`` bytes, in order) into fresh buffers,
    keeping ``IN_FLIGHT`` of them posted ahead; receiving starts at construction."""

    def __init__(self, group: GlooGroup, sizes: Sequence[int]):
        self.group = group
        self.sizes = list(sizes)
        self._posted: deque = deque()
        self._next = 0
        self._post()

    def _post(self) -> None:
        while len(self._posted) < IN_FLIGHT and self._next < len(self.sizes):
            buffer = torch.empty(self.sizes[self._next], dtype=torch.uint8)
            self._posted.append((buffer, self.group.broadcast_async(buffer)))
            self._next += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self._posted:
            buffer, work = self._posted.popleft()
            work.wait()
            self._post()
            yield buffer


def receive_buckets(
    group: GlooGroup, params: Sequence[ParamSpec], bucket_bytes: int, receiver: Optional[BucketReceiver] = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield each bucket's ``(name, tensor)`` views, in order; every bucket has a buffer
    of its own, so a consumer may keep the views. ``receiver``: one already started."""
    buckets = [[params[i] for i in b] for b in plan_buckets(params, bucket_bytes)]
    sizes = bucket_sizes(params, bucket_bytes)
    if receiver is None:
        receiver = BucketReceiver(group, sizes)
    elif receiver.sizes != sizes:
        raise ValueError(f"bucket_sizes: the receives posted at join ({receiver.sizes[:4]}...) do not match this update's buckets ({sizes[:4]}...)")
    for buffer, specs in zip(receiver, buckets):
        yield list(unpack(buffer, specs))
