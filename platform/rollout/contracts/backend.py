"""What every weight-sync backend provides, in the shape of vLLM's weight-transfer engines.

A backend is one file in :mod:`rollout.sync.backends` holding a :class:`SyncBackend` (what the
coordinator, the replicas and the publisher need to know about it), its trainer-side
:class:`Sender` (a :class:`CopySender` where the coordinator keeps a copy), and, for
backends whose replicas pull, its :class:`TransferInfo`. The receiving side is a vLLM
weight-transfer engine, vLLM's own or one registered through :mod:`rollout.sync.vllm_plugin`.

Typed on our side, dicts only at vLLM's boundary: :meth:`SyncBackend.init_info` returns
the receiving engine's own ``WeightTransferInitInfo`` subclass (vLLM's NCCL and IPC ones,
our ``GlooInitInfo``), and :meth:`SyncBackend.engine_init_info` turns it into the dict that
``init_weight_transfer_engine`` takes, as vLLM's trainer engines do.

Torch-free (the config and the ingress read backend names through
:mod:`rollout.contracts.backend_registry`, which types its backends with this module).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Optional, Sequence, Union

from rollout.contracts.net import PORTS_ENV, PortRange
from rollout.contracts.sync_protocol import Member, ParamSpec, PullRound, PushRound, SessionRound

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo

# The rounds whose bytes a backend moves over a transfer group (a reload moves none).
TransferRound = Union[PushRound, PullRound, SessionRound]


@dataclass(frozen=True)
class TransferInfo:
    """What a pull backend's sender offers before its round opens (see :meth:`Sender.offer`):
    a frozen dataclass per backend whose fields are fields of the receiving engine's update
    info. It travels in the round (``RoundRequest.transfer_info``, the plan's), pickled
    over Serve; over HTTP only the delta backends' (rollout.sync.remote's typed bodies),
    never ``ipc``'s handles."""

    def delta_base(self) -> Optional[int]:
        """The version a delta applies onto (every receiver must hold exactly it), or None
        where what is offered is no delta."""
        return None

    def base_digest(self) -> Optional[str]:
        """The combined digest (rollout.sync.digest.combine) of the weights a delta applies
        onto, where the backend digests them; None otherwise."""
        return None

    def check_params(self, params: Sequence[ParamSpec]) -> None:
        """``InvalidRequestError`` naming the field where the offer does not fit the round's
        parameters (the coordinator asks before the round opens)."""

    def offer_id(self) -> str:
        """The id under which a later offer may name this one instead of repeating it
        (:meth:`reference`); "" where the backend names none."""
        return ""

    def by_reference(self) -> bool:
        """This offer names an earlier one (:meth:`offer_id`) without repeating what it
        carried: the coordinator completes it from the last complete offer of that id."""
        return False

    def reference(self) -> Optional["TransferInfo"]:
        """This offer named by its id alone (what a receiver that already holds it needs),
        or None where it cannot be named so."""
        return None

    def update_fields(self) -> dict[str, Any]:
        """The fields it adds to vLLM's update info."""
        return asdict(self)

    @classmethod
    def parse(cls, value: Union["TransferInfo", dict, None]) -> "TransferInfo":
        """``value`` as this type (an instance, or its fields as a dict), or
        ``InvalidRequestError`` naming the field."""
        from rollout.errors import InvalidRequestError

        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("transfer_info", f"must be the {cls.__name__} the backend's sender offers; got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        extra = sorted(set(value) - names)
        if extra:
            raise InvalidRequestError(f"transfer_info.{extra[0]}", f"not a field of {cls.__name__} (fields: {', '.join(sorted(names))})")
        try:
            return cls(**value)
        except TypeError as e:
            missing = sorted(names - set(value))
            raise InvalidRequestError(f"transfer_info.{missing[0]}" if missing else "transfer_info", str(e)) from None


def delta_base_of(offered: Any) -> Optional[int]:
    """The version a round's offer applies onto where it is a delta (see
    :meth:`TransferInfo.delta_base`), else None."""
    return offered.delta_base() if isinstance(offered, TransferInfo) else None


@dataclass(frozen=True)
class SendChoice:
    """How a sender sent the last publish, and why (see :mod:`rollout.sync.delta`):
    ``mode`` "delta" (what changed since the committed weights) or "full"; the bytes it
    put on the wire for the replicas, the bytes of a full send, the bytes the delta came
    to where one was computed, and the rule's reasoning in words."""

    mode: str
    bytes_sent: int
    full_bytes: int
    delta_bytes: Optional[int] = None
    changed_elements: Optional[int] = None
    rule: str = ""


class CopyOffer(NamedTuple):
    """Where the coordinator's copy of the next round goes: the group of two (the
    publisher at its advertised address and ``port`` as rank 0, the copy as rank 1)."""

    group_name: str
    port: int


class Sender(ABC):
    """The trainer's end of a backend (rank 0 of the round)."""

    def __init__(self) -> None:
        # Seconds per step of the last send, where a transport reports them; the publisher
        # adds them to ``last_phases`` as ``send.<step>``. Empty where it does not.
        self.phases: dict[str, float] = {}
        # Per-tensor digests of the bytes the last send put on the wire (rollout.sync.digest),
        # for the coordinator to compare with what each replica received; None where the
        # backend computes none.
        self.sent_digests: Optional[dict[str, str]] = None
        # How the last send went (delta or full, its bytes), where the sender decides; the
        # publisher reports it as ``last_choice``. None where the sender always sends in full.
        self.choice: Optional[SendChoice] = None

    @property
    def group_name(self) -> Optional[str]:
        """The transfer group kept from the last round, if the transport can reuse it."""
        return None

    def prepare(self, named: Sequence[tuple[str, Any]], full_because: Optional[str] = None) -> None:
        """Before the round opens, with the tensors by name: a delta sender prices a delta
        against what it last committed (see :mod:`rollout.sync.delta`) unless
        ``full_because`` says why this send must be full; it sets :attr:`choice`."""

    def offer(self, tensors: Sequence[Any]) -> Optional[TransferInfo]:
        """Before the round opens: what replicas need to pull the weights themselves
        (it becomes the plan's ``transfer_info``), or None when :meth:`send` pushes them."""
        return None

    @abstractmethod
    def send(self, plan: TransferRound, tensors: Sequence[Any]) -> None:
        """Deliver ``tensors`` (in ``plan.params`` order) to every rank of the round."""

    def decided(self, version: Optional[int]) -> None:
        """The round this sender last sent was decided: committed as ``version``, or
        aborted (None). A delta sender's base follows what is committed."""

    def offer_unknown(self) -> None:
        """The coordinator does not hold the offer this sender named by reference (it
        restarted): the next :meth:`offer` repeats it in full."""

    # Whether :meth:`send` moves anything: a sender whose replicas pull (``ipc``) is done
    # once it offered, and the publisher then runs no send thread.
    pushes: ClassVar[bool] = True

    def close(self) -> None:
        """Release the transfer group."""


class CopySender(Sender):
    """The sender of a backend whose coordinator keeps a copy of the committed weights
    (catch-up and rollback without a checkpoint): after each commit it sends that copy
    too, off the round's critical path."""

    @abstractmethod
    def copy_offer(self, ports: Optional[PortRange] = None, setting: str = PORTS_ENV) -> CopyOffer:
        """Before the round opens: where the coordinator's copy of it goes, its rendezvous
        on a port of ``ports`` (the publisher's range, named by ``setting``) where set."""

    @abstractmethod
    def send_copy(self, plan: PushRound) -> None:
        """After ``plan`` committed: its weights to the coordinator's copy (``plan.copy``)."""

    @abstractmethod
    def drop_kept(self) -> None:
        """The round did not commit: forget what was kept for its copy."""


class SyncBackend(ABC):
    name: ClassVar[str]
    # The trainer-side end (made in the publishing process). A CopySender declares that
    # the coordinator keeps a copy of the committed weights, sent by the publisher after
    # each commit; without one, replicas catch up only from a checkpoint the publisher named.
    sender_cls: ClassVar[type[Sender]]
    # Derived from ``sender_cls``: whether the coordinator keeps that copy.
    keeps_copy: ClassVar[bool] = False
    # What the backend's sender offers for replicas to pull from (None: it pushes).
    transfer_info_cls: ClassVar[Optional[type[TransferInfo]]] = None
    # Environment the replicas' engine processes need (inherited by vLLM's workers).
    engine_env: ClassVar[dict[str, str]] = {}
    # Whether the transport ends a step whose peer is gone by itself (a timeout of its
    # own). Without one (NCCL), an engine call still running past the round's deadline
    # is a worker blocked for good, and the replica must be replaced.
    transport_has_deadline: ClassVar[bool] = False
    # Whether replicas connect to a rendezvous the sender hosts (probed before joining).
    has_rendezvous: ClassVar[bool] = True
    # Whether the receiving engine holds its end of the transfer group from one round to
    # the next, and forms a new one at every init (vLLM's NCCL engine: its communicator,
    # overwritten there without being destroyed). A replica then skips
    # ``init_weight_transfer_engine`` on a publish round that names the group its engine
    # last joined (see SyncAgent). False where the engine keeps its group inside init
    # itself (gloo's) or has none: every round inits.
    engine_keeps_group: ClassVar[bool] = False
    # Whether the receiving engine forms no group and its init info is the same every
    # round, its init only recording it (vLLM's IPC engine: ``packed``). A replica then inits
    # its engine once and skips the init on every later publish round while the engine
    # still holds it, i.e. after a publish round this replica served (any other round, a
    # failed one, a restore or a route session's, makes the next publish init again).
    init_once: ClassVar[bool] = False
    # Whether the receiving engine digests what it receives (rollout.sync.digest): the
    # agent then names where in the update info (``digest_path``) and reports the digests.
    digests_received: ClassVar[bool] = False
    # Weight-transfer engines of the backend's own, as "module:Class", registered in vLLM's
    # factories under ``name`` in every vLLM process (rollout.sync.vllm_plugin): the worker
    # side (what replicas receive with) and the trainer side (for trainers written for
    # ``vllm serve``). None where vLLM's own engine of that name serves.
    worker_engine: ClassVar[Optional[str]] = None
    trainer_engine: ClassVar[Optional[str]] = None
    # The name the worker engine is registered (and chosen, ``WeightTransferConfig(backend=)``)
    # under in vLLM, where it cannot be ``name`` because vLLM has an engine of that name
    # (ours for ``nccl`` receives into the live parameters; vLLM's "nccl" stays vLLM's).
    # None: ``name``. See :attr:`vllm_engine`.
    engine_name: ClassVar[Optional[str]] = None

    @property
    def vllm_engine(self) -> str:
        """The replicas' ``WeightTransferConfig.backend``: the worker engine's name in vLLM."""
        return self.engine_name or self.name

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "sender_cls" in cls.__dict__:
            cls.keeps_copy = issubclass(cls.sender_cls, CopySender)

    def make_sender(self) -> Sender:
        """The trainer-side end, made in the publishing process."""
        return self.sender_cls()

    def prepare_engine_process(self) -> None:
        """Ready the replica's process for the backend's receiving engine, before vLLM
        starts it (vLLM's engine processes inherit this process's environment)."""
        import os

        os.environ.update(self.engine_env)

    def make_copy(self, model_path: str) -> Optional[Any]:
        """The coordinator's copy of the committed weights for this backend (the store's
        backend-specific part), or None where it keeps none."""
        return None

    @abstractmethod
    def init_info(self, plan: TransferRound, member: Member) -> "WeightTransferInitInfo":
        """``init_weight_transfer_engine``'s init info for ``member`` in ``plan``: the
        receiving engine's own ``WeightTransferInitInfo`` subclass."""

    def engine_init_info(self, plan: TransferRound, member: Member) -> dict[str, Any]:
        """:meth:`init_info` as the dict vLLM's ``WeightTransferInitRequest`` carries."""
        return asdict(self.init_info(plan, member))

    def rendezvous(self, plan: TransferRound) -> Optional[tuple[str, int]]:
        """The ``(address, port)`` members connect to first, or None (no rendezvous)."""
        return (plan.transfer.master_address, plan.transfer.master_port) if self.has_rendezvous else None

    def update_info(self, params: Sequence[ParamSpec], offered: Union[TransferInfo, dict, None] = None) -> dict[str, Any]:
        """vLLM's ``update_weights`` info for ``params``: the same for every backend, plus
        what the publisher offered (pull backends)."""
        info: dict[str, Any] = dict(names=[p.name for p in params], dtype_names=[p.dtype for p in params], shapes=[list(p.shape) for p in params])
        typed = self.check_transfer_info(offered)
        return {**info, **typed.update_fields()} if typed is not None else info

    def check_transfer_info(self, transfer_info: Union[TransferInfo, dict, None]) -> Optional[TransferInfo]:
        """What a publisher offered, typed; ``InvalidRequestError`` naming the field before
        any round opens when it does not fit. Push backends take none."""
        from rollout.errors import InvalidRequestError

        if self.transfer_info_cls is None:
            if transfer_info is not None:
                raise InvalidRequestError("transfer_info", f"the {self.name!r} backend takes no transfer_info")
            return None
        return self.transfer_info_cls.parse(transfer_info)

    @staticmethod
    def group_fields(plan: TransferRound, member: Member) -> dict[str, Any]:
        """The fields every group-forming backend's init info starts from."""
        t = plan.transfer
        return dict(master_address=t.master_address, master_port=t.master_port, rank_offset=member.rank_offset, world_size=t.world_size)
