"""Typed errors that cross process boundaries (Serve handles pickle them)."""

from __future__ import annotations

from typing import Iterable, Optional

from pydantic import ValidationError


class RolloutError(Exception):
    """Base class of every error the platform raises on purpose."""


class InvalidRequestError(RolloutError, ValueError):
    """A request was rejected before it reached the engine.

    ``field`` is the dotted path of the offending field (for example
    ``requests[2].sampling.max_tokens``) so a caller can fix it without guessing.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        # Exceptions pickle through ``args``; ours has two of them.
        return (type(self), (self.field, self.message))

    def at(self, prefix: str) -> "InvalidRequestError":
        """The same error, located under ``prefix`` (e.g. the request's index in a batch)."""
        field = f"{prefix}.{self.field}" if self.field and not self.field.startswith("[") else f"{prefix}{self.field}"
        return InvalidRequestError(field, self.message)


class AuthenticationError(RolloutError):
    """Missing or wrong credentials."""


class ForbiddenError(AuthenticationError):
    """An operation refused to every credential (vLLM's ``/collective_rpc`` would run code
    on the engines' workers): no key or token makes it served here."""


class EpisodeLostError(RolloutError):
    """The episode is not on the replica its id names: it ended, expired, or its replica
    restarted. Not retryable: start a new episode."""


class AdapterNotFoundError(RolloutError):
    """No LoRA adapter of that name is loaded (vLLM's ``/v1/unload_lora_adapter`` answers
    404 ``NotFoundError`` for it). ``field``, where set, names the request's field that
    holds the name (``WeightPublisher.unload_adapter``: ``name``); vLLM's route names none."""

    def __init__(self, message: str, field: Optional[str] = None):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def __reduce__(self):
        return (type(self), (self.message, self.field))


class EngineUnavailableError(RolloutError):
    """The engine is dead, stuck or shutting down."""


class StaleWeightsError(EngineUnavailableError):
    """The replica did not reach the policy version a request needs in time (retryable)."""


class NotServingError(EngineUnavailableError):
    """The replica is up but cannot serve the call (it waits for the next publish, or the
    LoRA adapter it names is committed but not loaded there): refused before any work, so
    another replica may take the call. ``replica_id`` names the replica that refused it
    (Serve's id, which the router ranks by), so the retry can go elsewhere."""

    def __init__(self, message: str, replica_id: Optional[str] = None):
        self.replica_id = replica_id
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.replica_id))


class ReplicaLostError(EngineUnavailableError):
    """The engine replica serving a request died (retryable). A call whose requests had
    returned no token is retried once on another replica before this is raised; a stream
    that had already produced tokens carries them: ``tokens_so_far`` maps each sample's
    index to its token ids."""

    def __init__(self, message: str, tokens_so_far: Optional[dict[int, list[int]]] = None):
        self.tokens_so_far = dict(tokens_so_far or {})
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.tokens_so_far))


def replica_lost(err: BaseException) -> bool:
    """Whether ``err`` (unwrapped) says the replica serving the call died, cannot be reached,
    or refused it before any work (``NotServingError``): another replica may serve it."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    return isinstance(unwrap_remote(err), (ActorDiedError, ActorUnavailableError, NotServingError))


class OverloadedError(EngineUnavailableError):
    """Every replica is busy and the caller's queue (``deployment.max_queued_requests``) is
    full: refused at once, nothing was started. Retry after ``retry_after_s`` (None when the
    deployment names no wait)."""

    def __init__(self, message: str, retry_after_s: Optional[float] = None):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.retry_after_s))


def as_overloaded(err: BaseException) -> BaseException:
    """Serve's ``BackPressureError`` (a full caller queue) as our typed, retryable error,
    with the ``Retry-After`` the deployment's ``backpressure_config`` sets; any other
    error unchanged."""
    from ray.serve.exceptions import BackPressureError

    if isinstance(err, BackPressureError):
        wait = f"; retry after {err.retry_after_s:g}s" if err.retry_after_s is not None else ""
        return OverloadedError(f"overloaded: {err.message} (deployment.max_queued_requests){wait}", err.retry_after_s)
    return err


def loc_to_field(loc: Iterable[object]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_error(err: ValidationError, prefix: str = "") -> InvalidRequestError:
    """The first problem of a pydantic ``ValidationError`` as an ``InvalidRequestError``."""
    first = err.errors()[0]
    field = loc_to_field(first.get("loc", ()))
    message = first.get("msg", str(err))
    if not field:
        return InvalidRequestError(prefix or "request", message)
    error = InvalidRequestError(field, message)
    return error.at(prefix) if prefix else error


def unwrap_remote(err: BaseException) -> BaseException:
    """The original exception behind a Ray/Serve wrapper (``RayTaskError.cause``)."""
    seen = 0
    while seen < 8:
        cause = getattr(err, "cause", None)
        if not isinstance(cause, BaseException) or cause is err:
            return err
        err, seen = cause, seen + 1
    return err
