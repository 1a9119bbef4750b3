"""The sync messages between publisher, coordinator and replicas, and nothing else.

Imported by the coordinator, its clients (handle and HTTP), the ingress and the replicas'
agent alike. Torch-free: the ingress and the config import it without loading torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from rollout.errors import RolloutError

COORDINATOR_NAME = "WeightSyncCoordinator"  # the coordinator's Serve deployment
SYNC_TOKEN_ENV = "ROLLOUT_SYNC_TOKEN"  # where publishers and the coordinator find the sync token
DEFAULT_BUCKET_BYTES = 32 << 20  # bytes per packed bucket (sync.bucket_bytes)

PauseMode = Literal["keep", "wait", "abort"]
# When a publish returns (WeightPublisher.publish(wait=)): "serving", once every member
# serves the version (its label set, generation resumed); "committed", at the decision:
# every member received it and the round committed, but a member may still be labelling and
# resuming (requests that need the version wait for it, as for any version in flight).
PublishWait = Literal["serving", "committed"]
# What vLLM's sleep mode puts to sleep (``vllm.v1.executor.abstract.SLEEP_TAGS``), as its
# ``/wake_up?tags=`` names them: a trainer may wake the weights first (to publish into them)
# and the KV cache last.
SleepTag = Literal["weights", "kv_cache"]
SLEEP_TAGS: tuple[SleepTag, ...] = ("kv_cache", "weights")  # sorted: a Control compares them as a tuple

# Bytes per element of the dtypes a checkpoint may hold (torch's names, no "torch." prefix).
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class SyncError(RolloutError):
    """A sync round failed; every replica keeps serving the last committed version."""


class NoCommittedCopyError(SyncError):
    """Nothing holds the committed weights for a restore (the backend keeps no copy, or the
    coordinator restarted since the last publish); the next publish brings them."""


class PublisherUnreachableError(SyncError):
    """The replicas could not reach the address the publisher advertised for the round's
    transfer group, so nothing was sent and every replica keeps the committed version.
    ``address`` and ``port`` are what was advertised; the message says how that address
    was chosen and names the setting that changes it (``ROLLOUT_PUBLISHER_ADDRESS``)."""

    def __init__(self, message: str, address: str, port: int):
        self.address = address
        self.port = port
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.address, self.port))


class CoordinatorUnreachableError(SyncError):
    """The publisher could not reach the coordinator within a call's bound (its link, the
    ingress or the coordinator went away). Raised mid-round, the round is decided without
    this publisher: it aborts at its deadline (every replica keeps the committed version)
    unless the publisher's finish reached the coordinator; ``status()`` tells once it
    answers again."""


class DeltaBaseError(SyncError):
    """A delta names a base its receiver does not hold (another version, or bytes whose
    digest differs): it is refused before anything loads, never applied onto the wrong
    base (rollout.sync.delta). The publisher then sends in full."""


class OfferUnknownError(SyncError):
    """A publisher named an earlier offer by its id (an ``ipc`` export it offered before)
    that the coordinator does not hold (it restarted, or another export came since):
    refused before any round opens; the publisher offers in full instead."""


class FleetAsleepError(SyncError):
    """Refused because the replicas sleep (``/sleep``): a round cannot load weights that are
    offloaded or discarded. ``state`` names the sleep (its level and the tags still asleep);
    ``/wake_up`` (at least ``tags=weights``) first."""

    def __init__(self, message: str, state: str = ""):
        self.state = state
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.state))


class SleepUnavailableError(SyncError):
    """Sleep mode is off on this platform: ``model.enable_sleep_mode`` is false, or the
    replicas run where vLLM has no sleep mode (its CPU platform); the message says which."""


class NotRegisteredError(SyncError):
    """The coordinator does not know the replica (it restarted): register, then ask again."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        if self.dtype in _DTYPE_BYTES:
            return n * _DTYPE_BYTES[self.dtype]
        import torch

        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    @classmethod
    def of(cls, name: str, t) -> "ParamSpec":
        return cls(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))


