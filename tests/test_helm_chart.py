"""The Helm chart, rendered by the real Helm engine (helm-python-sdk), checked offline.

No cluster here: every rendered object is validated against the Kubernetes API schemas
(kubernetes-validate) and the RayService against the KubeRay CRD; the Serve config must
parse back into PlatformConfig; checkov scans for insecure pods. What only a cluster can
show (pods starting, the operator reconciling, probes passing) is not tested.
"""

from __future__ import annotations

import base64
import copy
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
}


def merged(values: dict[str, Any]) -> dict[str, Any]:
    """Chart defaults with ``values`` on top, like `helm install -f`."""
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def render(values: dict[str, Any]) -> dict[str, Any]:
    """Rendered objects keyed by kind (lists), plus NOTES under "NOTES"."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
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
    return request.param, values, render(values)


def rayservice(objs) -> dict[str, Any]:
    (rs,) = objs["RayService"]
    return rs


def worker_group(objs) -> dict[str, Any]:
    (g,) = rayservice(objs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return g


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
    assert three["deployments"] == [{"name": "RolloutEngine", "num_replicas": 3}]
    assert config_from_serve_app(three).deployment.replicas == 3
    # Autoscaling stays in args; Serve rejects num_replicas next to an autoscaling_config.
    auto = kube.serve_app(rayservice(render(MATRIX["tp2-autoscale"])))
    assert "deployments" not in auto and auto["args"]["deployment"] == MATRIX["tp2-autoscale"]["platform"]["deployment"]


def test_secrets_by_reference_only(case):
    name, values, objs = case
    rs = rayservice(objs)
    secret = values.get("secrets", {}).get("existingSecret") or f"{RELEASE}-rollout-platform-secrets"
    secret_values = [API_KEY, SYNC_TOKEN]
    for s in objs.get("Secret", []):
        secret_values += [base64.b64decode(v).decode() for v in s["data"].values()]
    assert all(s not in rs["spec"]["serveConfigV2"] for s in secret_values)
    assert "api_key" not in rs["spec"]["serveConfigV2"]
    for c in kube.containers(rs):
        env = {e["name"]: e for e in c["env"]}
        for var in ("ROLLOUT_API_KEY", "ROLLOUT_SYNC_TOKEN"):
            assert "value" not in env[var], (c["name"], var)
            assert env[var]["valueFrom"]["secretKeyRef"]["name"] == secret
        assert not any(e.get("value") in secret_values for e in c["env"])
    if values.get("secrets", {}).get("create") is False:
        assert "Secret" not in objs
    else:
        (s,) = objs["Secret"]
        assert set(s["data"]) == {"api-key", "sync-token"}


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
    assert len(objs.get("NetworkPolicy", [])) == int(merged(values)["networkPolicy"]["enabled"])
    (pdb,) = objs["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert "RolloutClient.http(" in objs["NOTES"]
    (test_pod,) = objs["Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["args"][0].endswith(f":{cfg.http.port}/healthz")


def test_network_policy_admits_only_trainers_to_serve_port():
    values = MATRIX["network-policy"]
    objs = render(values)
    (np,) = objs["NetworkPolicy"]
    trainer = values["networkPolicy"]["trainerPodLabels"]
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
    objs = render({"monitoring": {"dashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}})
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
        objs = render(values)
        flat = all_objects(objs) + kube.embedded_objects(rayservice(objs))
        d = tmp_path / name
        d.mkdir()
        for i, o in enumerate(flat):
            (d / f"{i:02d}-{o['kind'].lower()}.yaml").write_text(yaml.safe_dump(o))
    failed = kube.run_checkov(tmp_path, CHECKOV_SKIPS)
    assert failed == [], [(f["check_id"], f["check_name"], f["resource"]) for f in failed]
    readme = (CHART / "README.md").read_text()
    for check in CHECKOV_SKIPS:
        assert check in readme, f"{check} is skipped but not explained in the chart README"


def test_service_account_auth_gives_the_coordinator_token_review_rights_only():
    objs = render(MATRIX["service-account-auth"])
    (sa,) = objs["ServiceAccount"]
    (binding,) = objs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "system:auth-delegator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    spec = rayservice(objs)["spec"]["rayClusterConfig"]
    assert spec["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    worker = worker_group(objs)["template"]["spec"]
    assert worker["serviceAccountName"] == sa["metadata"]["name"] and "automountServiceAccountToken" not in worker
    default = render({})
    assert "ClusterRoleBinding" not in default and "ServiceAccount" not in default
    assert worker_group(default)["template"]["spec"]["automountServiceAccountToken"] is False
