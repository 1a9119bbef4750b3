"""What a replica lets in, and its account of what it is serving.

A call's requests are checked here before any engine work (how many per call, the model's
limits, a reward that can run); the sync gate (:mod:`rollout.engine.sync_gate`) then
decides *when* they may run. Requests are counted in flight through one context manager,
:meth:`InFlight.counted`, around every path that serves them (a batch, a stream, an OpenAI
route), so the count the load reports (:class:`rollout.contracts.load.ReplicaLoad`) and the
stuck check read cannot drift from a missed decrement. How requests ended is counted in
the replica's metrics here too.

Overload (a full queue) is refused before a request reaches the replica: Serve's
``max_ongoing_requests`` and ``max_queued_requests`` (``deployment.*``) bound the calls
routed to it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from pydantic import ValidationError

from rollout.api import RolloutRequest
from rollout.config import LimitsConfig
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.validation import ModelLimits, check_request
from rollout.errors import InvalidRequestError, from_validation_error
from rollout.rewards import RewardScorer, Scorer

T = TypeVar("T")

Prepared = list[tuple[RolloutRequest, list[int]]]  # each request, with its prompt's token ids

# An idle engine stops stepping: past this, its last scheduler report may predate the final
# step and show sequences (and their KV blocks) long since finished.
IDLE_AFTER_S = 2.0


def coerce_as(model: type[T], value: Any, where: str) -> T:
    """``value`` as ``model`` (a dict from a caller that does not import our types)."""
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise from_validation_error(e, where) from None


class InFlight:
    """The requests this replica is serving, and since when it has been busy."""

    def __init__(self) -> None:
        self.count = 0
        # When the current run of in-flight requests began: the stuck check counts from
        # here, not from the engine's last step (which, for the first requests after a
        # slow start, is the engine's start).
        self.busy_since = time.monotonic()
        # Called as a run of in-flight requests begins (the replica restarts its KV-cache
        # peak there: rollout.engine.stats.SchedulerSnapshot.new_busy_period).
        self.on_busy: Callable[[], None] = lambda: None

    @contextlib.contextmanager
    def counted(self, n: int) -> Iterator[None]:
        """``n`` requests in flight for the ``with`` block, however it ends."""
        if self.count == 0:
            self.busy_since = time.monotonic()
            self.on_busy()
        self.count += n
        try:
            yield
        finally:
            self.count -= n

    def restart_clock(self) -> None:
        """Waiting on purpose (a trainer's pause) is not being stuck: count from now."""
        self.busy_since = time.monotonic()

    def stalled_for(self, snapshot: SchedulerSnapshot) -> float:
        """Seconds with requests in flight and no engine step."""
        return min(snapshot.seconds_since_step(), time.monotonic() - self.busy_since)

    def idle(self, snapshot: SchedulerSnapshot) -> bool:
        return self.count == 0 and snapshot.seconds_since_step() > IDLE_AFTER_S


class Admission:
    """Checks a call's requests and counts how they end."""

    def __init__(self, limits: LimitsConfig, model: ModelLimits, prompt_ids: Callable[[RolloutRequest], list[int]], rewards: RewardScorer, metrics: Optional[Any] = None):
        self.limits = limits
        self.model = model  # the served model's limits
        self._prompt_ids = prompt_ids
        self.rewards = rewards
        self.metrics = metrics  # rollout.metrics.EngineMetrics, when metrics are on
        self.inflight = InFlight()

    def prepare(self, requests: Sequence[Any], offset: int = 0) -> Prepared:
        """Each request with its prompt ids; raises :class:`InvalidRequestError` naming
        ``requests[offset + i]`` (``offset``: the index of ``requests[0]`` in the caller's
        whole batch) and counts the call's requests as invalid."""
        try:
            return self._prepare(requests, offset)
        except InvalidRequestError:
            self.count("invalid", len(requests))
            raise

    def _prepare(self, requests: Sequence[Any], offset: int) -> Prepared:
        if len(requests) > self.limits.max_requests_per_call:
            raise InvalidRequestError(
                "requests", f"{len(requests)} requests in one call; the limit is limits.max_requests_per_call={self.limits.max_requests_per_call}"
            )
        prepared = []
        # Validate the whole batch before starting any of it: a bad request rejects the
        # call without engine work, and the caller learns which request was at fault.
        for i, raw in enumerate(requests, start=offset):
            req = coerce_as(RolloutRequest, raw, f"requests[{i}]").with_id()
            ids = self._prompt_ids(req)
            try:
                check_request(req, ids, self.model)
                self.scorer(req)
            except InvalidRequestError as e:
                raise e.at(f"requests[{i}]") from None
            prepared.append((req, ids))
        return prepared

    def scorer(self, req: RolloutRequest) -> Optional[Scorer]:
        """The reward scorer of ``req`` (its spec, else ``rewards.default``; None: no reward).
        Checked when the request is prepared, so a spec that cannot run never reaches the engine."""
        return self.rewards.resolve(req.reward or self.rewards.default)

    # ---- how requests ended -----------------------------------------------------

    def count(self, outcome: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.request(outcome, n)

    def served(self, prompt_tokens: int, generated: int, started: float) -> None:
        if self.metrics is not None:
            self.metrics.served(prompt_tokens, generated, time.monotonic() - started)
            self.metrics.request("ok")