@dataclass(frozen=True)
class RoundRequest:
    """What a publisher asks for when it opens a publish round."""

    params: tuple[ParamSpec, ...]  # the publisher's order: its tensors (and handles) follow it
    master_address: str  # where the publisher listens for the transfer group's rendezvous
    master_port: int
    version: Optional[int] = None  # default: the committed version + 1
    # The transfer group the publisher still holds from its last round: reused when it is
    # the last committed round's and membership is unchanged.
    reuse_group: Optional[str] = None
    # What replicas pull from, for backends where they pull (``ipc``: one CUDA IPC handle
    # per parameter, in ``params`` order); checked by the backend.
    transfer_info: Optional[Any] = None
    # A directory every replica reads holding the same weights: once committed, replicas
    # that start later or roll back reload it.
    checkpoint: Optional[str] = None
    # Backends whose coordinator keeps a copy: the group of two (this publisher at
    # ``master_address:copy_port`` as rank 0, the coordinator's copy as rank 1), formed for
    # that copy alone, over which the publisher sends it once the round commits, off the
    # round's critical path. Empty: the copy receives in the round.
    copy_group: str = ""
    copy_port: int = 0
    # ``params`` named by their digest (:func:`params_digest`) with ``params`` empty: those of
    # the last publish the coordinator accepted with that digest. Only beside an offer named
    # by id (TransferInfo.by_reference: ``ipc``, inside the cluster), as the handles are.
    params_digest: str = ""


def params_digest(params) -> str:
    """A round's parameters (names, dtypes, shapes, in their order) as one sha256: what a
    message names them by for a receiver that holds them (issue 41)."""
    import hashlib

    return hashlib.sha256("\n".join(f"{p.name}\t{p.dtype}\t{','.join(map(str, p.shape))}" for p in params).encode()).hexdigest()


@dataclass(frozen=True)
class StorageRequest:
    """What a publisher asks for when the weights are a checkpoint on shared storage
    (written by :func:`rollout.sync.storage.write_checkpoint`, its manifest last): every
    replica verifies the directory against its manifest, then reloads it."""

    checkpoint: str  # absolute path every replica reads
    # The sha256 of the manifest the publisher verified (rollout.sync.storage.manifest_id):
    # replicas load that write of the directory and no other.
    manifest: str
    params: tuple[ParamSpec, ...]  # what its shards hold: checked against the served model
    version: Optional[int] = None  # default: the committed version + 1


@dataclass(frozen=True)
class Adapter:
    """One version of a LoRA adapter, as a trainer published it: PEFT's two files, the
    config (``adapter_config.json``) and the tensors (``adapter_model.safetensors``, the
    file's bytes). Adapters are a few MB: the bytes travel through the coordinator, which
    keeps every committed one for the replicas that start later."""

    name: str  # what requests name (token API ``adapter``, OpenAI ``model``)
    version: int  # this adapter's own version: 1, 2, ... (the base weights keep theirs)
    config: dict
    tensors: bytes
    digest: str  # sha256 of ``tensors``: each replica checks what it wrote against it

    def __repr__(self) -> str:  # never the bytes in a log line
        return f"Adapter({self.name!r}, version={self.version}, {len(self.tensors)} bytes, sha256 {self.digest[:12]})"


@dataclass(frozen=True)
class HeldAdapter:
    """One version of a LoRA adapter named without its bytes: what a replica reports at
    registration (so a restarted coordinator learns its adapters back, as it learns the base
    version), and what a coordinator tells a replica it cannot load from it."""

    name: str
    version: int
    # False: an unload removed the adapter at ``version`` and no version of it is served
    # (a later publish of the name must still continue after it: see CommittedWeights).
    served: bool = True


