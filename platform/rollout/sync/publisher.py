"""The trainer's side of weight sync: ``WeightPublisher``.

    publisher = WeightPublisher.connect(app_name="rollout")
    version = publisher.publish(model.named_parameters())   # returns the committed version

The publisher joins each round's group as rank 0 (the sender); the coordinator tells
it the world size and every replica's rank offset. Names, shapes and dtypes are
checked by the coordinator before any replica changes weights.

A trainer with no network path to the engines publishes through shared storage instead:

    write_checkpoint(model.named_parameters(), "/shared/policy-v7", source_dir=base)
    version = publisher.publish_checkpoint("/shared/policy-v7")   # every replica reloads it
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Callable, Iterable, Mapping, Optional, Union

import torch

from rollout.contracts import net
from rollout.contracts.backend import CopySender, SendChoice, Sender, TransferInfo
from rollout.contracts.backend_registry import get_backend, make_sender
from rollout.contracts.sync_protocol import (
    COORDINATOR_NAME,
    AdapterRequest,
    SYNC_TOKEN_ENV,
    CoordinatorUnreachableError,
    DeltaBaseError,
    OfferUnknownError,
    ParamSpec,
    PublisherUnreachableError,
    PublishWait,
    PushRound,
    RoundOutcome,
    RoundRequest,
    StorageRequest,
    StorageRound,
    SyncError,
)
from rollout.errors import InvalidRequestError
from rollout.sync.adapters import config_json, encode_tensors
from rollout.sync.coordinator_client import BlockingCoordinatorHandle
from rollout.sync.remote import CoordinatorClient, HttpCoordinator
from rollout.sync.storage import checkpoint_params, manifest_id, verify_checkpoint

logger = logging.getLogger(__name__)

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def _token(explicit: Optional[str]) -> Optional[str]:
    return explicit if explicit is not None else os.environ.get(SYNC_TOKEN_ENV)


# While a send runs, the publisher asks the coordinator this often whether the round was
# decided without it (a member failed): a send blocked on ranks that will never join then
# ends in seconds, not at the round's deadline. A send that ends sooner asks nothing.
DECIDED_POLL_S = 1.0
# Each of those questions waits at most this long: a coordinator that does not answer (its
# link cut) must not hold the send loop past the round's deadline.
DECIDED_ASK_S = 5.0
# Past the coordinator's own bound on a finish, what the HTTP round trip may add.
FINISH_MARGIN_S = 10.0


def _finish_bound_s(plan: Union[PushRound, StorageRound], error: Optional[str], since_open_s: float) -> float:
    """How long the finish call may take before the coordinator counts as lost. It decides
    an abort at once; a commit by the round's deadline (three steps from opening) and then
    waits one more step for the members to serve it. Beyond that nothing is slow: the
    coordinator is out of reach."""
    if error:
        return plan.timeout_s + FINISH_MARGIN_S
    return max(plan.timeout_s, 4 * plan.timeout_s - since_open_s) + FINISH_MARGIN_S


def _send_with_deadline(sender: Sender, plan: PushRound, tensors, decided: Callable[[], bool] = lambda: False) -> Optional[str]:
    """Run the transfer with the round's deadline; the error text, or None on success.

    A transport blocked on a peer that went away must not hang the trainer: after the
    deadline, or once ``decided()`` says the round ended without this publisher (a member
    failed, so the round aborted), the round is reported failed and the sending thread is
    abandoned (it ends when the transport's own timeouts pass).
    """
    outcome: dict[str, Optional[str]] = {}

    def run() -> None:
        try:
            sender.send(plan, tensors)
            outcome["error"] = None
        except Exception as e:
            outcome["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run, name=f"send-{plan.round_id}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 2 * plan.timeout_s
    while True:
        thread.join(timeout=max(0.0, min(DECIDED_POLL_S, deadline - time.monotonic())))
        if not thread.is_alive():
            return outcome["error"]
        if time.monotonic() >= deadline:
            return f"transfer did not finish within {2 * plan.timeout_s:.0f}s"
        if decided():
            return "the round ended while sending (a member failed); the send was abandoned"


def _by_reference(offered) -> bool:
    """The sender named its offer by id (see TransferInfo.by_reference)."""
    return isinstance(offered, TransferInfo) and offered.by_reference()


def _decided(coordinator: CoordinatorClient, round_id: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            rounds = coordinator.status(timeout_s=DECIDED_ASK_S).get("recent_rounds") or []
        except Exception as e:  # the deadline still ends the send
            logger.warning("asking the coordinator whether %s is decided failed: %s", round_id, e)
            return False
        return any(r.get("round_id") == round_id for r in rounds)

    return check


class WeightPublisher:
    def __init__(self, coordinator: CoordinatorClient, backend: str, token: Optional[str], ports: Union[str, net.PortRange, None] = None):
        self._coordinator = coordinator
        self.backend = backend
        self._token = token
        # Where this process hosts its rendezvous (each round's, the coordinator's copy's):
        # ``ports``, else ROLLOUT_PUBLISHER_PORTS, else a port the kernel picks.
        self._ports_setting = "ports" if ports is not None else net.PORTS_ENV
        self.ports = net.PortRange.parse(ports, "ports") if isinstance(ports, str) else ports if ports is not None else net.publisher_ports()
        self.last_sync_s: Optional[float] = None
        self.last_phases: dict[str, float] = {}
        self.last_outcome: Optional[RoundOutcome] = None
        # How the last publish was sent: "delta" or "full", its bytes and the rule's reasoning
        # (rollout.contracts.backend.SendChoice); None where the backend always sends in full.
        self.last_choice: Optional[SendChoice] = None
        # Whether the last round went over the transfer group kept from the round before
        # (the coordinator named it: no rendezvous, no engine init on the replicas).
        self.last_group_kept: Optional[bool] = None
        # Kept across rounds: it holds the transfer group the next round may reuse.
        self._sender: Optional[Sender] = None
        self._backend_resolved: Optional[str] = None
        # The coordinator's copy of the last committed round, still being sent (the thread, its deadline).
        self._copy: Optional[tuple[threading.Thread, float]] = None
        # The last publish's ParamSpecs, by what they were made of (names, dtypes, shapes).
        self._specs: Optional[tuple[tuple, list[ParamSpec]]] = None
        # (layout, params_digest) of the last round that committed with an offer named by id.
        self._committed_params: Optional[tuple[tuple, str]] = None

    @classmethod
    def connect(
        cls, app_name: str = "rollout", backend: str = "auto", token: Optional[str] = None, timeout_s: float = 600.0, *, ports: Union[str, net.PortRange, None] = None
    ) -> "WeightPublisher":
        """Attach to the platform's coordinator from a process in the Ray cluster.

        ``timeout_s`` bounds every call to the coordinator (a round's commit waits up to
        about four times ``sync.timeout_s``: keep it above that).

        ``token`` defaults to ``ROLLOUT_SYNC_TOKEN`` from the environment; ``ports``
        (``"LOW-HIGH"``) to ``ROLLOUT_PUBLISHER_PORTS``: where this process hosts each
        round's rendezvous, which the replicas connect to.
        """
        from ray import serve

        handle = serve.get_deployment_handle(COORDINATOR_NAME, app_name=app_name)
        return cls(BlockingCoordinatorHandle(handle, timeout_s), backend, _token(token), ports=ports)

    @classmethod
    def http(
        cls,
        base_url: str,
        api_key: Optional[str] = None,
        backend: str = "auto",
        token: Optional[str] = None,
        timeout_s: float = 600.0,
        *,
        ports: Union[str, net.PortRange, None] = None,
    ) -> "WeightPublisher":
        """Attach through the HTTP ingress, from a process outside the Ray cluster.

        The replicas connect back to this process for the transfer itself, at the
        address of its interface that routes to ``base_url``'s host (see
        :func:`rollout.contracts.net.choose`); set ``ROLLOUT_PUBLISHER_ADDRESS`` to an address
        of this host that they reach where that one is not. They connect to the port
        of the rendezvous (``ports``, default ``ROLLOUT_PUBLISHER_PORTS``, a ``"LOW-HIGH"``
        range a firewall can open) and to gloo's listeners, whose ports the kernel picks
        from ``net.ipv4.ip_local_port_range`` (see docs/sync-ports.md).
        """
        return cls(HttpCoordinator(base_url, api_key, timeout_s), backend, _token(token), ports=ports)

    def publish(
        self, named_tensors: NamedTensors, version: Optional[int] = None, checkpoint: Optional[str] = None, *, delta: bool = True, wait: PublishWait = "serving"
    ) -> int:
        """Send weights to every live replica; return the committed version once every
        replica serves it. A replica that does not confirm within the step deadline
        (``sync.timeout_s``) does not hold the trainer longer: the version stays committed,
        a warning names the replica and ``last_outcome.unconfirmed`` lists it.

        ``wait="committed"`` returns at the commit instead: every replica received the
        weights and the round committed (all or none, as always), but a replica may still be
        labelling the version and resuming generation for a few milliseconds. Requests that
        need the version (``min_weight_version``, ``max_staleness``) wait for it as for any
        version in flight; ``last_outcome`` then has no replica phases and no
        ``unconfirmed`` (``status()`` has both once the replicas confirm). It saves the
        trainer the replicas' label, resume and confirmation (issue 41).

        ``checkpoint``: an absolute path where these same weights are saved (HF
        safetensors, e.g. ``save_pretrained``) on storage every replica can read. Once
        committed, replicas that start later or roll back reload it themselves; with
        the GPU backends, which keep no copy, it is the only way they can catch up.

        With a delta backend (``gloo_delta``, ``sparse_nccl``), attached either way, it sends only
        the elements changed since the version it last committed where that moves fewer
        bytes (rollout.sync.delta); ``delta=False`` sends in full. ``last_choice`` says how
        it went: ``mode`` "delta" or "full", ``bytes_sent``, ``full_bytes`` and the rule's
        reasoning. A delta whose base is no longer the committed version (another
        publisher committed since) is refused before any round opens, and the publish
        goes in full (logged).

        Raises ``InvalidRequestError`` (unknown names, wrong shapes or dtypes, version
        not increasing) or ``AuthenticationError`` before any replica changes, and
        ``SyncError`` when the round fails; replicas then keep the last committed version.
        ``PublisherUnreachableError`` (a ``SyncError``) says the replicas could not reach
        the address this process advertised: it names it, how it was chosen, and
        ``ROLLOUT_PUBLISHER_ADDRESS``, which overrides it. ``CoordinatorUnreachableError``
        (a ``SyncError``) says the coordinator did not answer in time (this host's link or
        the ingress went away): mid-round, within the round's own bounds, not the client's.
        ``FleetAsleepError`` (a ``SyncError``) says the replicas' weights sleep (a co-located
        trainer's ``/sleep``, ``RolloutClient.sleep``): nothing opened; wake them first.
        """
        if wait not in ("serving", "committed"):
            raise InvalidRequestError("wait", f"must be 'serving' or 'committed' (PublishWait), not {wait!r}")
        t0 = time.perf_counter()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        # Left where they are: each sender moves what it needs (gloo a bucket at a time
        # to the host, nccl and ipc stay on the GPU).
        tensors = {name: t.detach() for name, t in items}
        # What the specs are made of: the same (the steady state) reuses the last ones.
        layout = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
        specs = self._specs[1] if self._specs is not None and self._specs[0] == layout else [ParamSpec.of(n, t) for n, t in tensors.items()]
        self._specs = (layout, specs)
        backend = self._platform_backend()
        self.flush()  # one copy at a time, in the order of the commits
        if self._sender is None:
            self._sender = make_sender(backend)
        # A sender that feeds the coordinator's copy says where that copy goes (see CopySender).
        copier = self._sender if isinstance(self._sender, CopySender) else None
        copy = copier.copy_offer(self.ports, self._ports_setting) if copier is not None else None
        # A backend without a rendezvous (ipc: replicas read the offered handles) advertises
        # no address and no port: nothing connects to this process.
        advertised = net.choose(toward=self._coordinator.host) if get_backend(backend).has_rendezvous else None
        if advertised is not None and not net.is_local(advertised.address):
            # Found here, before any replica pauses, rather than as the transport's failure
            # to bind mid-round.
            raise SyncError(
                f"this publisher would advertise {advertised.address!r} ({advertised.source}), which is not an address of this host; "
                f"set {net.ADDRESS_ENV} to one of this host's addresses that the replicas reach"
            )
        # A delta sender prices a delta against what it last committed (rollout.sync.delta);
        # its offer travels over Serve or, typed, over HTTP (rollout.sync.remote).
        self._sender.prepare(list(tensors.items()), None if delta else "publish(delta=False)")
        offered = self._sender.offer(list(tensors.values()))
        # Beside an offer named by id, the parameters go by their digest where the last round
        # committed these same ones (the coordinator and every member that holds the offer keep them).
        by_digest = self._committed_params[1] if self._committed_params is not None and self._committed_params[0] == layout and _by_reference(offered) else ""
        request = RoundRequest(
            params=() if by_digest else tuple(specs),
            params_digest=by_digest,
            master_address=advertised.address if advertised is not None else "",
            # Not the copy's port: free until the copy's rendezvous binds it after the round.
            master_port=net.free_port(self.ports, self._ports_setting, taken=(copy.port,) if copy is not None else ()) if advertised is not None else 0,
            version=version,
            reuse_group=self._sender.group_name,
            transfer_info=offered,
            checkpoint=checkpoint,
            copy_group=copy.group_name if copy is not None else "",
            copy_port=copy.port if copy is not None else 0,
        )
        t_asked = time.perf_counter()
        try:
            plan = self._coordinator.begin_round(self._token, request)
        except DeltaBaseError as e:
            # The committed version is not this publisher's base (another publisher, a
            # storage publish): nothing opened; send in full instead.
            logger.warning("the coordinator refused the delta (%s): sending in full", e)
            self._sender.prepare(list(tensors.items()), f"the coordinator refused the delta ({e})")
            plan = self._coordinator.begin_round(self._token, replace(request, transfer_info=self._sender.offer(list(tensors.values()))))
        except OfferUnknownError as e:
            # The coordinator no longer holds the offer named by id (it restarted): nothing
            # opened; offer it in full.
            logger.warning("the coordinator does not hold the offer named by id (%s): offering it in full", e)
            self._sender.offer_unknown()
            self._committed_params = None
            full = replace(request, params=tuple(specs), params_digest="", transfer_info=self._sender.offer(list(tensors.values())))
            plan = self._coordinator.begin_round(self._token, full)
        self.last_choice = self._sender.choice
        t_open = time.perf_counter()
        self.last_group_kept = bool(plan.transfer.group_name)
        sender = self._sender
        if sender.pushes:
            error = _send_with_deadline(sender, plan, [tensors[p.name] for p in plan.params], _decided(self._coordinator, plan.round_id))
        else:
            error = None  # its replicas pull what it offered: nothing to send, no thread to wait on
        if error:
            logger.error("sending %s failed: %s", plan.round_id, error)
            # A sender thread abandoned at the deadline may still hold the group.
            self._sender = None
        t_sent = time.perf_counter()
        # What the sender digested while packing (rollout.sync.digest): the coordinator
        # commits only if every replica received exactly these bytes.
        sent_digests = sender.sent_digests if not error else None
        try:
            bound = _finish_bound_s(plan, error, t_sent - t_open)
            # Passed only where the sender digested (stand-ins for backends without digests need not take it).
            extra = {"digests": sent_digests} if sent_digests is not None else {}
            if wait != "serving":  # passed only where asked (stand-ins for the coordinator need not take it)
                extra["wait"] = wait
            outcome = self._coordinator.finish(self._token, plan.round_id, error, timeout_s=bound, **extra)
        except CoordinatorUnreachableError as e:
            # Whether the round committed is unknown: its group is not reused. After a clean
            # send nothing is pending on it, so it is released (not after a failed one).
            if not error:
                sender.close()
            self._sender = None
            raise CoordinatorUnreachableError(
                f"{plan.round_id}: {e}{f' after the send failed ({error})' if error else ''}. The round is decided without this "
                f"publisher: it aborts at its deadline (replicas keep the committed version) unless the finish reached the "
                "coordinator; status() has the committed version once it answers"
            ) from None
        t_done = time.perf_counter()
        # Where the trainer's time went; the replicas' own steps are in outcome.phases.
        # "open.prepare": this process's work before asking (specs, offer); "open.ask": the
        # coordinator's answer to begin_round (its checks, the members woken, the legs).
        self.last_phases = {"open": t_open - t0, "send": t_sent - t_open, "commit": t_done - t_sent, "open.prepare": t_asked - t0, "open.ask": t_open - t_asked}
        self.last_phases.update({f"send.{k}": v for k, v in sender.phases.items()})
        self.last_outcome = outcome
        sender.decided(outcome.version if outcome.committed else None)
        self._committed_params = (layout, plan.params_digest) if outcome.committed and plan.params_digest else None
        if copier is not None and plan.copy is not None and self._sender is copier:
            if outcome.committed:
                self._start_copy(copier, plan)
            else:
                copier.drop_kept()
        if outcome.unreachable:
            raise PublisherUnreachableError(
                f"{plan.round_id} aborted: the replicas cannot reach this publisher at {outcome.unreachable}, "
                f"the address it advertised ({advertised.source if advertised is not None else 'none'}), {net.describe_port(plan.transfer.master_port, self.ports, self._ports_setting)}: "
                f"{outcome.error}. Set {net.ADDRESS_ENV} to an address of this host that the replicas reach, and let them "
                f"connect to that port; replicas keep version {outcome.version}",
                plan.transfer.master_address,
                plan.transfer.master_port,
            )
        if not outcome.committed:
            raise SyncError(f"{plan.round_id} aborted: {outcome.error}; replicas keep version {outcome.version}")
        self.last_sync_s = t_done - t0
        if outcome.unconfirmed:
            logger.warning(
                "version %d committed, but %s did not confirm serving it within the step deadline (last_outcome.unconfirmed)",
                outcome.version,
                outcome.unconfirmed,
            )
        return outcome.version

    def publish_checkpoint(self, directory: Union[str, os.PathLike], version: Optional[int] = None) -> int:
        """Publish the checkpoint at ``directory`` (absolute, on storage every replica
        mounts, written by :func:`rollout.sync.storage.write_checkpoint`, its manifest
        last); return the committed version once every replica serves it. Nothing travels
        between this process and the replicas: each replica verifies the directory
        against its manifest, then reloads it with vLLM's ``reload_weights``. Once
        committed it is also what replicas that start later, or roll back, reload.

        Raises :class:`~rollout.sync.storage.CheckpointError` (a ``SyncError``) naming the
        shard, before any replica changes, when the checkpoint is incomplete (no manifest
        yet) or corrupted (a shard missing, of another size or digest): this process
        verifies it first (it reads every byte once). A replica that finds it otherwise
        (its mount differs, or the directory changed since) loads nothing and fails the
        round: every replica keeps the committed version, and the ``SyncError`` names the
        replica and the shard. ``InvalidRequestError`` as :meth:`publish` (names, shapes,
        dtypes, version).
        """
        t0 = time.perf_counter()
        directory = os.fspath(directory)
        if not os.path.isabs(directory):
            raise InvalidRequestError("directory", f"{directory!r} must be an absolute path that every replica can read")
        # The manifest id pins this write: replicas load it and no later rewrite of the directory.
        published = manifest_id(directory)
        manifest = verify_checkpoint(directory, expect_manifest=published)
        request = StorageRequest(checkpoint=directory, manifest=published, params=tuple(checkpoint_params(directory, manifest)), version=version)
        self._platform_backend()
        self.flush()  # the coordinator's copy of the last push, sent before this commit
        t_verified = time.perf_counter()
        plan = self._coordinator.begin_storage(self._token, request)
        t_open = time.perf_counter()
        try:
            # Nothing to send: the finish lets the round decide once every member reloaded.
            outcome = self._coordinator.finish(self._token, plan.round_id, None, timeout_s=_finish_bound_s(plan, None, 0.0))
        except CoordinatorUnreachableError as e:
            raise CoordinatorUnreachableError(
                f"{plan.round_id}: {e}. The round is decided without this publisher: it aborts at its deadline (replicas keep the "
                "committed version) unless the finish reached the coordinator; status() has the committed version once it answers"
            ) from None
        t_done = time.perf_counter()
        self.last_phases = {"verify": t_verified - t0, "open": t_open - t_verified, "commit": t_done - t_open}
        self.last_outcome = outcome
        self.last_group_kept = False
        if not outcome.committed:
            raise SyncError(f"{plan.round_id} aborted: {outcome.error}; replicas keep version {outcome.version}")
        self.last_sync_s = t_done - t0
        if outcome.unconfirmed:
            logger.warning(
                "version %d committed, but %s did not confirm serving it within the step deadline (last_outcome.unconfirmed)", outcome.version, outcome.unconfirmed
            )
        return outcome.version

    def publish_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping, version: Optional[int] = None) -> int:
        """Publish a LoRA adapter: PEFT's tensors (``base_model.model.<module>.lora_A.weight``
        / ``.lora_B.weight``, as ``get_peft_model_state_dict`` names them) and its config
        (``adapter_config.json``: ``r``, ``lora_alpha``, ``target_modules``). Every live
        replica loads it through vLLM's LoRA support (``model.lora.enabled``), all or none;
        returns the adapter's committed version (1, 2, ... per adapter; the base weights
        keep theirs) once every replica serves it to the next request naming ``name``.
        Replicas that start later load every committed adapter before their first request.

        Raises ``InvalidRequestError`` naming the field (``name``, ``config.r``, ...) or the
        tensor (``tensors["..."]``) before any replica changes, and ``SyncError`` when the
        round fails: every replica keeps serving the adapter's version before.
        """
        request = AdapterRequest(name=name, config=config_json(config), tensors=encode_tensors(tensors), version=version)
        outcome = self._adapter_round(
            lambda: self._coordinator.publish_adapter(self._token, request),
            unreachable=f"publishing adapter {name!r}",
            kept="replicas keep the adapter's committed version",
            aborted=f"replicas keep adapter {name!r}",
        )
        if outcome.unconfirmed:
            logger.warning("adapter %r version %d committed, but %s did not confirm serving it within the step deadline", name, outcome.version, outcome.unconfirmed)
        return outcome.version

    def unload_adapter(self, name: str) -> None:
        """Unload LoRA adapter ``name``: every live replica stops serving it, all or none
        (a request naming it is then refused, 400 naming ``adapter``), and the coordinator
        forgets it, so replicas that start later do not load it. Returns once every replica
        stopped serving it. A later :meth:`publish_adapter` of ``name`` continues after the
        version removed (``math@3`` never names other weights than it did).

        Raises ``AdapterNotFoundError`` (``field`` ``"name"``) when no version of ``name``
        is published, before any replica changes; ``SyncError`` when LoRA is off
        (``model.lora.enabled``) or the round fails: every replica keeps serving the
        adapter's committed version.
        """
        outcome = self._adapter_round(
            lambda: self._coordinator.unload_adapter(self._token, name),
            unreachable=f"unloading adapter {name!r}",
            kept="replicas keep serving it",
            aborted=f"every replica keeps serving adapter {name!r}",
        )
        if outcome.unconfirmed:
            logger.warning("adapter %r unloaded, but %s did not confirm within the step deadline", name, outcome.unconfirmed)

    def _adapter_round(self, call, *, unreachable: str, kept: str, aborted: str) -> RoundOutcome:
        """One adapter round (a publish or an unload), checked, run and decided in one
        coordinator call, which bounds it (the round's deadline, then a step for the members
        to serve it). Returns the committed outcome; raises ``SyncError`` naming what every
        replica keeps when it aborted."""
        t0 = time.perf_counter()
        try:
            outcome = call()
        except CoordinatorUnreachableError as e:
            raise CoordinatorUnreachableError(
                f"{unreachable}: {e}. The round aborts at its deadline ({kept}) unless it was decided; "
                "status()['adapters'] lists the committed adapters once the coordinator answers"
            ) from None
        self.last_outcome = outcome
        self.last_phases = {"commit": time.perf_counter() - t0}
        self.last_group_kept = False
        if not outcome.committed:
            raise SyncError(f"{outcome.round_id} aborted: {outcome.error}; {aborted} version {outcome.version}")
        self.last_sync_s = time.perf_counter() - t0
        return outcome

    def _start_copy(self, sender: CopySender, plan: PushRound) -> None:
        """Send the coordinator's copy of the committed round in the background: every
        replica already serves it, and a replica that needs catching up meanwhile waits
        for the copy at the coordinator."""

        def run() -> None:
            try:
                sender.send_copy(plan)
            except Exception as e:
                logger.error(
                    "the coordinator's copy of version %d was not sent (%s: %s): replicas that start or roll back "
                    "catch up only after the next publish", plan.version, type(e).__name__, e,
                )

        thread = threading.Thread(target=run, name=f"copy-{plan.round_id}", daemon=True)
        thread.start()
        # The group's rendezvous and its transfer each end at the round's timeout.
        self._copy = (thread, 2 * plan.timeout_s)

    def flush(self) -> None:
        """Block until the coordinator's copy of the last committed version is sent
        (``publish`` returns before; the next ``publish`` and ``close`` wait for it too)."""
        copy, self._copy = self._copy, None
        if copy is None:
            return
        thread, timeout_s = copy
        thread.join(timeout=timeout_s)
        if thread.is_alive():  # its own buffers and group: nothing of it is reused
            logger.error("the coordinator's copy was not sent within %.0fs; going on without waiting for it", timeout_s)

    def _platform_backend(self) -> str:
        """The coordinator's backend (asked once): the sender must exist before the round
        opens, because some backends offer what replicas pull (``ipc`` handles)."""
        if self._backend_resolved is None:
            platform = self._coordinator.status()["backend"]
            if self.backend not in ("auto", platform):
                raise SyncError(f"backend: the platform syncs over {platform!r}, not {self.backend!r}")
            self._backend_resolved = platform
        return self._backend_resolved

    def close(self) -> None:
        """Finish sending the coordinator's copy, then leave the transfer groups (the
        next round forms new ones)."""
        self.flush()
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def status(self) -> dict:
        """Committed version, replicas and their versions, the last round's outcome."""
        return self._coordinator.status()
