"""The Helm chart, rendered by the real Helm engine (helm-python-sdk), checked offline.

No cluster here: every rendered object is validated against the Kubernetes API schemas
(kubernetes-validate), the RayService against the KubeRay CRD and the ServiceMonitor and
PrometheusRule against the Prometheus operator's; the Serve config must parse back into
PlatformConfig; checkov scans for insecure pods. What only a cluster can
show (pods starting, the operator reconciling, probes passing) is not tested.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (test extra)")
pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (test extra)")
pytest.importorskip("jsonschema", reason="jsonschema not installed (test extra)")

from tests import manifest_checks as kube  # noqa: E402
from rollout.app import config_from_serve_app  # noqa: E402
from rollout.helm_schema import SCHEMA_PATH, render_schema  # noqa: E402
from rollout.engine.startup import COMPILE_CACHE_DIRS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rollout-platform"
RELEASE, NAMESPACE = "rl", "ml"
API_KEY, SYNC_TOKEN = "sk-test-api-key-7c1f0b", "sync-token-93d2e1"

CHECKOV_SKIPS = kube.CHECKOV_SKIPS

# name -> values; the same cases feed lint, schema validation and checkov.
CLUSTER_SCOPED = {"ClusterRoleBinding", "ClusterRole"}

MATRIX: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu-only": {"platform": {"model": {"path": "/models/tiny", "device": "cpu"}, "deployment": {"replicas": 2}}},
    "one-gpu": {"platform": {"model": {"path": "/models/p", "device": "cuda"}}, "worker": {"gpusPerPod": 1}},
    "tp2-autoscale": {
        "platform": {
            "model": {"path": "/models/p", "tensor_parallel_size": 2},
            "deployment": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}},
        },
    },
    "tp2-two-per-pod": {
        "platform": {
            "model": {"path": "/models/p", "tensor_parallel_size": 2},
            "deployment": {"autoscaling": {"min_replicas": 0, "max_replicas": 3}},
        },
        "worker": {"gpusPerPod": 4},
    },
    "monitoring-on": {
        "monitoring": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}},
    },
    "monitoring-off": {
        "platform": {"model": {"path": "/models/p"}, "metrics": {"enabled": False}},
        "monitoring": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": False}, "dashboard": {"enabled": False}},
    },
    "existing-secret": {"secrets": {"create": False, "existingSecret": "my-rollout-secrets"}, "modelCache": {"existingClaim": "weights"}},
    "network-policy": {
        "networkPolicy": {"enabled": True, "trainerPodLabels": {"team/trainer": "yes"}, "trainerNamespaceLabels": {"team": "rl"}},
        "secrets": {"apiKey": API_KEY, "syncToken": SYNC_TOKEN},
        "imagePullSecrets": ["regcred"],
        "worker": {"nodeSelector": {"gpu": "h100"}, "affinity": {"nodeAffinity": {}}},
    },
    "service-account-auth": {"platform": {"model": {"path": "/models/p"}, "sync": {"allowed_service_accounts": ["system:serviceaccount:rl:trainer"]}}},
    "tools-gvisor-userns": {
        "toolWorkers": {
            "runtimeClassName": "gvisor",
            "hostUsers": False,
            "procMount": "Unmasked",
            "seccompProfile": {"type": "Unconfined"},
            "networkPolicy": {"dnsPeers": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]},
        },
        "networkPolicy": {"enabled": True},
        "platform": {"model": {"path": "/models/p"}, "sync": {"enabled": False}, "tools": {"python": {"cgroups": "off"}}},
    },
    "tools-off": {"toolWorkers": {"enabled": False}},
    "auth-not-required": {"auth": {"required": False}, "secrets": {"create": False}, "rayAuth": {"enabled": False}},
}

# Helm's `--api-versions`: the kinds a cluster with the Prometheus operator serves. Helm asks
# the API server on install and upgrade; a render here (like `helm template`) knows only the
# built-in kinds, so the cases that render the operator's objects name them, as a user would.
PROMETHEUS_OPERATOR_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PrometheusRule")
CASE_APIS: dict[str, tuple[str, ...]] = {"monitoring-on": PROMETHEUS_OPERATOR_APIS}


def merged(values: dict[str, Any]) -> dict[str, Any]:
    """Chart defaults with ``values`` on top, like `helm install -f`."""
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def render_chart(values: dict[str, Any], api_versions: tuple[str, ...] = ()) -> dict[str, str]:
    """Template path -> rendered text, like `helm template --api-versions ...`.

    helm-python-sdk 0.2.2's ``Chart.render`` does not pass the option on, though the native
    ``helm_render`` it wraps takes it (``RenderOptions.api_versions``): with API versions,
    call that directly, with the same options ``Chart.render`` builds."""
    with helm.Chart.load(CHART) as chart:
        if not api_versions:
            return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        from helm_python import _native

        opts = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True, "api_versions": list(api_versions)}
        return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts)))


def render(values: dict[str, Any], api_versions: tuple[str, ...] = ()) -> dict[str, Any]:
    """Rendered objects keyed by kind (lists), plus NOTES under "NOTES"."""
    out = render_chart(values, api_versions)
    objs: dict[str, Any] = {"NOTES": ""}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            objs["NOTES"] = text
            continue
        for o in kube.load_manifests(text):
            objs.setdefault(o["kind"], []).append(o)
    return objs


def all_objects(objs: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for k, v in objs.items() if k != "NOTES" for o in v]


@pytest.fixture(scope="module", params=list(MATRIX))
def case(request) -> tuple[str, dict[str, Any], dict[str, Any]]:
    values = MATRIX[request.param]
    return request.param, values, render(values, CASE_APIS.get(request.param, ()))


def rayservice(objs) -> dict[str, Any]:
    (rs,) = objs["RayService"]
    return rs


def worker_group(objs) -> dict[str, Any]:
    """The engine worker group (GPU or CPU), not the tool workers."""
    (g,) = [g for g in rayservice(objs)["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] != "tools"]
    return g


def tool_group(objs) -> dict[str, Any] | None:
    groups = [g for g in rayservice(objs)["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "tools"]
    assert len(groups) <= 1
    return groups[0] if groups else None


def tool_pod(objs) -> dict[str, Any]:
    (pod,) = [o for o in kube.embedded_objects(rayservice(objs)) if o["kind"] == "Pod" and o["metadata"]["name"].endswith("-tools")]
    return pod


def main_network_policy(objs) -> dict[str, Any]:
    (np,) = [n for n in objs["NetworkPolicy"] if not n["metadata"]["name"].endswith("-tools")]
    return np


def tools_network_policy(objs) -> dict[str, Any] | None:
    nps = [n for n in objs.get("NetworkPolicy", []) if n["metadata"]["name"].endswith("-tools")]
    assert len(nps) <= 1
    return nps[0] if nps else None


def test_schema_is_up_to_date():
    assert SCHEMA_PATH.read_text() == render_schema(), "values.schema.json is stale: run `rollout helm-schema`"


@pytest.mark.parametrize("name", list(MATRIX))
def test_lint(name):
    report = helm.lint(CHART, MATRIX[name], strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report["messages"]
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_objects_validate_against_kubernetes_schemas(case):
    name, _, objs = case
    errors: list[str] = []
    for o in all_objects(objs):
        assert o["apiVersion"] and o["metadata"]["name"], o
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"].get("namespace") == NAMESPACE, (o["kind"], o["metadata"])
        if o["kind"] in kube.CRD_KINDS:
            continue
        errors += kube.core_errors(o)
    for o in kube.embedded_objects(rayservice(objs)):
        errors += kube.core_errors(o)
    assert errors == [], f"{name}: {errors}"


def test_rayservice_validates_against_kuberay_crd(case):
    crd = kube.kuberay_crd_dir() / "ray.io_rayservices.yaml"
    if not crd.exists():
        pytest.skip(f"KubeRay CRD not found at {crd} (set {kube.KUBERAY_CRDS_ENV} to the directory holding it)")
    name, _, objs = case
    rs = rayservice(objs)
    assert rs["apiVersion"] == "ray.io/v1"
    assert kube.crd_errors(rs, crd) == [], name


def test_crd_check_catches_unknown_fields():
    crd = kube.kuberay_crd_dir() / "ray.io_rayservices.yaml"
    if not crd.exists():
        pytest.skip(f"KubeRay CRD not found at {crd}")
    rs = copy.deepcopy(rayservice(render({})))
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["startupProbez"] = {}
    assert any("startupProbez" in e for e in kube.crd_errors(rs, crd))


def test_prometheus_operator_objects_are_sane(case):
    _, _, objs = case
    for kind in ("ServiceMonitor", "PrometheusRule"):
        for o in objs.get(kind, []):
            assert o["apiVersion"] == "monitoring.coreos.com/v1"
            assert o["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
            assert o["spec"]
    for sm in objs.get("ServiceMonitor", []):
        (svc,) = [s for s in objs["Service"] if s["metadata"]["name"].endswith("-metrics")]
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]


def prometheus_operator_crd(kind: str) -> Path:
    crd = kube.prometheus_operator_crd_dir() / kube.PROMETHEUS_OPERATOR_CRD_FILES[kind]
    if not crd.exists():
        pytest.skip(f"Prometheus operator CRD not found at {crd} (set {kube.PROMETHEUS_OPERATOR_CRDS_ENV} to the directory holding it)")
    return crd


def test_prometheus_operator_objects_validate_against_the_operator_crds(case):
    name, _, objs = case
    checked = 0
    for kind in kube.PROMETHEUS_OPERATOR_CRD_FILES:
        for o in objs.get(kind, []):
            assert kube.crd_errors(o, prometheus_operator_crd(kind)) == [], (name, kind)
            checked += 1
    # The case that turns both on renders both (the check above is not vacuous).
    if name == "monitoring-on":
        assert checked == 2


def test_prometheus_operator_crd_check_catches_unknown_fields_and_bad_durations():
    objs = render(MATRIX["monitoring-on"], PROMETHEUS_OPERATOR_APIS)
    (sm,) = copy.deepcopy(objs["ServiceMonitor"])
    sm["spec"]["endpoints"][0]["honourLabels"] = True
    sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    errors = kube.crd_errors(sm, prometheus_operator_crd("ServiceMonitor"))
    assert any("honourLabels" in e for e in errors) and any("interval" in e for e in errors), errors
    (rule,) = copy.deepcopy(objs["PrometheusRule"])
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    assert any(e.startswith("spec.groups.0.rules.0.for") for e in kube.crd_errors(rule, prometheus_operator_crd("PrometheusRule")))


MONITORING_ON = MATRIX["monitoring-on"]


def test_monitoring_without_the_prometheus_operator_fails_naming_the_values_to_turn_off():
    """A cluster without the operator's CRDs (Helm fills .Capabilities from the API server on
    install): rendering fails before anything is created, instead of `helm install` failing
    half-way on `no matches for kind "PrometheusRule"`."""
    with pytest.raises(helm.HelmError) as err:
        render_chart(MONITORING_ON)
    msg = str(err.value)
    for api in PROMETHEUS_OPERATOR_APIS:
        assert "does not serve" in msg and api in msg and f"--api-versions {api}" in msg
    assert "monitoring.serviceMonitor.enabled=false" in msg and "monitoring.prometheusRule.enabled=false" in msg
    assert "monitoring.assumeCRDs=true" in msg
    # Only what is missing is named: a cluster serving ServiceMonitor but not PrometheusRule.
    with pytest.raises(helm.HelmError) as err:
        render_chart(MONITORING_ON, PROMETHEUS_OPERATOR_APIS[:1])
    msg = str(err.value)
    assert "monitoring.prometheusRule.enabled=false" in msg and "--api-versions monitoring.coreos.com/v1/PrometheusRule" in msg
    assert "ServiceMonitor" not in msg and "serviceMonitor" not in msg
    # An object the chart does not render needs no CRD: a ServiceMonitor switched on while
    # the metrics port is off, and the dashboard (a ConfigMap).
    objs = render(MATRIX["monitoring-off"])
    assert "ServiceMonitor" not in objs and "PrometheusRule" not in objs
    assert "ConfigMap" in render({"monitoring": {"dashboard": {"enabled": True}}})


def test_monitoring_renders_anyway_with_api_versions_or_assume_crds():
    """`helm template` in GitOps: no cluster to ask, so the user says the kinds exist."""
    with_apis = render(MONITORING_ON, PROMETHEUS_OPERATOR_APIS)
    assumed = render({"monitoring": {**MONITORING_ON["monitoring"], "assumeCRDs": True}})
    for objs in (with_apis, assumed):
        assert [o["kind"] for o in objs["ServiceMonitor"] + objs["PrometheusRule"]] == ["ServiceMonitor", "PrometheusRule"]
        for kind in ("ServiceMonitor", "PrometheusRule"):
            assert f"{kind} {RELEASE}-rollout-platform" in objs["NOTES"]
    # The same objects either way.
    assert with_apis["ServiceMonitor"] == assumed["ServiceMonitor"] and with_apis["PrometheusRule"] == assumed["PrometheusRule"]
    assert "assumeCRDs" in json.loads(SCHEMA_PATH.read_text())["properties"]["monitoring"]["properties"]


def test_serve_config_parses_back_into_platform_config(case):
    name, values, objs = case
    app = kube.serve_app(rayservice(objs))
    assert app["import_path"] == "rollout.app:build"
    cfg = config_from_serve_app(app)
    want = merged(values)["platform"]
    assert app["name"] == cfg.app_name == want["app_name"]
    assert cfg.model.path == want["model"]["path"]
    # Every value the case set arrives in the config unchanged.
    got = cfg.model_dump(mode="json")

    def leaves(d, path=()):
        for k, v in d.items():
            yield from leaves(v, path + (k,)) if isinstance(v, dict) else [(path + (k,), v)]

    for path, v in leaves(values.get("platform", {})):
        node = got
        for k in path:
            node = node[k]
        assert node == v, (name, path)
    serve = yaml.safe_load(rayservice(objs)["spec"]["serveConfigV2"])
    assert serve["http_options"]["port"] == cfg.http.port


def test_replica_count_is_a_deployment_override_so_scaling_keeps_the_args():
    """Serve's code version is import_path + args: equal args mean `helm upgrade` only scales."""
    one, three = (kube.serve_app(rayservice(render({"platform": {"deployment": {"replicas": n}}}))) for n in (1, 3))
    assert one["args"] == three["args"] and "replicas" not in one["args"].get("deployment", {})
    assert [d for d in three["deployments"] if d["name"] == "RolloutEngine"] == [{"name": "RolloutEngine", "num_replicas": 3}]
    assert config_from_serve_app(three).deployment.replicas == 3
    # Autoscaling stays in args; Serve rejects num_replicas next to an autoscaling_config.
    auto = kube.serve_app(rayservice(render(MATRIX["tp2-autoscale"])))
    assert not any("num_replicas" in d for d in auto.get("deployments", []))
    # (plus the resource the chart pins the ingress and coordinator to, with tool workers on)
    assert auto["args"]["deployment"] == {**MATRIX["tp2-autoscale"]["platform"]["deployment"], "control_resource": "rollout_serve"}
    off = kube.serve_app(rayservice(render({"toolWorkers": {"enabled": False}, "platform": {"deployment": {"replicas": 3}}})))
    assert off["deployments"] == [{"name": "RolloutEngine", "num_replicas": 3}] and "deployment" not in off["args"]