@dataclass(frozen=True)
class CommittedAdapters:
    """The committed adapters, as a replica catching up gets them: those the coordinator
    holds the bytes of, and those it learned back from replicas after a restart and holds
    no bytes of (served by the replicas that hold them until the next publish of each)."""

    copies: tuple[Adapter, ...] = ()
    without_copy: tuple[HeldAdapter, ...] = ()


@dataclass(frozen=True)
class AdapterRequest:
    """What a publisher asks for to publish a LoRA adapter (``publish_adapter``)."""

    name: str
    config: dict  # PEFT's adapter_config.json
    tensors: bytes  # PEFT's adapter_model.safetensors, as the file's bytes
    version: Optional[int] = None  # default: the adapter's committed version + 1 (1 for a new one)

    def __repr__(self) -> str:
        return f"AdapterRequest({self.name!r}, version={self.version}, {len(self.tensors)} bytes)"


@dataclass(frozen=True)
class Member:
    replica_id: str
    rank_offset: int
    ranks: int  # tensor * pipeline parallel workers of this replica


@dataclass(frozen=True)
class Transfer:
    """The transfer group a round's bytes travel over: rank 0 (the sender) hosts its
    rendezvous at ``master_address:master_port``."""

    master_address: str
    master_port: int
    world_size: int  # the sender, every member's ranks and the coordinator's copy where it receives
    # An earlier round's group, kept by every participant while membership is unchanged
    # (or a route session's), or (empty) a new one named after the round.
    group_name: str = ""


@dataclass(frozen=True)
class CopyGroup:
    """The group of two over which a publisher sends the coordinator's copy once its round
    commits (the publisher at ``master_address:port`` as rank 0, the copy as rank 1),
    formed for that copy alone, off the round's critical path."""

    group_name: str
    port: int


# The kinds of round, one type each (a tagged union on ``kind``): a field that one kind
# needs and another must not have lives on that kind alone, so no plan can say two
# contradictory things. Frozen: a plan is what the coordinator decided, sent as it is
# (pickled over Ray; as JSON over HTTP, where ``kind`` tells them apart).


@dataclass(frozen=True, kw_only=True)
class _RoundBase:
    """What every round has: the version it commits, who takes part, what it carries."""

    round_id: str
    version: int
    backend: str
    members: tuple[Member, ...]
    params: tuple[ParamSpec, ...]
    bucket_bytes: int
    timeout_s: float

    def member(self, replica_id: str) -> Member:
        for m in self.members:
            if m.replica_id == replica_id:
                return m
        raise KeyError(f"replica {replica_id} is not in round {self.round_id}")


@dataclass(frozen=True, kw_only=True)
class _TransferRound(_RoundBase):
    """A round whose bytes move over a transfer group (every kind but a reload)."""

    transfer: Transfer

    @property
    def group(self) -> str:
        """The transfer group's name: the kept one, or one named after this round."""
        return self.transfer.group_name or self.round_id

    def update_info(self) -> dict:
        """vLLM's ``update_weights`` info as every backend starts it (a pull backend adds
        what its publisher offered: ``SyncBackend.update_info``)."""
        return dict(names=[p.name for p in self.params], dtype_names=[p.dtype for p in self.params], shapes=[list(p.shape) for p in self.params])

    def __post_init__(self) -> None:
        for m in self.members:
            if m.rank_offset < 1 or m.rank_offset + m.ranks > self.transfer.world_size:
                raise ValueError(f"{self.round_id}: {m.replica_id}'s ranks {m.rank_offset}..{m.rank_offset + m.ranks - 1} are outside world size {self.transfer.world_size}")


