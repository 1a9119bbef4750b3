"""The Helm chart's ``values.schema.json``, generated from :class:`PlatformConfig`.

The chart's ``platform:`` values are handed verbatim to ``rollout.app:build`` as Serve
application args, so they are validated with the very schema pydantic derives from the
config models (``additionalProperties: false`` included: a typo fails ``helm install``
instead of failing the Serve app minutes later). The chart's own fields (image, pod
groups, volumes, monitoring switches) are described here by hand.

Rules JSON Schema cannot express (``min_replicas <= max_replicas``,
``tensor_parallel_size <= worker.gpusPerPod``) are template-time ``fail`` calls in
``templates/_validate.tpl``.

``rollout helm-schema`` rewrites the committed file; a test fails when it is stale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.config import PlatformConfig

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "rollout-platform"
SCHEMA_PATH = CHART_DIR / "values.schema.json"

# Kubernetes objects the chart passes through untouched (resources, affinity, ...):
# the API server validates them, we only check the shape.
_OBJ: dict[str, Any] = {"type": "object"}
_STR_MAP: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
_LIST: dict[str, Any] = {"type": "array"}


def _section(description: str, properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "object",
        "description": description,
        "additionalProperties": False,
        "properties": properties,
    }
    if required:
        out["required"] = required
    return out


def _resources() -> dict[str, Any]:
    # Requests and limits are both required: an unbounded GPU pod starves its node.
    return _section(
        "Container resources; requests and limits are both required.",
        {"requests": _OBJ, "limits": _OBJ},
        required=["requests", "limits"],
    )


def _probe() -> dict[str, Any]:
    ints = {"type": "integer", "minimum": 0}
    return _section(
        "Probe timing.",
        {
            "initialDelaySeconds": ints,
            "periodSeconds": {"type": "integer", "minimum": 1},
            "timeoutSeconds": {"type": "integer", "minimum": 1},
            "failureThreshold": {"type": "integer", "minimum": 1},
        },
    )


def _group(description: str, extra: dict[str, Any]) -> dict[str, Any]:
    common = {
        "resources": _resources(),
        "nodeSelector": _STR_MAP,
        "tolerations": _LIST,
        "affinity": _OBJ,
        "podAnnotations": _STR_MAP,
        "podLabels": _STR_MAP,
        "rayStartParams": _STR_MAP,
        "env": _LIST,
    }
    return _section(description, {**common, **extra})


def _switch(description: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return _section(description, {"enabled": {"type": "boolean"}, **(extra or {})})


_PORT: dict[str, Any] = {"type": "integer", "minimum": 1, "maximum": 65535}
# A Ray custom resource name as `ray start --resources` accepts it (and no quotes, which
# would break the shell-quoted JSON KubeRay passes).
_RAY_RESOURCE: dict[str, Any] = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_.-]*$"}


def _tool_workers() -> dict[str, Any]:
    seccomp = _section(
        "Pod seccomp profile; bubblewrap needs unshare/clone/mount, which RuntimeDefault denies without CAP_SYS_ADMIN.",
        {"type": {"enum": ["RuntimeDefault", "Localhost", "Unconfined"]}, "localhostProfile": {"type": "string"}},
        required=["type"],
    )
    return _group(
        "The hardened Ray worker group that runs tool calls (docs/kubernetes-tool-sandbox.md).",
        {
            "enabled": {"type": "boolean"},
            "resource": _RAY_RESOURCE,
            "resourceAmount": {"type": "integer", "minimum": 1},
            "replicas": {"type": "integer", "minimum": 0},
            "minReplicas": {"type": "integer", "minimum": 0},
            "maxReplicas": {"type": "integer", "minimum": 0},
            "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
            "objectStoreBytes": {"type": "integer", "minimum": 78643200},
            "shmSize": {"type": "string"},
            "podSecurityContext": {
                "type": "object",
                "description": "Pod securityContext; a fixed non-root user is required.",
                "properties": {
                    "runAsNonRoot": {"const": True},
                    "runAsUser": {"type": "integer", "minimum": 1},
                },
                "required": ["runAsNonRoot", "runAsUser"],
            },
            "seccompProfile": seccomp,
            "procMount": {"enum": [None, "Default", "Unmasked"]},
            "hostUsers": {"type": ["boolean", "null"]},
            "runtimeClassName": {"type": "string"},
            "networkPolicy": _switch(
                "NetworkPolicy of the tool pods: Ray traffic within the release and DNS only.",
                {"dnsPeers": _LIST, "allowMetricsScrape": {"type": "boolean"}},
            ),
        },
    )


def chart_properties() -> dict[str, Any]:
    """Schemas of the chart's own (non-platform) values."""
    return {
        "nameOverride": {"type": "string"},
        "fullnameOverride": {"type": "string"},
        "image": _section(
            "Platform image (see the repository's Dockerfile).",
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string", "minLength": 1},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            },
            required=["repository", "tag"],
        ),
        "imagePullSecrets": {"type": "array", "items": {"type": "string"}},
        "rayVersion": {"type": "string"},
        "rayAuth": _section(
            "Ray's token authentication through KubeRay's authOptions (the token: key auth_token of the chart's Secret).",
            {"enabled": {"type": "boolean"}, "token": {"type": "string", "description": "empty: random, kept across upgrades; else at least 32 characters"}},
        ),
        "upgradeStrategy": {"enum": ["NewCluster", "None"]},
        "podSecurityContext": _OBJ,
        "securityContext": _OBJ,
        "head": _group("The Ray head pod: GCS, Serve controller, HTTP ingress; never GPUs.", {}),
        "worker": _group(
            "The GPU worker group; one pod holds gpusPerPod // tensor_parallel_size engine replicas.",
            {
                "gpusPerPod": {
                    "type": ["integer", "null"],
                    "minimum": 0,
                    "description": "GPUs per worker pod; null means model.tensor_parallel_size. Must be >= it.",
                },
                "gpuResourceName": {"type": "string"},
                "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                "shmSize": {"type": "string"},
            },
        ),
        "probes": _section(
            "Worker probes. The startup probe covers model loading; liveness only starts after it.",
            {"startup": _probe(), "liveness": _probe(), "readiness": _probe()},
        ),
        "modelCache": _switch(
            "Volume holding model weights, mounted read-write at mountPath.",
            {
                "existingClaim": {"type": "string"},
                "size": {"type": "string"},
                "storageClassName": {"type": "string"},
                "accessModes": {"type": "array", "items": {"type": "string"}},
                "mountPath": {"type": "string"},
                "readOnly": {"type": "boolean"},
            },
        ),
        "compileCache": _switch(
            "Volume holding vLLM's compile cache and the kernels built at engine start (FlashInfer, Triton, CUDA), shared by the engine replicas.",
            {
                "source": {"enum": ["emptyDir", "modelCache", "existingClaim"], "description": "emptyDir: per pod; modelCache: subPath of the model-cache claim; existingClaim: a ReadWriteMany claim of yours."},
                "sizeLimit": {"type": "string"},
                "subPath": {"type": "string", "minLength": 1},
                "existingClaim": {"type": "string"},
                "mountPath": {"type": "string", "pattern": "^/"},
            },
        ),
        "secrets": _section(
            "HTTP API key and weight-sync token, given to pods as env from secretKeyRef.",
            {
                "create": {"type": "boolean"},
                "existingSecret": {"type": "string"},
                "apiKey": {"type": "string"},
                "syncToken": {"type": "string"},
                "apiKeyKey": {"type": "string", "minLength": 1},
                "syncTokenKey": {"type": "string", "minLength": 1},
            },
        ),
        "auth": _section(
            "Whether the chart refuses to render without an API key and sync token source.",
            {"required": {"type": "boolean", "description": "true: fail unless secrets.create or secrets.existingSecret; false: allow an unauthenticated API."}},
        ),
        "toolWorkers": _tool_workers(),
        "rayPorts": _section(
            "Ray ports pinned on every pod while toolWorkers is enabled (the tool NetworkPolicy names them).",
            {
                "nodeManager": _PORT,
                "objectManager": _PORT,
                "minWorker": _PORT,
                "maxWorker": _PORT,
            },
            required=["nodeManager", "objectManager", "minWorker", "maxWorker"],
        ),
        "service": _section(
            "The Serve HTTP service trainers call.",
            {"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "annotations": _STR_MAP},
        ),
        "networkPolicy": _switch(
            "Only pods labelled trainerPodLabels (and the Ray pods themselves) may reach the engines.",
            {
                "trainerPodLabels": _STR_MAP,
                "trainerNamespaceLabels": _STR_MAP,
                "allowTrainerWeightSync": {"type": "boolean"},
                "weightSyncPorts": {
                    "enum": ["pinned", "all"],
                    "description": "pinned: trainers reach syncPorts.ephemeral on the Ray pods; all: every port (a trainer joining the Ray cluster).",
                },
                "metricsNamespaceLabels": _STR_MAP,
            },
        ),
        "syncPorts": _section(
            "Ports of the weight sync: the Ray pods' net.ipv4.ip_local_port_range, where gloo's and NCCL's listeners bind.",
            {
                "ephemeral": {
                    "type": "string",
                    "pattern": r"^(\s*\d{1,5}\s*-\s*\d{1,5}\s*)?$",
                    "description": "LOW-HIGH set as the head and engine pods' net.ipv4.ip_local_port_range; empty keeps the kernel's.",
                }
            },
        ),
        "podDisruptionBudget": _switch("PDB for worker pods.", {"maxUnavailable": {"type": ["integer", "string"]}}),
        "monitoring": _section(
            "Prometheus-operator objects and the Grafana dashboard.",
            {
                "assumeCRDs": {
                    "type": "boolean",
                    "description": "Render the ServiceMonitor/PrometheusRule without checking that the cluster serves "
                    "their kinds (templates/_validate.tpl), e.g. for `helm template` in GitOps.",
                },
                "serviceMonitor": _switch(
                    "ServiceMonitor (needs the Prometheus operator CRDs).",
                    {"interval": {"type": "string"}, "labels": _STR_MAP},
                ),
                "prometheusRule": _switch("PrometheusRule with the platform's alerts.", {"labels": _STR_MAP}),
                "dashboard": _switch("Grafana dashboard ConfigMap (sidecar label grafana_dashboard).", {"labels": _STR_MAP}),
            },
        ),
        "tests": _section(
            "The `helm test` pod.",
            {"image": {"type": "string"}, "resources": _resources()},
        ),
        # Helm injects `global` for subcharts; allowing it keeps the chart usable as a dependency.
        "global": _OBJ,
    }


def build_schema() -> dict[str, Any]:
    platform = PlatformConfig.model_json_schema()
    defs = platform.pop("$defs", {})
    # Pydantic's refs point at "#/$defs/..."; hoisting $defs to the document root keeps them valid.
    defs["PlatformConfig"] = platform
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "rollout-platform chart values",
        "description": "Generated by `rollout helm-schema` from rollout.config.PlatformConfig; do not edit.",
        "type": "object",
        "additionalProperties": False,
        "required": ["platform", "image"],
        "properties": {"platform": {"$ref": "#/$defs/PlatformConfig"}, **chart_properties()},
        "$defs": defs,
    }


def render_schema() -> str:
    return json.dumps(build_schema(), indent=2, sort_keys=True) + "\n"


def write_schema(path: Path = SCHEMA_PATH) -> bool:
    """Write the schema; returns whether the file changed."""
    text = render_schema()
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True
