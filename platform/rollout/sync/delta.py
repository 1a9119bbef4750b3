"""Deltas: what changed since the committed weights, and whether sending it beats a full send.

A delta backend's sender (``gloo_delta``, ``sparse_nccl``) keeps the weights it last
committed (its *base*: the version, the tensors, their digests). Before the next round
opens it compares every tensor with the base, bit for bit (an element is changed when its
bytes differ: ``-0.0`` against ``0.0`` counts, a NaN that stayed NaN does not), and
:func:`choose` prices each tensor both ways:

* sparse: ``changed elements x (index bytes + element bytes)`` (nothing where none changed);
* dense: the tensor's bytes.

Each tensor goes the cheaper way; a tensor that cannot go sparse goes dense (vLLM's
sparse loader marks unchanged elements with NaN, so it takes only floating tensors whose
new values hold no NaN). The publish is a *delta* when the sum of those choices is below
the full send's bytes, else it is a full send. The :class:`SendChoice` says which, with
the bytes of both, and the publisher reports it (``WeightPublisher.last_choice``).

A delta applies only onto exactly its base: it names the base's version and its combined
digest (:func:`rollout.sync.digest.combine` of the publisher's per-tensor digests), the
coordinator refuses one whose base is not the committed version, and every receiver
refuses one whose base it does not hold (:class:`~rollout.contracts.sync_protocol.DeltaBaseError`).

Per-tensor counts (:data:`DENSE`, 0 = unchanged, k = k changed elements) describe a delta
on the wire: both ends derive from them the same list of pieces (:func:`wire_specs`), so
the packed buckets carry nothing but bytes, as a full round's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from rollout.contracts.backend import SendChoice
from rollout.contracts.sync_protocol import DeltaBaseError, ParamSpec
from rollout.sync.backends.delta_info import DENSE  # a tensor's count when it travels whole

INDEX_SUFFIX = "#indices"
VALUES_SUFFIX = "#values"

# The integer dtype of each element size: elements compare bit for bit through it.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorDelta:
    """One tensor of a delta: the flat indices (int64, ascending) of the elements that
    changed and their new values, or ``dense`` (the whole new tensor travels)."""

    name: str
    count: int  # DENSE, or the number of changed elements
    indices: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Delta:
    choice: SendChoice
    tensors: tuple[TensorDelta, ...]  # in the publish's order, one per tensor

    @property
    def counts(self) -> list[int]:
        return [t.count for t in self.tensors]


def changed_indices(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64, ascending) of the elements whose bytes differ."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(f"the base is {base.dtype} {tuple(base.shape)}, the new tensor {new.dtype} {tuple(new.shape)}: not the same tensor")
    bits = _BITS[new.element_size()]
    a = base.detach().reshape(-1).contiguous().view(bits)
    b = new.detach().reshape(-1).to(a.device).contiguous().view(bits)
    return torch.nonzero(a != b).reshape(-1)


def _sparse_ok(new: torch.Tensor, values: torch.Tensor) -> bool:
    return new.is_floating_point() and not bool(torch.isnan(values).any())


def compute(base: Mapping[str, torch.Tensor], new: Sequence[tuple[str, torch.Tensor]], index_bytes: int) -> Delta:
    """The delta from ``base`` to ``new`` (the publish's order), each tensor priced both
    ways (``index_bytes`` per sparse index on the wire: 8 for int64, 4 for vLLM's int32)."""
    tensors, full, sent, changed = [], 0, 0, 0
    sparse = dense = unchanged = 0
    for name, t in new:
        if name not in base:
            raise DeltaBaseError(f"{name!r} is not in the delta's base")
        nbytes = t.numel() * t.element_size()
        full += nbytes
        idx = changed_indices(base[name], t)
        k = idx.numel()
        changed += k
        if k == 0:
            unchanged += 1
            tensors.append(TensorDelta(name, 0, idx, t.reshape(-1)[:0]))
            continue
        values = t.detach().reshape(-1)[idx.to(t.device)]
        if _sparse_ok(t, values) and k * (index_bytes + t.element_size()) < nbytes:
            sparse += 1
            sent += k * (index_bytes + t.element_size())
            tensors.append(TensorDelta(name, k, idx, values))
        else:
            dense += 1
            sent += nbytes
            tensors.append(TensorDelta(name, DENSE))
    mode = "delta" if sent < full else "full"
    rule = (
        f"{sparse} sparse, {dense} dense, {unchanged} unchanged of {len(tensors)} tensors: "
        f"{sent} bytes as a delta {'<' if mode == 'delta' else '>='} {full} bytes in full"
    )
    choice = SendChoice(mode=mode, bytes_sent=sent if mode == "delta" else full, full_bytes=full, delta_bytes=sent, changed_elements=changed, rule=rule)
    return Delta(choice, tuple(tensors))


def full_choice(new: Sequence[tuple[str, torch.Tensor]], why: str) -> SendChoice:
    full = sum(t.numel() * t.element_size() for _, t in new)
    return SendChoice(mode="full", bytes_sent=full, full_bytes=full, delta_bytes=None, changed_elements=None, rule=why)


def wire_specs(params: Sequence[ParamSpec], counts: Sequence[int]) -> list[ParamSpec]:
    """The pieces a delta puts on the wire, in order: every sparse tensor's indices (int64)
    first, so each starts 8-byte aligned in its bucket (a bucket is viewed, not copied),
    then in the tensors' order a sparse tensor's values or a dense tensor whole; nothing
    of an unchanged one."""
    if len(counts) != len(params):
        raise ValueError(f"a delta has one count per tensor: {len(counts)} counts for {len(params)} tensors")
    indices: list[ParamSpec] = []
    rest: list[ParamSpec] = []
    for p, c in zip(params, counts):
        if c == DENSE:
            rest.append(p)
        elif c > 0:
            indices.append(ParamSpec(p.name + INDEX_SUFFIX, "int64", (c,)))
            rest.append(ParamSpec(p.name + VALUES_SUFFIX, p.dtype, (c,)))
        elif c != 0:
            raise ValueError(f"{p.name}: a delta count is {DENSE} (dense), 0 (unchanged) or the number of changed elements, not {c}")
    return indices + rest


def wire_tensors(delta: Delta, new: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of :func:`wire_specs`, in the same order."""
    indices: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for d, t in zip(delta.tensors, new):
        if d.count == DENSE:
            rest.append(t)
        elif d.count > 0:
            indices.append(d.indices)
            rest.append(d.values)
    return indices + rest


@dataclass(frozen=True)
class Piece:
    """One tensor of a received delta: ``dense`` (the whole tensor) or a sparse patch."""

    name: str
    dense: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None


def pieces(params: Sequence[ParamSpec], counts: Sequence[int], received: Mapping[str, torch.Tensor]) -> list[Piece]:
    """What :func:`wire_specs` named, received (``{wire name: tensor}``), regrouped per
    tensor; unchanged tensors are left out."""
    out = []
    for p, c in zip(params, counts):
        if c == DENSE:
            out.append(Piece(p.name, dense=received[p.name]))
        elif c > 0:
            out.append(Piece(p.name, indices=received[p.name + INDEX_SUFFIX], values=received[p.name + VALUES_SUFFIX]))
    return out


def patched(base: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The full new tensor: ``piece`` applied to ``base`` (which is left as it was)."""
    if piece.dense is not None:
        return piece.dense
    out = base.clone()
    out.reshape(-1).index_copy_(0, piece.indices.to(torch.long), piece.values.to(out.dtype))
    return out


def apply(base: Mapping[str, torch.Tensor], params: Sequence[ParamSpec], counts: Sequence[int], received: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full new weights: ``base`` with every piece applied (unchanged tensors shared
    with ``base``, changed ones new tensors)."""
    out = dict(base)
    for piece in pieces(params, counts, received):
        if piece.name not in base:
            raise DeltaBaseError(f"{piece.name!r} is not in the base this delta applies to")
        out[piece.name] = patched(base[piece.name], piece)
    return out
