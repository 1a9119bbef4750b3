"""Typed calls of the weight-sync coordinator through its Serve deployment handle.

Every caller of the coordinator (the replicas' agent, the ingress's sync and RL routes,
a publisher inside the cluster) goes through :class:`CoordinatorHandle` (async) or
:class:`BlockingCoordinatorHandle` (the publisher's blocking form): one method per public
method of :class:`~rollout.sync.coordinator.WeightSyncCoordinator`, with its parameter
names and types, calling it by attribute (a renamed method fails here, in one place, not
as a string somewhere). Ray's wrappers are taken off the errors (``RayTaskError``), so
callers catch the platform's own types (``SyncError``, ``AuthenticationError``, ...).

Arguments are passed positionally, in the coordinator's order (which
``tests/test_coordinator_client.py`` checks against the coordinator's signatures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from rollout.contracts.sync_protocol import Control, CoordinatorUnreachableError, PublishWait, SyncError
from rollout.errors import unwrap_remote

if TYPE_CHECKING:
    from rollout.contracts.sync_protocol import AdapterRequest, CommittedAdapters, HeldAdapter, ParamSpec, PushRound, Reregister, Round, RoundOutcome, RoundRequest, RouteCommand, SessionPlan, StorageRequest, StorageRound

    NextRound = Union[Round, SessionPlan, Control, Reregister, None]


def _trailing(*optional: Any) -> tuple:
    """Trailing optional arguments up to the last one given: a call without them is the
    same call as before they were added."""
    args = list(optional)
    while args and args[-1] is None:
        args.pop()
    return tuple(args)


async def _answer(response: Any) -> Any:
    """The answer of one handle call, or the coordinator's own error."""
    try:
        return await response
    except Exception as e:
        raise unwrap_remote(e) from None


class CoordinatorHandle:
    """Async, typed calls of the coordinator (from inside a Serve replica or any event loop)."""

    def __init__(self, handle: Any):
        self._handle = handle  # ray.serve.handle.DeploymentHandle of WeightSyncCoordinator

    # ---- replicas (the agent) ---------------------------------------------------------

    async def register(self, replica_id: str, ranks: int, version: int, params: list[ParamSpec], adapters: tuple[HeldAdapter, ...] = ()) -> int:
        return await _answer(self._handle.register.remote(replica_id, ranks, version, params, *_trailing(tuple(adapters) or None)))

    async def next_round(self, replica_id: str, version: int, control: Control = Control(), reset_ok: bool = True) -> NextRound:
        return await _answer(self._handle.next_round.remote(replica_id, version, control, reset_ok))

    async def restore(self, replica_id: str) -> Round:
        return await _answer(self._handle.restore.remote(replica_id))

    async def report(
        self, round_id: str, replica_id: str, error: Optional[str], unreachable: Optional[str] = None, digests: Optional[dict[str, str]] = None
    ) -> RoundOutcome:
        return await _answer(self._handle.report.remote(round_id, replica_id, error, unreachable, *_trailing(digests)))

    async def applied(self, round_id: str, replica_id: str, version: int, phases: Optional[dict[str, float]] = None) -> None:
        return await _answer(self._handle.applied.remote(round_id, replica_id, version, phases))

    async def adapters(self, replica_id: str) -> CommittedAdapters:
        return await _answer(self._handle.adapters.remote(replica_id))

    async def joined(self, session_id: str, replica_id: str, error: Optional[str]) -> None:
        return await _answer(self._handle.joined.remote(session_id, replica_id, error))

    async def started(self, round_id: str, replica_id: str, error: Optional[str]) -> None:
        return await _answer(self._handle.started.remote(round_id, replica_id, error))

    async def update_info(self, round_id: str, replica_id: str) -> Optional[dict]:
        return await _answer(self._handle.update_info.remote(round_id, replica_id))

    # ---- publishers (WeightPublisher, /v1/sync) --------------------------------------

    async def begin_round(self, token: Optional[str], request: RoundRequest) -> PushRound:
        return await _answer(self._handle.begin_round.remote(token, request))

    async def begin_storage(self, token: Optional[str], request: StorageRequest) -> StorageRound:
        return await _answer(self._handle.begin_storage.remote(token, request))

    async def publish_adapter(self, token: Optional[str], request: AdapterRequest) -> RoundOutcome:
        return await _answer(self._handle.publish_adapter.remote(token, request))

    async def unload_adapter(self, token: Optional[str], name: str) -> RoundOutcome:
        return await _answer(self._handle.unload_adapter.remote(token, name))

    async def finish(
        self, token: Optional[str], round_id: str, error: Optional[str] = None, digests: Optional[dict[str, str]] = None, wait: PublishWait = "serving"
    ) -> RoundOutcome:
        return await _answer(self._handle.finish.remote(token, round_id, error, *_trailing(digests, wait if wait != "serving" else None)))

    async def status(self) -> dict[str, Any]:
        return await _answer(self._handle.status.remote())

    # ---- vLLM's RL routes (a trainer written for ``vllm serve``) ---------------------

    async def drive(self, token: Optional[str], command: RouteCommand) -> Any:
        """One of vLLM's RL routes over the fleet; the answer's type is on the command."""
        return await _answer(self._handle.drive.remote(token, command))