def test_secrets_by_reference_only(case):
    name, values, objs = case
    rs = rayservice(objs)
    secret = values.get("secrets", {}).get("existingSecret") or f"{RELEASE}-rollout-platform-secrets"
    secret_values = [API_KEY, SYNC_TOKEN]
    for s in objs.get("Secret", []):
        secret_values += [base64.b64decode(v).decode() for v in s["data"].values()]
    assert all(s not in rs["spec"]["serveConfigV2"] for s in secret_values)
    assert "api_key" not in rs["spec"]["serveConfigV2"]
    pods = [p for p in kube.embedded_objects(rs) if p["kind"] == "Pod"]
    platform_containers = [c for p in pods if not p["metadata"]["name"].endswith("-tools") for c in kube.containers(p)]
    if not merged(values)["auth"]["required"] and "Secret" not in objs and not values.get("secrets", {}).get("existingSecret"):
        # Explicitly unauthenticated: no pod refers to a Secret at all.
        assert "secretKeyRef" not in yaml.safe_dump(rs)
        return
    for c in platform_containers:
        env = {e["name"]: e for e in c["env"]}
        for var in ("ROLLOUT_API_KEY", "ROLLOUT_SYNC_TOKEN"):
            assert "value" not in env[var], (c["name"], var)
            assert env[var]["valueFrom"]["secretKeyRef"]["name"] == secret
        assert not any(e.get("value") in secret_values for e in c["env"])
    if values.get("secrets", {}).get("create") is False:
        assert "Secret" not in objs
    else:
        (s,) = objs["Secret"]
        assert set(s["data"]) == {"api-key", "sync-token"} | ({"auth_token"} if merged(values)["rayAuth"]["enabled"] else set())


