"""The one table of errors on the wire: which exception type is which HTTP answer.

Every error the ingress answers has a row here: its exception type, HTTP status, the
``error.type`` string of its body, the description the OpenAPI schema gives, and whether
retrying the same call can help. The ingress's exception handlers (encode), the schema's
``responses`` (:func:`responses`), the trainer's HTTP client and the publisher's HTTP
coordinator client (decode) all read this table; none keeps a mapping of its own.

The body is always ``{"error": {"message": ..., "type": ..., "field": ...}}``
(:class:`rollout.api.ErrorResponse`; ``field`` only for invalid requests, and for an
adapter not found where the request has a field naming it).

Bottom layer: imports only ``rollout.errors``, ``rollout.api`` and ``rollout.contracts.sync_protocol``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from rollout.api import ErrorResponse
from rollout.contracts.sync_protocol import DeltaBaseError, FleetAsleepError, SleepUnavailableError, SyncError
from rollout.errors import (
    AdapterNotFoundError,
    AuthenticationError,
    EngineUnavailableError,
    EpisodeLostError,
    ForbiddenError,
    InvalidRequestError,
    OverloadedError,
    RolloutError,
    StaleWeightsError,
)


@dataclass(frozen=True)
class WireError:
    error: type[RolloutError]  # what a client raises for this answer (and, if ``raised``, what the ingress answers with it)
    status: int
    type: str  # the body's ``error.type``
    description: str  # the OpenAPI schema's description of this answer
    retryable: bool  # whether the same call, sent again later, can succeed
    # Whether the ingress's exception handler answers this row for ``error`` raised by a
    # route. False: another part answers it (a middleware, FastAPI's own refusals), and a
    # client still reads it.
    raised: bool = True
    # Whether an answer with this status and a type this table does not know (a proxy's
    # plain-text answer, FastAPI's own refusals) reads as this row: only where the status
    # names one kind of error.
    by_status: bool = True
    also: tuple[int, ...] = ()  # other statuses read as this row when their type is unknown


INVALID = WireError(InvalidRequestError, 400, "invalid_request_error", "Invalid request: `error.field` names the field.", False, also=(404, 422))
UNAUTHENTICATED = WireError(AuthenticationError, 401, "authentication_error", "Missing or wrong API key.", False)
FORBIDDEN = WireError(ForbiddenError, 403, "forbidden", "Not served here: it would run code on the engines' workers.", False)
EPISODE_LOST = WireError(
    EpisodeLostError, 404, "episode_lost", "The episode is not on the replica its id names: it ended, expired or its replica restarted (`episode_lost`).", False, by_status=False
)
ADAPTER_NOT_FOUND = WireError(
    AdapterNotFoundError, 404, "adapter_not_found", "No LoRA adapter of that name is loaded (as vLLM's `/v1/unload_lora_adapter` answers).", False, by_status=False
)
STALE_WEIGHTS = WireError(
    StaleWeightsError,
    409,
    "stale_weights",
    # The service is healthy; the policy version the request asked for is not served (yet):
    # a conflict with the current state, to retry once that version is committed.
    "The policy version the request needs (`min_weight_version`, `sync.max_staleness`) did not arrive in time (`StaleWeightsError`; retryable).",
    True,
    by_status=False,
)
SYNC_FAILED = WireError(
    SyncError,
    409,
    "sync_error",
    # The one 409 the sync routes document: it names the delta refusal's type too.
    "The sync round was refused or failed (`sync_error`; `delta_base_error`: a delta's base is not the committed weights, publish in full; "
    "`fleet_asleep`: the replicas sleep, `/wake_up` first; `sleep_unavailable`: sleep mode is off or the platform has none); replicas keep the committed version.",
    False,
    by_status=False,
)
# A delta onto another base than the committed weights (rollout.sync.delta): its own type,
# so a publisher over HTTP falls back to a full send exactly as one over Serve does.
DELTA_BASE = WireError(DeltaBaseError, 409, "delta_base_error", SYNC_FAILED.description, False, by_status=False)
# A round (or a /sleep at another level) refused while the replicas sleep, and the sleep
# routes on a platform without sleep mode: types of their own, read back as the same types.
FLEET_ASLEEP = WireError(FleetAsleepError, 409, "fleet_asleep", SYNC_FAILED.description, False, by_status=False)
SLEEP_UNAVAILABLE = WireError(SleepUnavailableError, 409, "sleep_unavailable", SYNC_FAILED.description, False, by_status=False)
TOO_LARGE = WireError(InvalidRequestError, 413, "invalid_request_error", "Body larger than `http.max_body_bytes`.", False, raised=False)
OVERLOADED = WireError(OverloadedError, 429, "overloaded", "Overloaded: the queue (`deployment.max_queued_requests`) is full; retry after `Retry-After` seconds.", True)
# The ingress's own fault (rollout.http.last_resort): the same call fails the same way.
INTERNAL = WireError(RolloutError, 500, "internal_error", "A fault of the platform's own, logged with its traceback.", False, raised=False, by_status=False)
UNAVAILABLE = WireError(EngineUnavailableError, 503, "engine_unavailable", "No engine can serve it now (retryable).", True)

TABLE: tuple[WireError, ...] = (
    INVALID, UNAUTHENTICATED, FORBIDDEN, EPISODE_LOST, ADAPTER_NOT_FOUND, STALE_WEIGHTS, SYNC_FAILED, DELTA_BASE, FLEET_ASLEEP, SLEEP_UNAVAILABLE, TOO_LARGE, OVERLOADED,
    INTERNAL, UNAVAILABLE,
)

_RAISED = {row.error: row for row in TABLE if row.raised}
_BY_TYPE = {(row.status, row.type): row for row in TABLE}
_BY_STATUS = {status: row for row in TABLE if row.by_status for status in (row.status, *row.also)}
assert len(_RAISED) == sum(row.raised for row in TABLE), "one row per exception type the ingress answers"
assert len(_BY_TYPE) == len(TABLE), "one row per (status, type)"


# ---- the server's side ---------------------------------------------------------------


def raised_types() -> tuple[type[RolloutError], ...]:
    """The exception types the ingress installs a handler for."""
    return tuple(_RAISED)


def row_of(err: BaseException) -> Optional[WireError]:
    """The row of ``err``: its most specific type that has one (None: not ours to answer)."""
    for cls in type(err).__mro__:
        row = _RAISED.get(cls)
        if row is not None:
            return row
    return None


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def body(row: WireError, message: str, field: Optional[str] = None) -> dict[str, Any]:
    """The error body of ``row`` (the shape :class:`rollout.api.ErrorResponse` documents)."""
    detail: dict[str, Any] = {"message": message, "type": row.type}
    if field is not None:
        detail["field"] = field
    return {"error": detail}


def encode(err: BaseException) -> Answer:
    """The HTTP answer to ``err`` (a type of the table)."""
    row = row_of(err)
    if row is None:
        raise TypeError(f"{type(err).__name__} has no row in rollout.wire_errors.TABLE") from err
    headers = {}
    if isinstance(err, OverloadedError) and err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    # An adapter not found names the field that held its name where the route has one.
    field = err.field if isinstance(err, (InvalidRequestError, AdapterNotFoundError)) else None
    return Answer(row.status, body(row, str(err), field), headers)


def responses(*rows: WireError) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that may answer ``rows``."""
    out: dict[int | str, dict[str, Any]] = {}
    for row in rows:
        if row.status in out:
            raise ValueError(f"two documented answers with status {row.status}: {out[row.status]['description']!r} and {row.description!r}")
        out[row.status] = {"model": ErrorResponse, "description": row.description}
    return out