@dataclass(frozen=True, kw_only=True)
class PushRound(_TransferRound):
    """A trainer's publish (:class:`RoundRequest`): the publisher sends as rank 0."""

    kind: Literal["push"] = field(default="push", init=False)
    pause_mode: PauseMode
    # The coordinator's copy receives in the round as this rank (None: it does not, or
    # it receives over ``copy`` after the commit).
    keeper_rank: Optional[int] = None
    # What the publisher offered for replicas to pull from (see RoundRequest.transfer_info),
    # as the backend typed it (its TransferInfo); the backend adds it to the update info.
    transfer_info: Optional[Any] = None
    # The group of two over which the publisher sends the coordinator's copy once the
    # round commits (see RoundRequest.copy_group); None: no copy, or ``keeper_rank``.
    copy: Optional[CopyGroup] = None
    # The digest of the round's ``params`` (params_digest) where its offer has an id; with
    # ``params`` empty (the plan of a member that holds the offer), the member's own copy
    # of the parameters of that digest, kept from the last plan that carried them.
    params_digest: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keeper_rank is not None and self.copy is not None:
            raise ValueError(f"{self.round_id}: the coordinator's copy receives either in the round (keeper_rank) or after it (copy), not both")
        if self.keeper_rank is not None and not 1 <= self.keeper_rank < self.transfer.world_size:
            raise ValueError(f"{self.round_id}: keeper_rank {self.keeper_rank} is outside world size {self.transfer.world_size}")


@dataclass(frozen=True, kw_only=True)
class PullRound(_TransferRound):
    """Catch-up or rollback of one member from the coordinator's copy of the committed
    weights: the coordinator sends as rank 0, over a group of its own."""

    kind: Literal["pull"] = field(default="pull", init=False)

    @property
    def pause_mode(self) -> PauseMode:
        return "keep"  # the member is not serving the committed weights: nothing to finish first


@dataclass(frozen=True, kw_only=True)
class ReloadRound(_RoundBase):
    """Catch-up or rollback of one member that reloads the committed weights itself from
    a directory the publisher named, with vLLM's ``reload_weights``: nothing is sent."""

    kind: Literal["reload"] = field(default="reload", init=False)
    checkpoint: str
    # The manifest id of a checkpoint a storage publish committed: the member verifies the
    # directory against it before reloading. Empty: a directory a push named
    # (``RoundRequest.checkpoint``, e.g. ``save_pretrained``), reloaded as it is.
    manifest: str = ""

    @property
    def pause_mode(self) -> PauseMode:
        return "keep"

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError(f"{self.round_id}: a reload round needs the checkpoint directory")


@dataclass(frozen=True, kw_only=True)
class StorageRound(_RoundBase):
    """A trainer's publish through shared storage (:class:`StorageRequest`): every member
    verifies the checkpoint against its manifest, then reloads it with vLLM's
    ``reload_weights``; nothing is sent. A member that finds it incomplete or corrupted
    loads nothing and fails the round."""

    kind: Literal["storage"] = field(default="storage", init=False)
    checkpoint: str
    manifest: str
    pause_mode: PauseMode

    def __post_init__(self) -> None:
        if not self.checkpoint or not self.manifest:
            raise ValueError(f"{self.round_id}: a storage round needs the checkpoint directory and its manifest id")


@dataclass(frozen=True, kw_only=True)
class SessionRound(_TransferRound):
    """A round a trainer drives through vLLM's routes, on the group of ``session``: the
    members joined it at ``/init_weight_transfer_engine`` and take the update info from
    ``/update_weights`` (``params`` is empty until then)."""

    kind: Literal["session"] = field(default="session", init=False)
    session: str
    pause_mode: PauseMode
    keeper_rank: Optional[int] = None  # the coordinator's copy receives in the round as this rank


@dataclass(frozen=True, kw_only=True)
class AdapterRound(_RoundBase):
    """A LoRA adapter's publish (:class:`AdapterRequest`): every member writes it to a
    private directory and loads it into its engine beside the adapters it serves (vLLM's
    ``add_lora``, under an id of this version's own); on a commit it serves the new version
    under the adapter's name, on an abort it drops it and keeps serving the one before.
    ``version`` is the adapter's version; the base weights do not change."""

    kind: Literal["adapter"] = field(default="adapter", init=False)
    adapter: Adapter

    @property
    def pause_mode(self) -> PauseMode:
        return "keep"  # nothing pauses: requests on other adapters (or none) go on

    def __post_init__(self) -> None:
        if self.adapter.version != self.version:
            raise ValueError(f"{self.round_id}: the round commits version {self.version}, its adapter is version {self.adapter.version}")


