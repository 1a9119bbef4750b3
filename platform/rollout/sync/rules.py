"""What a round may be: the members' rank layout and the parameters a publish may carry.
Shared by the coordinator's publish rounds and vLLM-route sessions."""

from __future__ import annotations

from rollout.contracts.sync_protocol import Member, ParamSpec
from rollout.errors import InvalidRequestError


def assign_ranks(replicas: dict[str, int]) -> tuple[tuple[Member, ...], int]:
    """Trainer is rank 0; each replica gets a contiguous block of its worker count."""
    members = []
    offset = 1
    for rid in sorted(replicas):
        members.append(Member(rid, offset, replicas[rid]))
        offset += replicas[rid]
    return tuple(members), offset


def check_spec(sent: list[ParamSpec], expected: list[ParamSpec]) -> None:
    """Reject a publish whose tensors cannot be loaded, naming the first problem."""
    want = {p.name: p for p in expected}
    got = {p.name: p for p in sent}
    unknown = [n for n in got if n not in want]
    if unknown:
        raise InvalidRequestError("named_tensors", f"{len(unknown)} unknown parameter names, e.g. {unknown[:3]}")
    missing = [n for n in want if n not in got]
    if missing:
        raise InvalidRequestError("named_tensors", f"{len(missing)} parameters missing, e.g. {missing[:3]}; publish the full model")
    for name, p in got.items():
        w = want[name]
        if p.shape != w.shape:
            raise InvalidRequestError(f"named_tensors[{name}]", f"shape {list(p.shape)} does not match the model's {list(w.shape)}")
        if p.dtype != w.dtype:
            raise InvalidRequestError(f"named_tensors[{name}]", f"dtype {p.dtype} does not match the model's {w.dtype}")
