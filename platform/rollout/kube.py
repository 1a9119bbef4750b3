"""What the platform asks of a Kubernetes API server (the ``kubernetes`` client).

* :func:`review_token`: a trainer pod may authenticate to the weight-sync coordinator
  with its projected ServiceAccount token instead of the shared sync token; the
  coordinator verifies it with a ``TokenReview`` and checks the account against
  ``sync.allowed_service_accounts``.
* :func:`rayservice_status`: the RayService's status and conditions, for
  ``rollout status --kube``.

Both use in-cluster configuration when running in a pod, else the local kubeconfig.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def _load_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def review_token(token: str, audiences: Optional[list[str]] = None, api: Any = None) -> Optional[str]:
    """The username (``system:serviceaccount:NS:NAME``) a token authenticates as, or None."""
    from kubernetes import client

    if api is None:
        _load_config()
        api = client.AuthenticationV1Api()
    body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=audiences))
    status = api.create_token_review(body).status
    if status is None or not status.authenticated:
        logger.warning("TokenReview rejected a sync token: %s", getattr(status, "error", None))
        return None
    return status.user.username if status.user else None


def service_account_token(path: str = SERVICE_ACCOUNT_TOKEN) -> str:
    """This pod's projected ServiceAccount token, to pass as a publisher's ``token``."""
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