@dataclass(frozen=True, kw_only=True)
class AdapterRemovalRound(_RoundBase):
    """The removal of a LoRA adapter (vLLM's ``/v1/unload_lora_adapter``): every member
    reports it can drop it; on a commit each one stops serving ``name`` (requests naming it
    are refused from then on) and the coordinator forgets it, so replicas that start later
    do not load it; on an abort every member keeps serving it. ``version`` is the version
    removed: a later publish of the name continues after it (never reusing a version's
    vLLM LoRA name, which keys its prefix cache)."""

    kind: Literal["adapter-removal"] = field(default="adapter-removal", init=False)
    name: str

    @property
    def pause_mode(self) -> PauseMode:
        return "keep"  # nothing pauses: requests on other adapters (or none) go on


Round = Union[PushRound, PullRound, ReloadRound, StorageRound, SessionRound, AdapterRound, AdapterRemovalRound]
RESTORE_ROUNDS = (PullRound, ReloadRound)  # bring one member back to the committed version


@dataclass(frozen=True)
class SessionPlan:
    """``/init_weight_transfer_engine`` from a trainer written for ``vllm serve``: every
    member joins the trainer's transfer group and keeps it for the session's rounds."""

    session_id: str
    backend: str
    members: tuple[Member, ...]
    world_size: int
    init_info: dict  # the trainer's, as posted; each member gets its own rank_offset
    timeout_s: float

    def member_init_info(self, replica_id: str) -> dict:
        member = next(m for m in self.members if m.replica_id == replica_id)
        return {**self.init_info, "rank_offset": member.rank_offset, "world_size": self.world_size}


@dataclass(frozen=True)
class Sleep:
    """The replicas' sleep, as a trainer asked it through ``/sleep`` and ``/wake_up``:
    vLLM's sleep level (1: weights offloaded to host memory, KV cache dropped; 2: both
    discarded), the pause mode requests in flight met, and the tags still asleep (a partial
    ``/wake_up`` wakes some). Awake again once none is."""

    level: int
    mode: PauseMode = "abort"
    asleep: tuple[SleepTag, ...] = SLEEP_TAGS

    def describe(self) -> str:
        return f"asleep at level {self.level} ({', '.join(self.asleep)} asleep)"


@dataclass(frozen=True)
class Control:
    """What a trainer asked of every replica outside rounds, through vLLM's routes.

    Replicas report the Control they last applied on every poll; the coordinator answers
    a different one at once, so replicas that start later (or missed a poll) converge.
    """

    paused: Optional[PauseMode] = None  # ``/pause``'s mode, held until ``/resume``
    clear_cache: bool = False  # ``/pause``'s clear_cache
    cache_resets: int = 0  # ``/reset_prefix_cache`` calls so far
    sleep: Optional[Sleep] = None  # ``/sleep``'s, until ``/wake_up`` wakes every tag


# ---- vLLM's RL routes: what a trainer asks of the whole fleet -------------------------
# One typed command per route, sent to the coordinator's one entry point for them
# (WeightSyncCoordinator.drive); the answer's type is named on each.


