"""Receiving published weights straight into a model's live parameters: a copy plan
baked once from the model's own ``load_weights``.

vLLM's NCCL engine hands every received bucket to ``model.load_weights`` inside its
layerwise-reload lifecycle (each layer put on the meta device, materialized again and
copied back), which cost ~0.18 s of a 0.23 s publish of a 1.5B model on two H200s; the
broadcast itself took ~9 ms. For an unquantized model whose loaders only copy (dense
checkpoint tensors into the parameters, fused ``qkv_proj`` / ``gate_up_proj`` rows by
``narrow``), what ``load_weights`` does with a given list of names, dtypes and shapes is
the same every round: which slice of which received tensor lands in which slice of which
parameter. :func:`bake` learns that once by running ``load_weights`` on meta tensors
under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that records every
``copy_`` into a live tensor instead of running it (nothing live is ever written while
baking), and :meth:`DirectPlan.apply` replays one received bucket as one
``torch._foreach_copy_``.

Anything the plan cannot prove it reproduces makes the plan :class:`Ineligible` (with the
reason), and the caller receives the round vLLM's own way: a copy whose source is not a
received tensor (a loader that transforms values), any other write to a parameter or
buffer, a destination that is not a dense slice of one parameter, destinations that
partly overlap, a parameter left partly or wholly unwritten, or any exception.

Torch only (no vLLM import), so it is unit-tested on CPU with a toy model; the engine
that uses it is :mod:`rollout.sync.backends.nccl_worker`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# One received tensor as the round's update info announces it.
Spec = tuple[str, torch.dtype, tuple[int, ...]]
# What a plan is valid for: the round's names, dtypes and shapes, in order.
PlanKey = tuple[tuple[str, str, tuple[int, ...]], ...]


def plan_key(specs: Sequence[Spec]) -> PlanKey:
    return tuple((n, str(d).removeprefix("torch."), tuple(s)) for n, d, s in specs)


class Ineligible(Exception):
    """The plan cannot reproduce ``load_weights`` for these names; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SourceView:
    """A strided view of a received tensor (``shape``/``stride``/``offset`` relative to
    its first element), for a loader that narrows its input."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.shape, self.stride, t.storage_offset() + self.offset)


@dataclass(frozen=True)
class Copy:
    """One recorded ``copy_``: received tensor ``name`` (or ``src`` of it) into ``dst``, a
    dense view of live tensor ``holder``'s storage."""

    name: str
    holder: str
    dst: torch.Tensor
    src: Optional[SourceView]  # None: the whole received tensor
    start: int  # dst's element range in its storage: [start, start + numel)


@dataclass(frozen=True)
class Fill:
    """One recorded ``fill_`` of a live tensor with a constant (vocab padding rows)."""

    holder: str
    dst: torch.Tensor
    value: Any
    start: int


@dataclass(frozen=True)
class Holder:
    """What a live parameter (or buffer) was when the plan was baked."""

    data_ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class DirectPlan:
    key: PlanKey
    copies: dict[str, list[Copy]]
    fills: list[Fill]
    # Received names that load_weights writes nowhere (a tied alias such as
    # lm_head.weight, which vLLM's AutoWeightsLoader skips): received and dropped.
    dropped: tuple[str, ...]
    holders: dict[str, Holder] = field(default_factory=dict)

    def stale(self, model: torch.nn.Module) -> Optional[str]:
        """Why the plan no longer points at ``model``'s live tensors (a parameter
        re-allocated, re-typed or reshaped since the bake), or None."""
        live = dict(model.named_parameters(remove_duplicate=False))
        live.update(model.named_buffers(remove_duplicate=False))
        for name, h in self.holders.items():
            t = live.get(name)
            if t is None:
                return f"{name} is gone"
            if (t.data_ptr(), t.dtype, tuple(t.shape)) != (h.data_ptr, h.dtype, h.shape):
                return f"{name} moved or changed (data_ptr/dtype/shape)"
        return None

    def apply_fills(self) -> None:
        """The constant fills the loaders make (once per round; they overlap no copy)."""
        for f in self.fills:
            f.dst.fill_(f.value)

    def apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One received bucket into the live tensors: one ``_foreach_copy_`` (on the
        current stream, after whatever filled the bucket on it)."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for name, t in named:
            entries = self.copies.get(name)
            if entries is None:
                if name in self.dropped:
                    continue
                raise KeyError(f"received {name!r}, which the direct plan does not cover")
            for c in entries:
                dsts.append(c.dst)
                srcs.append(t if c.src is None else c.src.of(t))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    @property
    def num_copies(self) -> int:
        return sum(len(v) for v in self.copies.values())


