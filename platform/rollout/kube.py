"""What the platform asks of a Kubernetes API server (the ``kubernetes`` client).

* :func:`review_token`: a trainer pod may authenticate to the weight-sync coordinator
  with its projected ServiceAccount token instead of the shared sync token; the
  coordinator verifies it with a ``TokenReview`` for ``sync.token_audience`` (cached
  briefly by :class:`TokenReviewer`) and checks the account against
  ``sync.allowed_service_accounts``.
* :func:`rayservice_status`: the RayService's status and conditions, for
  ``rollout status --kube``.

Both use in-cluster configuration when running in a pod, else the local kubeconfig.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

# Where a trainer pod mounts its projected ServiceAccount token for the platform: a
# `serviceAccountToken` projection with `audience` = sync.token_audience. The pod's default
# token is issued for the API server, and the coordinator's TokenReview refuses it.
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/rollout-platform/token"


def _load_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def review_token(token: str, audiences: Optional[list[str]] = None, api: Any = None) -> Optional[str]:
    """The username (``system:serviceaccount:NS:NAME``) a token authenticates as, or None.

    With ``audiences``, the token must have been issued for one of them: the review names
    them and its answer must say which one the token is valid for (an API server whose
    authenticator ignores audiences answers none, and the token is refused)."""
    from kubernetes import client

    if api is None:
        _load_config()
        api = client.AuthenticationV1Api()
    body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=audiences))
    status = api.create_token_review(body).status
    if status is None or not status.authenticated:
        logger.warning("TokenReview rejected a sync token: %s", getattr(status, "error", None))
        return None
    if audiences and not set(getattr(status, "audiences", None) or ()) & set(audiences):
        logger.warning("TokenReview: the sync token is not issued for %s (it is for %s)", audiences, getattr(status, "audiences", None))
        return None
    return status.user.username if status.user else None


class TokenReviewer:
    """:func:`review_token` for one audience, its answers kept for a short while.

    A publisher sends its token with every call of a round (and vLLM's RL routes make a
    dozen calls per update): without a cache each one is a round trip to the API server,
    and a client sending bad tokens in a loop would turn into a flood of TokenReviews.
    Entries are keyed by a hash of the token (the token itself is never kept), bounded in
    number (oldest first out), and expire: an accepted token after ``ok_ttl_s`` (so a
    revoked one stops working soon), a refused one after ``fail_ttl_s`` (so a token that
    was refused because of a transient API error or a binding not yet made is retried soon).
    A review that raises is not cached.
    """

    def __init__(self, audiences: list[str], api: Any = None, ok_ttl_s: float = 60.0, fail_ttl_s: float = 5.0, max_entries: int = 1024, clock: Callable[[], float] = time.monotonic):
        self.audiences = list(audiences)
        self.api = api
        self.ok_ttl_s, self.fail_ttl_s, self.max_entries = ok_ttl_s, fail_ttl_s, max_entries
        self.clock = clock
        self._entries: OrderedDict[bytes, tuple[float, Optional[str]]] = OrderedDict()
        self._lock = threading.Lock()  # reviews run on worker threads (asyncio.to_thread)

    def _key(self, token: str) -> bytes:
        return hashlib.sha256("\0".join([token, *self.audiences]).encode()).digest()

    def review(self, token: str) -> Optional[str]:
        key, now = self._key(token), self.clock()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] > now:
                self._entries.move_to_end(key)
                return hit[1]
        user = review_token(token, self.audiences, self.api)
        with self._lock:
            self._entries[key] = (now + (self.ok_ttl_s if user else self.fail_ttl_s), user)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return user

    def __len__(self) -> int:
        return len(self._entries)


def service_account_token(path: str = SERVICE_ACCOUNT_TOKEN) -> str:
    """This pod's ServiceAccount token projected for the platform's audience (see
    :data:`SERVICE_ACCOUNT_TOKEN`), to pass as a publisher's ``token``::

        volumes:
          - name: rollout-token
            projected:
              sources:
                - serviceAccountToken: {audience: rollout-platform, expirationSeconds: 3600, path: token}
        # mounted at /var/run/secrets/rollout-platform
    """
    with open(path) as f:
        return f.read().strip()


def rayservice_status(namespace: str, name: str, api: Any = None) -> dict[str, Any]:
    from kubernetes import client

    if api is None:
        _load_config()
        api = client.CustomObjectsApi()
    return api.get_namespaced_custom_object(group="ray.io", version="v1", namespace=namespace, plural="rayservices", name=name)


def render_rayservice_status(obj: dict[str, Any]) -> str:
    """The parts of a RayService's status an operator looks at first."""
    meta, status = obj.get("metadata", {}), obj.get("status") or {}
    lines = [f"RayService {meta.get('namespace', '?')}/{meta.get('name', '?')}"]
    lines.append(f"  service status     {status.get('serviceStatus', 'unknown')}")
    active = status.get("activeServiceStatus") or {}
    if active.get("rayClusterName"):
        lines.append(f"  active cluster     {active['rayClusterName']}")
    for app_name, app in (active.get("applicationStatuses") or {}).items():
        lines.append(f"  app {app_name:<14} {app.get('status', '?')}")
        for dep_name, dep in (app.get("serveDeploymentStatuses") or {}).items():
            lines.append(f"    {dep_name:<22} {dep.get('status', '?')}  {dep.get('message', '')}".rstrip())
    pending = (status.get("pendingServiceStatus") or {}).get("rayClusterName")
    if pending:
        lines.append(f"  pending cluster    {pending} (upgrade in progress)")
    conditions = status.get("conditions") or []
    if conditions:
        lines.append("  conditions")
        for c in conditions:
            lines.append(f"    {c.get('type', '?'):<22} {c.get('status', '?'):<6} {c.get('reason', '')}: {c.get('message', '')}".rstrip(": "))
    return "\n".join(lines)