# ---- the client's side ---------------------------------------------------------------


def decode(status: int, content: bytes, headers: Mapping[str, str]) -> Optional[RolloutError]:
    """The typed error an answer of the ingress (or of the serving path before it) stands
    for; None for a success."""
    if status < 400:
        return None
    try:
        detail = json.loads(content).get("error", {})
    except (ValueError, AttributeError):
        detail = None
    if not isinstance(detail, dict):
        detail = {"message": content.decode(errors="replace")}
    message = str(detail.get("message", f"HTTP {status}"))
    row = _BY_TYPE.get((status, detail.get("type"))) or _BY_STATUS.get(status)
    if row is None:
        if status >= 500:
            # The ingress answers every failure it knows from the table; any other 5xx is the
            # serving path itself failing (Serve's proxy answers 500 when the ingress replica
            # dies mid-request): retryable.
            return EngineUnavailableError(f"HTTP {status} from the serving path: {message}")
        return RolloutError(f"HTTP {status}: {message}")
    if row is INTERNAL:
        return RolloutError(f"HTTP {status}: {message}")
    if issubclass(row.error, InvalidRequestError):
        field = str(detail.get("field", "request"))
        # The body's message names the field already (it is the error's str()).
        return row.error(field, message.removeprefix(f"{field}: "))
    if issubclass(row.error, AdapterNotFoundError) and detail.get("field"):
        field = str(detail["field"])
        return row.error(message.removeprefix(f"{field}: "), field)
    if issubclass(row.error, OverloadedError):
        retry_after = headers.get("retry-after")
        return row.error(message, float(retry_after) if retry_after else None)
    return row.error(message)


def retryable(err: BaseException) -> bool:
    """Whether the table calls ``err``'s answer retryable."""
    row = row_of(err)
    return row is not None and row.retryable