class _Reject(Exception):
    pass


def _writes(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


class _Recorder(TorchDispatchMode):
    """Records ``copy_`` / ``fill_`` into live tensors instead of running them; any
    other write to a live tensor (or to a received meta tensor) rejects the bake."""

    def __init__(self, roots: dict[int, tuple[str, torch.Tensor]], live: dict[int, list[tuple[str, torch.Tensor]]]) -> None:
        super().__init__()
        self.roots = roots  # meta storage id -> (received name, the meta tensor)
        self.live = live  # live storage data_ptr -> [(holder name, tensor)]
        self.copies: list[Copy] = []
        self.fills: list[Fill] = []
        self.rejected: Optional[str] = None

    def _reject(self, reason: str) -> None:
        if self.rejected is None:
            self.rejected = reason
        raise _Reject(reason)

    def _is_live(self, t: torch.Tensor) -> bool:
        return t.device.type != "meta" and t.untyped_storage().data_ptr() in self.live

    def _holder(self, dst: torch.Tensor, what: str) -> tuple[str, torch.Tensor, int]:
        """The live tensor whose elements ``dst`` covers densely, and ``dst``'s start."""
        if not dst.is_contiguous():
            self._reject(f"{what}: a non-dense destination (shape {tuple(dst.shape)}, stride {dst.stride()})")
        start, end = dst.storage_offset(), dst.storage_offset() + dst.numel()
        for name, h in self.live[dst.untyped_storage().data_ptr()]:
            if h.dtype == dst.dtype and h.storage_offset() <= start and end <= h.storage_offset() + h.numel():
                return name, h, start
        self._reject(f"{what}: a destination that is not a slice of one parameter or buffer")
        raise AssertionError  # unreachable

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default and self._is_live(args[0]):
            self._record_copy(args[0], args[1])
            return args[0]
        if func is aten.fill_.Scalar and self._is_live(args[0]):
            dst = args[0]
            if dst.numel():
                name, h, start = self._holder(dst, "fill_")
                view = h.detach().as_strided(tuple(dst.shape), dst.stride(), start)
                self.fills.append(Fill(name, view, args[1], start))
            return dst
        for t in _writes(func, args, kwargs):
            if self._is_live(t):
                self._reject(f"{func} writes a live parameter or buffer (only copy_ and fill_ can be replayed)")
            if t.device.type == "meta" and t.untyped_storage()._cdata in self.roots:
                self._reject(f"{func} modifies a received tensor in place")
        return func(*args, **kwargs)

    def _record_copy(self, dst: torch.Tensor, src: Any) -> None:
        if not isinstance(src, torch.Tensor) or src.device.type != "meta":
            self._reject("copy_ from something other than a received tensor")
        root = self.roots.get(src.untyped_storage()._cdata)
        if root is None:
            self._reject("copy_ from a tensor computed from the received one (a loader that transforms values)")
        name, whole = root
        if tuple(dst.shape) != tuple(src.shape):
            self._reject(f"copy_ of {name} broadcasts ({tuple(src.shape)} into {tuple(dst.shape)})")
        holder, h, start = self._holder(dst, f"copy_ of {name}")
        if tuple(src.shape) == tuple(whole.shape) and src.stride() == whole.stride() and src.storage_offset() == 0:
            view = None
        else:
            view = SourceView(tuple(src.shape), tuple(src.stride()), src.storage_offset())
        dst_view = h.detach().as_strided(tuple(dst.shape), dst.stride(), start)
        self.copies.append(Copy(name, holder, dst_view, view, start))


@torch.no_grad()
def bake(model: torch.nn.Module, specs: Sequence[Spec], load_weights: Optional[Callable[[Iterable[tuple[str, torch.Tensor]]], Any]] = None) -> DirectPlan:
    """The copy plan of ``load_weights`` (default ``model.load_weights``) for ``specs``,
    or :class:`Ineligible`. Runs ``load_weights`` once on meta tensors; no live tensor
    is written."""
    load = load_weights or model.load_weights
    if len({n for n, _, _ in specs}) != len(specs):
        raise Ineligible("a name is received twice in one round")
    live: dict[int, list[tuple[str, torch.Tensor]]] = {}
    holders: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t.device.type == "meta":
            raise Ineligible(f"{name} is on the meta device (a layerwise reload is in progress)")
        live.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))
        holders[name] = t
    sources = [(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in specs]
    # Keyed by the meta storage's identity: views of a received tensor share it.
    roots = {t.untyped_storage()._cdata: (n, t) for n, t in sources}
    recorder = _Recorder(roots, live)
    try:
        with recorder:
            load(iter(sources))
    except Exception as e:
        raise Ineligible(recorder.rejected or f"load_weights raised {type(e).__name__}: {e}") from None
    if recorder.rejected:  # a loader caught our rejection
        raise Ineligible(recorder.rejected)
    copies = _without_overwritten(recorder.copies, recorder.fills)
    _check_covered(model, copies, recorder.fills)
    by_name: dict[str, list[Copy]] = {}
    for c in copies:
        by_name.setdefault(c.name, []).append(c)
    dropped = tuple(n for n, _, _ in specs if n not in by_name)
    used = {c.holder for c in copies} | {f.holder for f in recorder.fills}
    plan = DirectPlan(
        key=plan_key(specs),
        copies=by_name,
        fills=list(recorder.fills),
        dropped=dropped,
        holders={n: Holder(holders[n].data_ptr(), holders[n].dtype, tuple(holders[n].shape)) for n in sorted(used)},
    )
    if dropped:
        logger.info("direct plan: %d received name(s) load_weights writes nowhere, received and dropped: %s", len(dropped), ", ".join(dropped))
    return plan


def _without_overwritten(copies: list[Copy], fills: list[Fill]) -> list[Copy]:
    """``copies`` less those a later copy overwrites exactly (the same elements, as two
    names of one tied parameter would); any partial overlap is ineligible, since the
    replay's order within a bucket is not the loaders' order."""
    last: dict[tuple[int, int, int], int] = {}
    for i, c in enumerate(copies):
        last[(c.dst.untyped_storage().data_ptr(), c.start, c.dst.numel())] = i
    kept = [c for i, c in enumerate(copies) if last[(c.dst.untyped_storage().data_ptr(), c.start, c.dst.numel())] == i]
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for c in kept:
        spans.setdefault(c.dst.untyped_storage().data_ptr(), []).append((c.start, c.start + c.dst.numel(), c.name))
    for f in fills:
        spans.setdefault(f.dst.untyped_storage().data_ptr(), []).append((f.start, f.start + f.dst.numel(), f"fill of {f.holder}"))
    for ranges in spans.values():
        ranges.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(ranges, ranges[1:]):
            if b0 < a1:
                raise Ineligible(f"{an} and {bn} write overlapping elements")
    return kept


def _check_covered(model: torch.nn.Module, copies: list[Copy], fills: list[Fill]) -> None:
    """Every parameter's every element written by the plan (no overlaps, checked before)."""
    written: dict[int, list[tuple[int, int]]] = {}
    for start, t in [(c.start, c.dst) for c in copies] + [(f.start, f.dst) for f in fills]:
        written.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + t.numel()))
    for name, p in model.named_parameters():
        lo, hi = p.storage_offset(), p.storage_offset() + p.numel()
        covered = sum(max(0, min(e, hi) - max(s, lo)) for s, e in written.get(p.untyped_storage().data_ptr(), ()))
        if covered != p.numel():
            raise Ineligible(f"parameter {name}: {covered} of {p.numel()} elements written by load_weights for these names")
