"""The packed, bucketed wire format shared by every CPU-side sender and receiver.

Parameters travel in spec order, packed back to back into byte buckets of at most
``bucket_bytes`` (a parameter larger than a bucket travels alone). Both sides derive
the same plan from the same spec, so nothing but raw bytes crosses the wire, and a
round costs one collective per bucket instead of one RPC per tensor.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

from rollout.contracts.sync_protocol import ParamSpec


def plan_buckets(specs: Sequence[ParamSpec], bucket_bytes: int) -> list[list[int]]:
    """Indexes of ``specs`` per bucket, in order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, s in enumerate(specs):
        if current and size + s.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += s.nbytes
    if current:
        buckets.append(current)
    return buckets


def pack(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One bucket's bytes, in host memory (packed where the tensors live, so a GPU
    trainer copies one bucket to the host at a time)."""
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]).cpu()


def unpack(buffer: torch.Tensor, specs: Sequence[ParamSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for s in specs:
        n = s.nbytes
        yield s.name, buffer[offset : offset + n].view(s.torch_dtype).view(s.shape)
        offset += n


def bucket_bytes_of(specs: Sequence[ParamSpec]) -> int:
    return sum(s.nbytes for s in specs)