class FleetQuery(enum.Enum):
    """The routes that carry no arguments. Answers: ``None``, except ``RESET_PREFIX_CACHE``
    (bool: every replica's reset succeeded), ``IS_PAUSED`` (bool), ``WEIGHT_VERSION``
    (int: the committed version), ``WORLD_SIZE`` (int: the ranks besides the trainer) and
    ``IS_SLEEPING`` (bool)."""

    RESUME = "resume"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    IS_PAUSED = "is_paused"
    WEIGHT_VERSION = "weight_version"
    WORLD_SIZE = "world_size"
    SHUTDOWN_SESSION = "shutdown_weight_transfer_engine"
    START_UPDATE = "start_weight_update"
    IS_SLEEPING = "is_sleeping"  # bool: any tag of the replicas is asleep
    # The credential alone (answer None): a route that reads a path the caller names reads
    # it only once the coordinator admitted the caller (the ingress holds no sync token).
    AUTHORIZE = "authorize"


@dataclass(frozen=True)
class Pause:
    """``/pause``: every live replica holds generation until ``RESUME``. Answer: None."""

    mode: PauseMode
    clear_cache: bool


@dataclass(frozen=True)
class OpenSession:
    """``/init_weight_transfer_engine``: every live replica (and the coordinator's copy)
    joins the trainer's group; answered (None) once all have."""

    init_info: dict


@dataclass(frozen=True)
class Update:
    """``/update_weights``: answered (None) once every member received the broadcast."""

    update_info: dict


@dataclass(frozen=True)
class FinishUpdate:
    """``/finish_weight_update``. Answer: the committed version (int), once every member serves it;
    ``weight_version`` names it in every token's version spans."""

    weight_version: Optional[str] = None


@dataclass(frozen=True)
class LoadAdapter:
    """``/v1/load_lora_adapter``: ``request`` (read from the trainer's PEFT directory) as
    the adapter's next version on every replica, all or none (an :class:`AdapterRound`).
    ``inplace`` False (vLLM's ``load_inplace``): refused while the name is loaded.
    Answer: the round's :class:`RoundOutcome` (``version``: the adapter's committed one)."""

    request: AdapterRequest
    inplace: bool = False


@dataclass(frozen=True)
class UnloadAdapter:
    """``/v1/unload_lora_adapter``: every replica stops serving adapter ``name`` and the
    coordinator forgets it (an :class:`AdapterRemovalRound`). Answer: its :class:`RoundOutcome`."""

    name: str


@dataclass(frozen=True)
class SleepFleet:
    """``/sleep``: every live replica's engine sleeps at ``level`` (vLLM's sleep mode), its
    requests in flight met by ``mode``; answered (None) once all sleep."""

    level: int
    mode: PauseMode = "abort"


@dataclass(frozen=True)
class WakeFleet:
    """``/wake_up``: every live replica wakes ``tags`` (None: all); after a level-2 sleep a
    replica whose weights wake reloads the committed version before it serves again.
    Answer: whether the replicas are fully awake (bool), once all applied it."""

    tags: Optional[tuple[SleepTag, ...]] = None


RouteCommand = Union[FleetQuery, Pause, OpenSession, Update, FinishUpdate, LoadAdapter, UnloadAdapter, SleepFleet, WakeFleet]


@dataclass
class RoundOutcome:
    round_id: str
    committed: bool
    version: int
    error: str = ""
    failed_replicas: list[str] = field(default_factory=list)
    # Members of a committed round that did not confirm serving it within the step deadline:
    # they serve an older version until they catch up (their lag shows in metrics).
    unconfirmed: list[str] = field(default_factory=list)
    # replica -> seconds per step of the round (pause, join, receive, ...), as each reports
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    # "address:port" of the rendezvous that members could not reach (the round aborted
    # before anything was sent); empty when none failed that way.
    unreachable: str = ""
    # The round's digest (rollout.sync.digest.combine of the per-tensor digests of what was
    # sent; empty where the sender gave none), and each member's of what it received.
    digest: str = ""
    replica_digests: dict[str, str] = field(default_factory=dict)
    # replica -> names of the tensors whose received bytes differed from the sent ones
    # (the round aborted; every replica keeps the committed version).
    mismatched: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Reregister:
    """The coordinator's answer to a poll from a replica it does not know (it restarted,
    or dropped the replica as silent): register again."""


REREGISTER = Reregister()
