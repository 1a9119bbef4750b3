"""Who may do what: the one place that decides which credential a caller must present
for which operation, used by the ingress (its routes and vLLM's RL routes) and the
coordinator alike.

- :class:`AccessPolicy` (the ingress): the API key for every route; on the sync routes
  the sync credential besides, handed to the coordinator; on vLLM's RL routes one
  credential, the sync credential where sync needs one, else the API key.
- :class:`SyncAuth` (the coordinator, which checks the sync credential itself, so a
  caller through a Serve handle is held to it as well).

Changing the served weights (opening, finishing or aborting a round; vLLM's RL routes)
takes the sync token, or a Kubernetes ServiceAccount token of an allowed account, when
:meth:`SyncConfig.token_required <rollout.config.SyncConfig.token_required>` says so. That
decision is made once, when the app is built, and travels in the config to every process;
before, the ingress and the coordinator each read their own environment and could
disagree (an ingress that saw no token let the API key stand in for it, while the
coordinator saw one and refused, or the other way round: a coordinator that saw none let
any credential through).
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional

from rollout.errors import AuthenticationError

if TYPE_CHECKING:
    from rollout.config import SyncConfig
    from rollout.kube import TokenReviewer

logger = logging.getLogger(__name__)

SYNC_TOKEN_HEADER = "X-Rollout-Sync-Token"  # where a caller of the ingress sends the sync credential


@dataclass(frozen=True)
class SyncAuth:
    """``required``: whether a sync credential is needed at all; ``token``: the shared sync
    token as this process knows it (only the coordinator checks it); ``service_accounts``:
    accounts whose reviewed token is accepted instead."""

    required: bool
    token_env: str
    token: Optional[str] = field(default=None, repr=False)
    service_accounts: frozenset[str] = frozenset()
    audience: str = "rollout-platform"
    reviewer: Optional["TokenReviewer"] = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, sync: "SyncConfig", environ: Optional[Mapping[str, str]] = None) -> "SyncAuth":
        env = os.environ if environ is None else environ
        accounts = frozenset(sync.allowed_service_accounts)
        reviewer = None
        if accounts:
            from rollout.kube import TokenReviewer

            reviewer = TokenReviewer([sync.token_audience])
        return cls(
            required=sync.token_required(env),
            token_env=sync.token_env,
            token=(env.get(sync.token_env) or "").strip() or None,
            service_accounts=accounts,
            audience=sync.token_audience,
            reviewer=reviewer,
        )

    def warn_if_unusable(self) -> None:
        """Log what an operator must know at start-up: sync open to anyone with the API key,
        or required with nothing that could ever satisfy it."""
        if not self.required:
            logger.warning("sync.require_token is off: anyone who can reach the platform (with the API key, if any) can publish weights")
        elif self.token is None and not self.service_accounts:
            logger.error("sync.require_token is on, but %s is not set here and no service account is allowed: every publish is refused", self.token_env)

    async def check(self, credential: Optional[str]) -> None:
        """Raise :class:`AuthenticationError` unless ``credential`` may change the weights."""
        if not self.required:
            return
        if not credential:
            raise AuthenticationError(f"missing sync token: send it in X-Rollout-Sync-Token (publishers read {self.token_env})")
        if self.token is not None and hmac.compare_digest(credential.encode(), self.token.encode()):
            return
        if self.service_accounts:
            # A trainer pod's projected ServiceAccount token, verified by the API server.
            user = await asyncio.to_thread(self.reviewer.review, credential)
            if user in self.service_accounts:
                return
            raise AuthenticationError(f"service account {user or '(unauthenticated)'} may not publish weights")
        if self.token is None:
            raise AuthenticationError(f"the sync token is required, but {self.token_env} is not set where the coordinator runs; no publish can be authorized")
        raise AuthenticationError("wrong sync token")


class Operation(enum.Enum):
    """What a caller of the ingress asks for, by the credentials it takes."""

    SERVE = "serve"  # the token API, episodes, OpenAI routes, stats, sync status: the API key
    PUBLISH = "publish"  # /v1/sync/rounds: the API key, and the sync credential for the coordinator
    DRIVE = "drive"  # vLLM's RL routes: one credential (a vLLM client sends only a Bearer)


@dataclass(frozen=True)
class Presented:
    """The credentials a request carries."""

    bearer: Optional[str] = field(default=None, repr=False)  # ``Authorization: Bearer <value>``
    sync_token: Optional[str] = field(default=None, repr=False)  # ``X-Rollout-Sync-Token``

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> "Presented":
        """From a request's headers (case-insensitive, as Starlette's are)."""
        scheme, _, value = (headers.get("authorization") or "").partition(" ")
        bearer = value.strip() if scheme.lower() == "bearer" and value.strip() else None
        return cls(bearer, headers.get(SYNC_TOKEN_HEADER))


def _same(presented: str, expected: str) -> bool:
    # Constant-time, so a credential cannot be timed out of the platform.
    return hmac.compare_digest(presented.encode(), expected.encode())


@dataclass(frozen=True)
class AccessPolicy:
    """The ingress's decision. ``api_key``: None when the API is open (a warning is logged
    where the ingress starts); ``sync``: the same sync policy the coordinator holds."""

    api_key: Optional[str] = field(repr=False)
    sync: SyncAuth

    def admit(self, operation: Operation, presented: Presented) -> Optional[str]:
        """Raise :class:`AuthenticationError` unless the ingress lets the call through;
        returns the credential to hand the coordinator (which checks it with
        :meth:`SyncAuth.check`), or None when the call takes none."""
        if operation is Operation.DRIVE:
            credential = presented.sync_token or presented.bearer
            if self.sync.required:
                return credential  # the sync credential: the coordinator decides
            # No sync credential needed: the API key (if any) guards these routes like every other.
            if self.api_key is not None and not (credential and _same(credential, self.api_key)):
                raise AuthenticationError("missing or wrong API key: send 'Authorization: Bearer <key>'")
            return None
        if self.api_key is not None:
            if presented.bearer is None:
                raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
            if not _same(presented.bearer, self.api_key):
                raise AuthenticationError("wrong API key")
        return presented.sync_token if operation is Operation.PUBLISH else None