def test_gpus_replicas_and_autoscaler(case):
    name, values, objs = case
    rs = rayservice(objs)
    cluster = rs["spec"]["rayClusterConfig"]
    cfg = config_from_serve_app(kube.serve_app(rs))
    head = cluster["headGroupSpec"]
    worker = worker_group(objs)
    head_res = head["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in head_res["limits"] and "nvidia.com/gpu" not in head_res["requests"]
    assert head["rayStartParams"]["num-cpus"] == "0", "engine replicas must not land on the head"
    assert cluster["enableInTreeAutoscaling"] is True
    wres = worker["template"]["spec"]["containers"][0]["resources"]
    tp = cfg.model.tensor_parallel_size
    gpus = wres["limits"].get("nvidia.com/gpu", 0)
    if cfg.model.device == "cpu":
        assert gpus == 0 and worker["groupName"] == "cpu"
        per_pod = 1
    else:
        assert gpus >= tp and gpus == wres["requests"]["nvidia.com/gpu"]
        assert worker["rayStartParams"]["num-gpus"] == str(gpus)
        per_pod = gpus // tp
    a = cfg.deployment.autoscaling
    lo, hi = (a.min_replicas, a.max_replicas) if a else (cfg.deployment.replicas, cfg.deployment.replicas)
    assert worker["minReplicas"] == -(-lo // per_pod) and worker["maxReplicas"] == -(-hi // per_pod)
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def test_expected_sizes():
    tp2 = worker_group(render(MATRIX["tp2-autoscale"]))
    assert (tp2["minReplicas"], tp2["maxReplicas"]) == (1, 4)
    assert tp2["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    packed = worker_group(render(MATRIX["tp2-two-per-pod"]))
    assert (packed["minReplicas"], packed["maxReplicas"]) == (0, 2)


def test_probes_security_and_scheduling(case):
    name, values, objs = case
    rs = rayservice(objs)
    pods = [o for o in kube.embedded_objects(rs) if o["kind"] == "Pod"] + objs["Pod"]
    for pod in pods:
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] and sc["runAsUser"] == 1000 and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] is True
            assert sc.get("privileged") is not True
            assert c["resources"]["requests"] and c["resources"]["limits"]
    auto = rs["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert auto["resources"]["requests"] and auto["resources"]["limits"]
    assert auto["securityContext"]["runAsNonRoot"] is True
    # checkov's seccomp check (CKV_K8S_31) is skipped for the tool pod's sake; every other pod
    # keeps the runtime's default profile.
    for pod in pods:
        if not pod["metadata"]["name"].endswith("-tools"):
            assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, pod["metadata"]["name"]
    # Ray containers: /tmp is writable, and the worker's startup probe covers the model load.
    for pod in pods[:2]:
        c = pod["spec"]["containers"][0]
        assert {"mountPath": "/tmp", "name": "tmp"} in c["volumeMounts"]
        assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(c)
    wspec = worker_group(objs)["template"]["spec"]
    w = wspec["containers"][0]
    start = w["startupProbe"]
    assert start["httpGet"]["path"].endswith("/healthz") and start["httpGet"]["port"] == "serve"
    assert start["initialDelaySeconds"] + start["periodSeconds"] * start["failureThreshold"] >= 600
    merged_values = merged(values)
    assert wspec.get("nodeSelector", {}) == merged_values["worker"]["nodeSelector"]
    assert wspec.get("tolerations", []) == merged_values["worker"]["tolerations"]
    assert wspec.get("affinity", {}) == merged_values["worker"]["affinity"]
    if merged_values["imagePullSecrets"]:
        for pod in pods:
            assert pod["spec"]["imagePullSecrets"] == [{"name": n} for n in merged_values["imagePullSecrets"]]
    cache = merged_values["modelCache"]
    vols = {v["name"]: v for v in wspec["volumes"]}
    claim = cache["existingClaim"] or f"{RELEASE}-rollout-platform-model-cache"
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == claim
    assert ("PersistentVolumeClaim" in objs) == (not cache["existingClaim"])


def test_services_and_switchable_objects(case):
    name, values, objs = case
    rs = rayservice(objs)
    cfg = config_from_serve_app(kube.serve_app(rs))
    svc = rs["spec"]["serveService"]
    assert svc["metadata"]["name"] == f"{RELEASE}-rollout-platform"
    assert [p["port"] for p in svc["spec"]["ports"]] == [cfg.http.port]
    metrics = [s for s in objs.get("Service", []) if s["metadata"]["name"].endswith("-metrics")]
    assert len(metrics) == int(cfg.metrics.enabled)
    if metrics:
        assert metrics[0]["spec"]["ports"][0]["port"] == cfg.metrics.port == 8080
    m = merged(values)["monitoring"]
    assert len(objs.get("ServiceMonitor", [])) == int(m["serviceMonitor"]["enabled"] and cfg.metrics.enabled)
    assert len(objs.get("PrometheusRule", [])) == int(m["prometheusRule"]["enabled"])
    dash = objs.get("ConfigMap", [])
    assert len(dash) == int(m["dashboard"]["enabled"])
    if dash:
        assert dash[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    mv = merged(values)
    tools_np = mv["toolWorkers"]["enabled"] and mv["toolWorkers"]["networkPolicy"]["enabled"]
    assert len(objs.get("NetworkPolicy", [])) == int(mv["networkPolicy"]["enabled"]) + int(tools_np)
    assert (tools_network_policy(objs) is not None) == tools_np
    (pdb,) = objs["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert "RolloutClient.http(" in objs["NOTES"]
    (test_pod,) = objs["Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["args"][0].endswith(f":{cfg.http.port}/healthz")


def test_network_policy_admits_only_trainers_to_serve_port():
    values = MATRIX["network-policy"]
    objs = render(values)
    np = main_network_policy(objs)
    trainer = values["networkPolicy"]["trainerPodLabels"]
    # Policies add up: the main one must not also select the tool pods and widen theirs.
    assert np["spec"]["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["tools"]}
    ]
    rules = np["spec"]["ingress"]
    serve_rules = [r for r in rules if r.get("ports") == [{"port": 8000, "protocol": "TCP"}]]
    (rule,) = serve_rules
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"] == trainer
    assert peer["namespaceSelector"]["matchLabels"] == {"team": "rl"}
    # Nobody else gets the serve port except the release's own Ray pods and the operator.
    for r in rules:
        for p in r["from"]:
            labels = p.get("podSelector", {}).get("matchLabels", {})
            assert labels in (trainer, {"app.kubernetes.io/name": "rollout-platform", "app.kubernetes.io/instance": RELEASE},
                              {"app.kubernetes.io/name": "kuberay-operator"}) or (
                "podSelector" not in p and r["ports"] == [{"port": 8080, "protocol": "TCP"}]
            )
    # The helm test pod carries the trainer labels, so it is let through like a trainer.
    assert trainer.items() <= objs["Pod"][0]["metadata"]["labels"].items()


def test_dashboard_and_rules_ship_the_k8s_copies():
    for name in ("grafana-dashboard.json", "rollout-rules.yaml"):
        assert (CHART / "files" / name).read_bytes() == (ROOT / "k8s" / "monitoring" / name).read_bytes(), name
    objs = render({"monitoring": {"dashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}}, PROMETHEUS_OPERATOR_APIS)
    (cm,) = objs["ConfigMap"]
    assert cm["data"]["rollout-platform.json"].strip() == (CHART / "files" / "grafana-dashboard.json").read_text().strip()
    (rule,) = objs["PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load((CHART / "files" / "rollout-rules.yaml").read_text())["groups"]


INVALID = [
    ({"platform": {"deployment": {"replicas": -1}}}, "/platform/deployment/replicas"),
    ({"platform": {"deployment": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}}}, "platform.deployment.autoscaling.min_replicas (5)"),
    ({"platform": {"model": {"path": "/m", "tensor_parallel_size": 4}}, "worker": {"gpusPerPod": 2}}, "platform.model.tensor_parallel_size (4)"),
    ({"platform": {"model": {"path": "/m", "tensor_paralel_size": 2}}}, "tensor_paralel_size"),
    ({"platform": {"modle": {"path": "/m"}}}, "modle"),
    ({"wroker": {}}, "wroker"),
    ({"worker": {"gpusPerPod": -1}}, "/worker/gpusPerPod"),
    ({"platform": {"model": {"path": "/m", "device": "cpu"}}, "worker": {"gpusPerPod": 2}}, "worker.gpusPerPod (2)"),
    ({"platform": {"deployment": {"autoscaling": {"upscale_delay_s": 5}}}}, "upscale_delay_s"),
    ({"secrets": {"create": False}}, "secrets.existingSecret"),
    ({"secrets": {"create": False, "existingSecret": ""}}, "auth.required is true but no API key or sync token is configured"),
    ({"toolWorkers": {"replicas": 9}}, "toolWorkers.replicas (9)"),
    ({"rayAuth": {"token": "short"}}, "rayAuth.token must be at least 32 characters"),
    ({"rayVersion": "2.50.0"}, "rayAuth.enabled needs Ray 2.52 or newer"),
    ({"auth": {"required": False}, "secrets": {"create": False}}, "rayAuth.enabled is true but there is no Secret"),
    ({"toolWorkers": {"resource": 'bad"name'}}, "/toolWorkers/resource"),
    ({"toolWorkers": {"podSecurityContext": {"runAsNonRoot": False, "runAsUser": 0}}}, "/toolWorkers/podSecurityContext"),
    ({"toolWorkers": {"seccompProfile": {"type": "Bogus"}}}, "/toolWorkers/seccompProfile"),
    ({"head": {"rayStartParams": {"resources": '"{}"'}}}, "head.rayStartParams.resources"),
    ({"toolWorkers": {"rayStartParams": {"num-cpus": "4"}}}, "toolWorkers.rayStartParams.num-cpus"),
    ({"platform": {"model": {"path": "/m"}, "tools": {"worker_resource": "elsewhere"}}}, "platform.tools.worker_resource (elsewhere)"),
    ({"platform": {"model": {"path": "/m", "device": "cpu"}, "deployment": {"num_cpus": 0}}}, "platform.deployment.num_cpus"),
    ({"head": {"resources": {"limits": None}}}, "/head/resources"),
]


@pytest.mark.parametrize("values,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_values_are_rejected_naming_the_field(values, field):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmError) as err:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert field in str(err.value)


def test_checkov(tmp_path):
    if kube.checkov_binary() is None:
        pytest.skip("checkov not found on PATH or in .venv-tools (see helm/rollout-platform/README.md)")
    for name, values in MATRIX.items():
        objs = render(values, CASE_APIS.get(name, ()))
        flat = all_objects(objs) + kube.embedded_objects(rayservice(objs))
        d = tmp_path / name
        d.mkdir()
        for i, o in enumerate(flat):
            (d / f"{i:02d}-{o['kind'].lower()}.yaml").write_text(yaml.safe_dump(o))
    all_failed = kube.run_checkov(tmp_path, CHECKOV_SKIPS)
    failed = kube.unwaived(all_failed)
    assert failed == [], [(f["check_id"], f["check_name"], f["resource"]) for f in failed]
    # The waiver is not dead: the tool pod (Localhost seccomp by default) does trip it.
    assert {f["check_id"] for f in all_failed} == set(kube.CHECKOV_TOOL_POD_SKIPS)
    readme = (CHART / "README.md").read_text()
    for check in [*CHECKOV_SKIPS, *kube.CHECKOV_TOOL_POD_SKIPS]:
        assert check in readme, f"{check} is skipped but not explained in the chart README"


def test_service_account_auth_gives_the_coordinator_token_review_rights_only():
    objs = render(MATRIX["service-account-auth"])
    (sa,) = [a for a in objs["ServiceAccount"] if not a["metadata"]["name"].endswith("-tools")]
    (binding,) = objs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "system:auth-delegator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    spec = rayservice(objs)["spec"]["rayClusterConfig"]
    assert spec["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    worker = worker_group(objs)["template"]["spec"]
    assert worker["serviceAccountName"] == sa["metadata"]["name"] and "automountServiceAccountToken" not in worker
    default = render({})
    assert "ClusterRoleBinding" not in default
    assert [a["metadata"]["name"] for a in default["ServiceAccount"]] == [f"{RELEASE}-rollout-platform-tools"]
    assert worker_group(default)["template"]["spec"]["automountServiceAccountToken"] is False


# ---- the tool worker group (docs/kubernetes-tool-sandbox.md) ----

TOOLS_RESOURCE = "rollout_tools"


def ray_resources(param: str) -> dict[str, float]:
    """A rayStartParams `resources` value as `ray start` gets it after KubeRay's shell quoting."""
    import json
    import shlex

    (word,) = shlex.split(param)
    return json.loads(word)


def test_tool_group_offers_the_custom_resource_and_the_app_asks_for_it(case):
    name, values, objs = case
    g = tool_group(objs)
    if not merged(values)["toolWorkers"]["enabled"]:
        assert g is None and tools_network_policy(objs) is None
        assert config_from_serve_app(kube.serve_app(rayservice(objs))).tools.worker_resource is None
        assert "rollout_serve" not in rayservice(objs)["spec"]["serveConfigV2"]
        from rollout.app import control_actor_options

        assert control_actor_options(config_from_serve_app(kube.serve_app(rayservice(objs)))) == {"num_cpus": 0}
        return
    params = g["rayStartParams"]
    assert ray_resources(params["resources"]) == {TOOLS_RESOURCE: 1000}
    # Nothing that wants a CPU or GPU (engine replicas, vLLM workers) fits on a tool pod.
    assert params["num-cpus"] == "0" and params["num-gpus"] == "0"
    assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    cfg = config_from_serve_app(kube.serve_app(rayservice(objs)))
    assert cfg.tools.worker_resource == TOOLS_RESOURCE
    # The other groups do not offer it; they offer the resource the 0-CPU Serve deployments
    # (ingress, coordinator) are pinned to, which the tool pods do not.
    cluster = rayservice(objs)["spec"]["rayClusterConfig"]
    for other in [cluster["headGroupSpec"], worker_group(objs)]:
        assert ray_resources(other["rayStartParams"]["resources"]) == {"rollout_serve": 1000}
    # The ingress and the coordinator ask for it (rollout.app reads deployment.control_resource).
    from rollout.app import control_actor_options

    assert control_actor_options(cfg) == {"num_cpus": 0, "resources": {"rollout_serve": 0.001}}


def test_tool_pod_is_hardened_and_holds_no_credentials(case):
    name, values, objs = case
    if tool_group(objs) is None:
        return
    t = merged(values)["toolWorkers"]
    pod = tool_pod(objs)
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "tools"
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 1000 and psc["runAsUser"] != 0
    want = t["seccompProfile"] if t["seccompProfile"]["type"] == "Localhost" else {"type": t["seccompProfile"]["type"]}
    assert psc["seccompProfile"] == want
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == f"{RELEASE}-rollout-platform-tools"
    (sa,) = [a for a in objs["ServiceAccount"] if a["metadata"]["name"] == spec["serviceAccountName"]]
    assert sa["automountServiceAccountToken"] is False
    # No RBAC names it.
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for b in objs.get(kind, []):
            assert all(s["name"] != sa["metadata"]["name"] for s in b["subjects"]), b
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"] and c["resources"]["limits"]["cpu"]
    # Writable only where Ray needs it.
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp", "/dev/shm"}
    assert all("emptyDir" in v for v in spec["volumes"])
    # No credentials of any kind: no secret env, envFrom, secret or projected volume, and no
    # variable that even names the API key or sync token.
    text = yaml.safe_dump(pod)
    for needle in ("secretKeyRef", "secretRef", "secretName", "projected", "ROLLOUT_API_KEY", "ROLLOUT_SYNC_TOKEN", "model-cache"):
        assert needle not in text, needle
    for s in objs.get("Secret", []):
        for v in s["data"].values():
            assert base64.b64decode(v).decode() not in text
    assert "envFrom" not in c
    # Helm drops null values when merging: absent means "leave it to the runtime".
    assert ("procMount" in sc) == bool(t.get("procMount"))
    assert ("hostUsers" in spec) == (t.get("hostUsers") is not None)


def test_tool_pod_options_render_when_set():
    objs = render(MATRIX["tools-gvisor-userns"])
    spec = tool_pod(objs)["spec"]
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["hostUsers"] is False
    assert spec["containers"][0]["securityContext"]["procMount"] == "Unmasked"
    assert spec["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    # ...and only on the tool pod.
    others = [p for p in kube.embedded_objects(rayservice(objs)) if p["kind"] == "Pod" and not p["metadata"]["name"].endswith("-tools")]
    assert len(others) == 2
    for p in others:
        assert "runtimeClassName" not in p["spec"] and "hostUsers" not in p["spec"], p["metadata"]["name"]
        assert all("procMount" not in c["securityContext"] for c in p["spec"]["containers"])
    default = tool_pod(render({}))["spec"]
    assert "runtimeClassName" not in default and "hostUsers" not in default
    assert default["securityContext"]["seccompProfile"] == {"type": "Localhost", "localhostProfile": "rollout-platform/bwrap.json"}


def _peers_match(peer: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a same-namespace podSelector peer selects a pod with ``labels``."""
    if "namespaceSelector" in peer or "ipBlock" in peer:
        return False
    sel = peer["podSelector"]
    return sel.get("matchLabels", {}).items() <= labels.items() and not sel.get("matchExpressions")


def test_tools_network_policy_confines_the_tool_pods_to_ray():
    objs = render(MATRIX["network-policy"])
    np = tools_network_policy(objs)
    pod_labels = tool_pod(objs)["metadata"]["labels"]
    head_labels = [p for p in kube.embedded_objects(rayservice(objs)) if p["kind"] == "Pod" and p["metadata"]["name"].endswith("-head")][0]["metadata"]["labels"]
    sel = np["spec"]["podSelector"]
    assert sel["matchLabels"].items() <= pod_labels.items() and sel["matchLabels"]["app.kubernetes.io/component"] == "tools"
    assert set(np["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ray_pods = {"app.kubernetes.io/name": "rollout-platform", "app.kubernetes.io/instance": RELEASE}
    params = tool_group(objs)["rayStartParams"]
    allowed_ports = {6379, int(params["node-manager-port"]), int(params["object-manager-port"]), 53}
    for rule in np["spec"]["egress"]:
        ports = rule["ports"]
        assert ports, "an egress rule without ports opens every port"
        peers = rule.get("to")
        if peers is None:  # DNS only, to any destination
            assert {(p["port"], p["protocol"]) for p in ports} == {(53, "UDP"), (53, "TCP")}
            continue
        for peer in peers:
            assert _peers_match(peer, ray_pods | {"app.kubernetes.io/component": "worker"}) or _peers_match(peer, head_labels), peer
        for p in ports:
            assert p["protocol"] == "TCP"
            if "endPort" in p:
                assert (p["port"], p["endPort"]) == (int(params["min-worker-port"]), int(params["max-worker-port"]))
            else:
                assert p["port"] in allowed_ports
    # The GCS only on the head.
    (gcs,) = [r for r in np["spec"]["egress"] if {"port": 6379, "protocol": "TCP"} in r["ports"]]
    assert [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in gcs["to"]] == ["head"]
    # Every Ray pod pins the ports the policy names (Ray picks random ones otherwise).
    cluster = rayservice(objs)["spec"]["rayClusterConfig"]
    for g in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        for k in ("node-manager-port", "object-manager-port", "min-worker-port", "max-worker-port"):
            assert g["rayStartParams"][k] == params[k], (g.get("groupName", "head"), k)
    # Ingress: this release's Ray pods, and Prometheus on the metrics port only.
    for rule in np["spec"]["ingress"]:
        for peer in rule["from"]:
            if "podSelector" in peer and "namespaceSelector" not in peer:
                assert peer["podSelector"]["matchLabels"] == ray_pods
            else:
                assert rule["ports"] == [{"port": 8080, "protocol": "TCP"}]
    # Trainers are admitted to the engines by the main policy, which leaves the tool pods out.
    main = main_network_policy(objs)
    expr = main["spec"]["podSelector"]["matchExpressions"]
    assert {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["tools"]} in expr


def test_tools_network_policy_dns_peers_and_switch():
    objs = render(MATRIX["tools-gvisor-userns"])
    (dns,) = [r for r in tools_network_policy(objs)["spec"]["egress"] if {"port": 53, "protocol": "UDP"} in r["ports"]]
    assert dns["to"] == MATRIX["tools-gvisor-userns"]["toolWorkers"]["networkPolicy"]["dnsPeers"]
    assert tools_network_policy(render({"toolWorkers": {"networkPolicy": {"enabled": False}}})) is None


def test_auth_required_refuses_to_render_without_keys():
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmError) as err:
            chart.render({"secrets": {"create": False}}, name=RELEASE, namespace=NAMESPACE)
    msg = str(err.value)
    assert "auth.required is true but no API key or sync token is configured" in msg
    assert "secrets.existingSecret" in msg and "auth.required: false" in msg
    # With a Secret, the app is told to require the sync token (not left to its environment).
    assert config_from_serve_app(kube.serve_app(rayservice(render({})))).sync.require_token is True
    # Opting out renders, with no Secret anywhere and a warning in the notes.
    objs = render(MATRIX["auth-not-required"])
    assert config_from_serve_app(kube.serve_app(rayservice(objs))).sync.require_token is None
    assert "Secret" not in objs and "secretKeyRef" not in yaml.safe_dump(rayservice(objs))
    assert "auth.required is false" in objs["NOTES"]
    # Opting out while keys exist changes nothing: the keys are still used.
    keyed = render({"auth": {"required": False}})
    assert "Secret" in objs or "Secret" in keyed
    env = {e["name"] for e in worker_group(keyed)["template"]["spec"]["containers"][0]["env"]}
    assert {"ROLLOUT_API_KEY", "ROLLOUT_SYNC_TOKEN"} <= env


def test_seccomp_profile_shipped_for_the_tool_pods_allows_bwrap_and_nothing_wide():
    import json

    profile = json.loads((CHART / "files" / "seccomp" / "bwrap.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    unconditional = {n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and "args" not in r for n in r["names"]}
    # What bubblewrap calls to build its namespaces and root (RuntimeDefault denies these
    # without CAP_SYS_ADMIN), plus what any process needs.
    assert {"clone", "unshare", "mount", "umount2", "pivot_root", "chroot", "sethostname", "setns", "prctl", "seccomp", "execve", "capset"} <= unconditional
    # Still refused, as under RuntimeDefault (and ptrace, which RuntimeDefault allows).
    assert not {"bpf", "keyctl", "add_key", "request_key", "kexec_load", "init_module", "finit_module", "ptrace", "process_vm_writev", "perf_event_open", "userfaultfd", "open_by_handle_at", "reboot", "swapon", "acct"} & unconditional
    (c3,) = [r for r in profile["syscalls"] if r["names"] == ["clone3"]]
    assert c3["action"] == "SCMP_ACT_ERRNO" and c3["errnoRet"] == 38  # ENOSYS: glibc falls back to clone
    # The values point at it by the path the docs tell admins to install it under.
    assert merged({})["toolWorkers"]["seccompProfile"]["localhostProfile"] == "rollout-platform/bwrap.json"
    assert "rollout-platform/bwrap.json" in (ROOT / "docs" / "kubernetes-tool-sandbox.md").read_text()


def test_ray_token_authentication_is_on_with_its_token_in_the_charts_secret():
    """KubeRay's authOptions: every Ray container gets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN
    from the Secret's auth_token key (KubeRay's), so a pod without the token reaches no
    Ray service; the token is kept across upgrades like the other generated keys."""
    objs = render({})
    (secret,) = objs["Secret"]
    assert rayservice(objs)["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": secret["metadata"]["name"]}
    assert len(base64.b64decode(secret["data"]["auth_token"])) >= 32
    given = "t" * 40
    (secret,) = render({"rayAuth": {"token": given}})["Secret"]
    assert base64.b64decode(secret["data"]["auth_token"]).decode() == given
    # A Secret of the user's must hold the key itself: the chart names it, makes none.
    existing = render(MATRIX["existing-secret"])
    assert rayservice(existing)["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "my-rollout-secrets" and "Secret" not in existing
    off = render({"rayAuth": {"enabled": False}})
    assert "authOptions" not in rayservice(off)["spec"]["rayClusterConfig"] and "auth_token" not in off["Secret"][0]["data"]


def test_trainers_reach_the_ray_pods_only_on_the_serve_port_and_the_pinned_sync_range():
    """Weight sync (docs/sync-ports.md): the Ray pods' ephemeral range is pinned by
    their sysctl, and the policy opens to trainers exactly that range besides Serve's port."""
    values = MATRIX["network-policy"]
    objs = render(values)
    trainer = values["networkPolicy"]["trainerPodLabels"]
    from_trainer = [r for r in main_network_policy(objs)["spec"]["ingress"] if any(p.get("podSelector", {}).get("matchLabels") == trainer for p in r["from"])]
    assert sorted((r["ports"] for r in from_trainer), key=str) == [
        [{"port": 40000, "endPort": 44999, "protocol": "TCP"}],
        [{"port": 8000, "protocol": "TCP"}],
    ], from_trainer
    pods = {p["metadata"]["name"].rsplit("-", 1)[-1]: p for p in kube.embedded_objects(rayservice(objs)) if p["kind"] == "Pod"}
    for role in ("head", "workers"):
        matching = [p for name, p in pods.items() if name == role or (role == "workers" and name not in ("head", "tools"))]
        assert matching, pods.keys()
        for p in matching:
            assert {"name": "net.ipv4.ip_local_port_range", "value": "40000 44999"} in p["spec"]["securityContext"].get("sysctls", []), p["metadata"]["name"]
    assert "sysctls" not in tool_pod(objs)["spec"]["securityContext"], "the tool pods take no weight sync"
    # A trainer that joins the Ray cluster (WeightPublisher.connect) needs every port.
    everything = render({**values, "networkPolicy": {**values["networkPolicy"], "weightSyncPorts": "all"}})
    rules = [r for r in main_network_policy(everything)["spec"]["ingress"] if any(p.get("podSelector", {}).get("matchLabels") == trainer for p in r["from"])]
    assert sorted(str(r.get("ports")) for r in rules) == sorted([str([{"port": 8000, "protocol": "TCP"}]), "None"])
    # No publishing: Serve's port only.
    rollouts_only = render({**values, "networkPolicy": {**values["networkPolicy"], "allowTrainerWeightSync": False}})
    rules = [r for r in main_network_policy(rollouts_only)["spec"]["ingress"] if any(p.get("podSelector", {}).get("matchLabels") == trainer for p in r["from"])]
    assert [r["ports"] for r in rules] == [[{"port": 8000, "protocol": "TCP"}]]


def test_a_pinned_sync_range_needs_the_ray_pods_range_and_says_which_values():
    values = {**MATRIX["network-policy"], "syncPorts": {"ephemeral": ""}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert "networkPolicy.weightSyncPorts: pinned needs syncPorts.ephemeral" in str(err.value)
    assert "networkPolicy.weightSyncPorts: all" in str(err.value)
    objs = render({"syncPorts": {"ephemeral": ""}})  # no policy: nothing to open, no sysctl
    assert all("sysctls" not in p["spec"].get("securityContext", {}) for p in kube.embedded_objects(rayservice(objs)) if p["kind"] == "Pod")
    with pytest.raises(helm.HelmError, match="syncPorts"):
        render_chart({"syncPorts": {"ephemeral": "40000:44999"}})


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_ray_workers_run_at_the_platforms_niceness_on_the_head_and_engine_pods(case):
    """Issue 41: Ray starts its workers at nice 15, the engine core among them; the chart's
    Ray containers give them rollout.local.RAY_WORKER_ENV, as `rollout serve` does its own
    cluster's (tests/test_cli_serve.py)."""
    from rollout.local import RAY_WORKER_ENV

    _, _, objs = case
    spec = rayservice(objs)["spec"]["rayClusterConfig"]
    for container in (spec["headGroupSpec"]["template"]["spec"]["containers"][0], worker_group(objs)["template"]["spec"]["containers"][0]):
        env = env_of(container)
        assert {k: env.get(k) for k in RAY_WORKER_ENV} == RAY_WORKER_ENV, container["name"]


# Every cache an engine start fills (rollout.compileCacheEnv), by the directory under compileCache.mountPath.
COMPILE_CACHE_ENV = COMPILE_CACHE_DIRS


@pytest.mark.parametrize(
    "compile_cache, volume",
    [
        ({}, {"emptyDir": {"sizeLimit": "50Gi"}}),
        ({"source": "modelCache", "subPath": "jit"}, None),
        ({"source": "existingClaim", "existingClaim": "rl-jit", "mountPath": "/jit"}, {"persistentVolumeClaim": {"claimName": "rl-jit"}}),
    ],
)
def test_engine_pods_keep_vllms_compile_and_kernel_caches_on_the_compile_cache_volume(compile_cache, volume):
    """Issue 41: a replica that starts again finds what the last one compiled and built
    (vLLM's compile cache, FlashInfer's, Triton's, CUDA's) on a volume its pod's replicas
    share: per pod (emptyDir), or every pod's (a subdirectory of the model-cache claim, or
    a claim of the operator's)."""
    from vllm import envs

    objs = render({"compileCache": compile_cache})
    values = merged({"compileCache": compile_cache})["compileCache"]
    spec = worker_group(objs)["template"]["spec"]
    (container,) = spec["containers"]
    env = env_of(container)
    assert {k: env.get(k) for k in COMPILE_CACHE_ENV} == {k: f"{values['mountPath']}/{d}" for k, d in COMPILE_CACHE_ENV.items()}
    # None of them may change vLLM's compile-cache key (or the replicas would compile anew):
    # VLLM_CACHE_ROOT is one vLLM leaves out by name; the others are not vLLM's.
    assert [k for k in COMPILE_CACHE_ENV if k.startswith("VLLM_") and k in envs.compile_factors()] == []
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[values["mountPath"]]
    volumes = {v["name"]: v for v in spec["volumes"]}
    if volume is None:  # a subdirectory of the model cache's claim
        assert mount["name"] == "model-cache" and mount["subPath"] == values["subPath"] and not mount.get("readOnly")
    else:
        assert {k: v for k, v in volumes[mount["name"]].items() if k != "name"} == volume
    # The head compiles nothing.
    head = env_of(rayservice(objs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0])
    assert not set(COMPILE_CACHE_ENV) & set(head)
    off = worker_group(render({"compileCache": {"enabled": False}}))["template"]["spec"]
    assert not set(COMPILE_CACHE_ENV) & set(env_of(off["containers"][0])) and "compile-cache" not in {v["name"] for v in off["volumes"]}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"compileCache": {"source": "modelCache"}, "modelCache": {"readOnly": True}}, "compileCache.source is modelCache"),
        ({"compileCache": {"source": "modelCache"}, "modelCache": {"enabled": False}}, "compileCache.source is modelCache"),
        ({"compileCache": {"source": "existingClaim"}}, "compileCache.existingClaim names no claim"),
        ({"compileCache": {"mountPath": "/models"}}, "compileCache.mountPath (/models) must differ from modelCache.mountPath"),
    ],
)
def test_a_compile_cache_that_cannot_be_mounted_fails_naming_the_values(values, message):
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert message in str(err.value)


@pytest.mark.parametrize("http, want", [({}, ("0", "0")), ({"front_door": "haproxy", "throughput_optimized": True}, ("1", "1"))])
def test_every_ray_container_runs_serve_with_the_configs_front_door(http, want):
    """Serve reads its front door from each process's environment (rollout.http.front_door):
    every Ray container (head, engine workers, tool workers) gets it from platform.http, the
    same config the app's ingress checks it against."""
    from rollout.config import load_config
    from rollout.http.front_door import serve_env

    values = {"platform": {"http": http}, "toolWorkers": {"enabled": True}}
    objs = render(values)
    pods = [o for o in kube.embedded_objects(rayservice(objs)) if o["kind"] == "Pod"]
    assert len(pods) == 3, [p["metadata"]["name"] for p in pods]
    expected = serve_env(load_config({"model": {"path": "/m"}, "http": http}, environ={}).http)
    assert tuple(expected.values()) == want
    for pod in pods:
        for c in pod["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert {k: env.get(k) for k in expected} == expected, (pod["metadata"]["name"], c["name"])
