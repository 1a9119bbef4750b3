"""What the delta backends' senders offer before a round opens (``gloo_delta``'s
:class:`GlooDelta`, ``sparse_nccl``'s :class:`SparseNcclDelta`), torch-free: the HTTP
ingress types an offer that comes over ``POST /v1/sync/rounds`` (rollout.sync.remote)
without loading the backends themselves.

Each is checked on its own when made (``InvalidRequestError`` naming the field), and
against the round's parameters by the coordinator before the round opens
(:meth:`~rollout.contracts.backend.TransferInfo.check_params`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rollout.contracts.backend import TransferInfo
from rollout.contracts.sync_protocol import ParamSpec
from rollout.errors import InvalidRequestError

DENSE = -1  # a delta backend's count for a tensor that travels whole (rollout.sync.delta)
INT32_MAX = 2**31 - 1  # vLLM's sparse engine indexes with int32


def _numel(p: ParamSpec) -> int:
    n = 1
    for d in p.shape:
        n *= d
    return n


def _check_counts(path: str, counts: Sequence[int], params: Sequence[ParamSpec]) -> None:
    """One count per parameter, none above the parameter's elements."""
    if len(counts) != len(params):
        raise InvalidRequestError(path, f"one count per parameter, in the round's order: {len(counts)} counts for {len(params)} parameters")
    for i, (c, p) in enumerate(zip(counts, params)):
        if c > _numel(p):
            raise InvalidRequestError(f"{path}[{i}]", f"{c} changed elements of {p.name}, which has {_numel(p)}")


@dataclass(frozen=True)
class GlooDelta(TransferInfo):
    """A ``gloo_delta`` delta round's description, as fields of the receiving engine's
    update info (``GlooDeltaUpdateInfo``). A full round offers nothing."""

    delta_base_version: int
    delta_base_digest: str  # rollout.sync.digest.combine of the base's per-tensor digests
    delta_counts: tuple[int, ...] = field(default=())  # per tensor, the round's order: -1 dense, 0 unchanged, k changed

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta_counts", tuple(self.delta_counts))
        if self.delta_base_version < 0:
            raise InvalidRequestError("transfer_info.delta_base_version", f"must be >= 0, got {self.delta_base_version}")
        bad = [c for c in self.delta_counts if not isinstance(c, int) or c < DENSE]
        if bad:
            raise InvalidRequestError("transfer_info.delta_counts", f"each is {DENSE} (dense), 0 (unchanged) or a count of changed elements; got {bad[0]!r}")

    def delta_base(self) -> Optional[int]:
        return self.delta_base_version

    def base_digest(self) -> Optional[str]:
        return self.delta_base_digest

    def check_params(self, params: Sequence[ParamSpec]) -> None:
        _check_counts("transfer_info.delta_counts", self.delta_counts, params)

    def update_fields(self) -> dict[str, Any]:
        return {"delta_base_version": self.delta_base_version, "delta_base_digest": self.delta_base_digest, "delta_counts": list(self.delta_counts)}


@dataclass(frozen=True)
class SparseNcclDelta(TransferInfo):
    """What a ``sparse_nccl`` round sends: per tensor (the round's order) -1 (whole, its
    values only), 0 (unchanged) or k (a patch of k int32 indices and values), as the
    ``num_updates_list`` of our engine's update info (vLLM's, with -1 allowed:
    ``sparse_nccl_worker``), and the version it applies onto (None: a full round, every
    tensor whole)."""

    num_updates_list: tuple[int, ...] = field(default=())
    base_version: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_updates_list", tuple(self.num_updates_list))
        if not self.num_updates_list:
            raise InvalidRequestError("transfer_info.num_updates_list", "one count per tensor, in the round's order; got none")
        for i, n in enumerate(self.num_updates_list):
            if not isinstance(n, int) or isinstance(n, bool) or n < DENSE or n > INT32_MAX:
                raise InvalidRequestError(f"transfer_info.num_updates_list[{i}]", f"{DENSE} (sent whole), 0 (unchanged) or the number of patched elements (at most {INT32_MAX}); got {n!r}")
        if self.base_version is not None and self.base_version < 0:
            raise InvalidRequestError("transfer_info.base_version", f"must be >= 0, got {self.base_version}")

    def delta_base(self) -> Optional[int]:
        return self.base_version

    def check_params(self, params: Sequence[ParamSpec]) -> None:
        _check_counts("transfer_info.num_updates_list", self.num_updates_list, params)
        if self.base_version is None:
            # No base to patch onto: every element must arrive (whole, or a patch of all of them).
            for i, (n, p) in enumerate(zip(self.num_updates_list, params)):
                if n not in (DENSE, _numel(p)):
                    raise InvalidRequestError(
                        f"transfer_info.num_updates_list[{i}]", f"{n} of {p.name}'s {_numel(p)} elements with no base_version: a round without a base sends every tensor whole ({DENSE})"
                    )

    def update_fields(self) -> dict[str, Any]:
        return {"num_updates_list": list(self.num_updates_list)}