class BlockingCoordinatorHandle:
    """The publisher's calls, blocking (a trainer's thread, no event loop), each bounded:
    a coordinator that does not answer within ``timeout_s`` raises
    :class:`CoordinatorUnreachableError`; one that dies with the call in flight raises
    :class:`SyncError` (a round it was deciding may have committed)."""

    host = None  # inside the Ray cluster: publishers advertise their node's address

    def __init__(self, handle: Any, timeout_s: float = 600.0):
        self.handle = handle  # ray.serve.handle.DeploymentHandle of WeightSyncCoordinator
        self.timeout_s = timeout_s  # like HttpCoordinator's: a coordinator that never answers is an error

    def _result(self, send: Callable[[], Any], call: str, timeout_s: Optional[float]) -> Any:
        """``send()`` makes the handle call (inside the try: a handle that fails to send
        is typed like one that fails to answer)."""
        from ray.exceptions import RayActorError

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return send().result(timeout_s=timeout_s)
        except TimeoutError:
            raise CoordinatorUnreachableError(f"the coordinator did not answer {call} within {timeout_s:g}s") from None
        except Exception as e:
            cause = unwrap_remote(e)
            if isinstance(cause, RayActorError):
                # It died with the call in flight: a round it had decided may have committed.
                raise SyncError(
                    f"the coordinator died during {call} ({type(cause).__name__}); a round it was deciding may have committed: "
                    "status() has the committed version once it is back"
                ) from None
            raise cause from None

    def begin_round(self, token: Optional[str], request: RoundRequest) -> PushRound:
        return self._result(lambda: self.handle.begin_round.remote(token, request), "begin_round", None)

    def begin_storage(self, token: Optional[str], request: StorageRequest) -> StorageRound:
        return self._result(lambda: self.handle.begin_storage.remote(token, request), "begin_storage", None)

    def publish_adapter(self, token: Optional[str], request: AdapterRequest, timeout_s: Optional[float] = None) -> RoundOutcome:
        return self._result(lambda: self.handle.publish_adapter.remote(token, request), "publish_adapter", timeout_s)

    def unload_adapter(self, token: Optional[str], name: str, timeout_s: Optional[float] = None) -> RoundOutcome:
        return self._result(lambda: self.handle.unload_adapter.remote(token, name), "unload_adapter", timeout_s)

    def finish(
        self,
        token: Optional[str],
        round_id: str,
        error: Optional[str],
        timeout_s: Optional[float] = None,
        digests: Optional[dict[str, str]] = None,
        *,
        wait: PublishWait = "serving",
    ) -> RoundOutcome:
        return self._result(lambda: self.handle.finish.remote(token, round_id, error, *_trailing(digests, wait if wait != "serving" else None)), "finish", timeout_s)

    def status(self, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return self._result(lambda: self.handle.status.remote(), "status", timeout_s)
