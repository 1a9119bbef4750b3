"""Offline checks of Kubernetes manifests (the Helm chart's output and ``k8s/``).

No cluster is needed: objects are validated against the Kubernetes API schemas shipped
by ``kubernetes-validate``, the RayService against the KubeRay CRD's openAPIV3Schema, the
ServiceMonitor and PrometheusRule against the Prometheus operator's, and security rules
with checkov. The validators are test-time dependencies, imported
where they are used so importing this module costs nothing.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBERAY_CRDS_ENV = "ROLLOUT_KUBERAY_CRDS"
# The Prometheus operator's CRDs (shared/prometheus-operator, v0.93.0): read from there, never
# copied into the project, like KubeRay's.
PROMETHEUS_OPERATOR_CRDS_ENV = "ROLLOUT_PROMETHEUS_OPERATOR_CRDS"
PROMETHEUS_OPERATOR_CRD_FILES = {
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}
# Oldest Kubernetes minor the chart supports (Chart.yaml kubeVersion) and that
# kubernetes-validate knows; validating against it catches fields too new for users.
KUBE_VERSION = "1.26"
# Kinds whose schemas come from CRDs, not from the Kubernetes API.
CRD_KINDS = {"RayService", "RayCluster", "RayJob", "ServiceMonitor", "PodMonitor", "PrometheusRule"}

# checkov checks the tests skip; each is listed, with the reason, in helm/rollout-platform/README.md.
CHECKOV_SKIPS = {
    "CKV_K8S_8": "liveness probe: the `helm test` pod runs curl once (the tests assert probes on every Ray container)",
    "CKV_K8S_9": "readiness probe: same, the `helm test` pod",
    "CKV_K8S_15": "imagePullPolicy Always: multi-GB CUDA images; IfNotPresent with pinned tags",
    "CKV_K8S_35": "secrets as env: the platform reads ROLLOUT_API_KEY/ROLLOUT_SYNC_TOKEN from env (secretKeyRef)",
    "CKV_K8S_38": "service-account token on the head: KubeRay's autoscaler sidecar needs it (workers opt out)",
    "CKV_K8S_40": "UID >= 10000: the image's user is 1000 (Dockerfile), like KubeRay's ray images",
    "CKV_K8S_43": "image digest: pinned tags; set image.tag to 'tag@sha256:...' to pin a digest",
}


# checkov checks waived for the tool worker pods only (resource names ending in "-tools"),
# listed with the reason in helm/rollout-platform/README.md; they still apply to every other pod.
CHECKOV_TOOL_POD_SKIPS = {
    "CKV_K8S_31": "seccomp RuntimeDefault: it denies the user namespaces bubblewrap creates; the tool pod "
    "uses the Localhost profile files/seccomp/bwrap.json (RuntimeDefault plus exactly those calls)",
}


def unwaived(failed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """checkov failures less the tool-pod waivers (CHECKOV_TOOL_POD_SKIPS)."""
    return [
        f for f in failed
        if not (f["check_id"] in CHECKOV_TOOL_POD_SKIPS and str(f.get("resource", "")).endswith("-tools"))
    ]


def load_manifests(text: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a multi-document string."""
    return [d for d in yaml.safe_load_all(text) if d]


def kuberay_crd_dir() -> Path:
    return Path(os.environ.get(KUBERAY_CRDS_ENV, ROOT.parent / "shared" / "kuberay"))


def prometheus_operator_crd_dir() -> Path:
    return Path(os.environ.get(PROMETHEUS_OPERATOR_CRDS_ENV, ROOT.parent / "shared" / "prometheus-operator"))


def _strict(schema: Any) -> Any:
    """Reject unknown fields like the API server's strict field validation does.

    CRD schemas are structural: fields they do not list are pruned silently on
    apply, so a misspelled ``startupProbe`` would vanish without an error.
    """
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@lru_cache(maxsize=None)
def _crd_schema(path: str, version: str) -> dict[str, Any]:
    crd = yaml.safe_load(Path(path).read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
            # apiVersion/kind/metadata are checked by the API server, not the CRD.
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            return _strict(schema)
    raise KeyError(f"{path}: no version {version}")


def crd_errors(obj: dict[str, Any], crd_file: Path) -> list[str]:
    """Validation errors of ``obj`` against a CRD file, as ``path: message`` lines."""
    import jsonschema

    version = obj["apiVersion"].split("/")[-1]
    schema = _crd_schema(str(crd_file), version)
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]


def core_errors(obj: dict[str, Any]) -> list[str]:
    """Errors of a built-in Kubernetes object against the API schema (strict: unknown fields fail)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{obj['kind']}/{obj['metadata'].get('name')}: {'.'.join(map(str, e.path))}: {e.message}"]
    return []


def embedded_objects(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    """The built-in objects a RayService carries inside it (pod templates, the serve Service).

    They are validated (and security-scanned) like top-level objects: KubeRay copies them
    into the Pods and Services it creates, and checkov does not look inside CRDs.
    """
    spec = rayservice["spec"]
    name = rayservice["metadata"]["name"]
    namespace = rayservice["metadata"].get("namespace")
    cluster = spec["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    out: list[dict[str, Any]] = []
    for group, g in groups:
        tmpl = copy.deepcopy(g["template"])
        meta = tmpl.get("metadata", {})
        meta["name"] = f"{name}-{group}"
        if namespace:
            meta["namespace"] = namespace
        out.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": tmpl["spec"]})
    if "serveService" in spec:
        svc = copy.deepcopy(spec["serveService"])
        if namespace:
            svc.setdefault("metadata", {})["namespace"] = namespace
        out.append({"apiVersion": "v1", "kind": "Service", **svc})
    return out


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Containers of a Pod, a pod-owning workload or a RayService (all groups)."""
    if obj["kind"] == "RayService":
        return [c for p in embedded_objects(obj) if p["kind"] == "Pod" for c in containers(p)]
    spec = obj.get("spec", {})
    if obj["kind"] in ("Job", "Deployment", "StatefulSet", "DaemonSet"):
        spec = spec["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def serve_app(rayservice: dict[str, Any]) -> dict[str, Any]:
    """The one Serve application of a RayService's serveConfigV2."""
    cfg = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = cfg["applications"]
    return app


def checkov_binary() -> str | None:
    """checkov from PATH or from ``.venv-tools`` (it cannot share the project venv: its
    pins would downgrade packages vLLM and torch need)."""
    local = ROOT / ".venv-tools" / "bin" / "checkov"
    if local.exists():
        return str(local)
    return shutil.which("checkov")


def run_checkov(directory: Path, skip: Iterable[str], framework: str = "kubernetes") -> list[dict[str, Any]]:
    """Failed checkov checks over every manifest in ``directory``."""
    binary = checkov_binary()
    if binary is None:
        raise FileNotFoundError("checkov not found")
    cmd = [
        binary, "--quiet", "--compact", "--output", "json", "--framework", framework,
        "--directory", str(directory), "--skip-download",
    ]
    skip = list(skip)
    if skip:
        cmd += ["--skip-check", ",".join(skip)]
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE", CHECKOV_RUN_SCA_PACKAGE_SCAN_V2="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"checkov failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = proc.stdout.strip()
    if not out or out == "[]":
        return []
    reports = json.loads(out)
    if isinstance(reports, dict):
        reports = [reports]
    failed: list[dict[str, Any]] = []
    for r in reports:
        if not isinstance(r, dict):
            continue
        failed.extend(r.get("results", {}).get("failed_checks", []))
    return failed
