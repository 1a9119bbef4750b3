"""Plain manifests under k8s/ (kustomize base, GPU overlay, example trainer Job,
monitoring files), checked offline like the Helm chart's output."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (test extra)")
pytest.importorskip("jsonschema", reason="jsonschema not installed (test extra)")

from tests import manifest_checks as kube  # noqa: E402
from rollout.app import config_from_serve_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"


def kustomize(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` output; without kubectl the base's resources are read directly
    (kustomize's namespace applied) and overlays are skipped."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return kube.load_manifests(out.stdout)
    spec = yaml.safe_load((path / "kustomization.yaml").read_text())
    if spec.get("patches") or any(r.startswith("..") for r in spec["resources"]):
        pytest.skip("kubectl (for `kubectl kustomize`) not found: overlays are not built")
    objs = [o for r in spec["resources"] for o in kube.load_manifests((path / r).read_text())]
    for o in objs:
        if o["kind"] != "Namespace":
            o["metadata"]["namespace"] = spec["namespace"]
    return objs


@pytest.fixture(scope="module", params=["base", "overlays/gpu"])
def built(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(K8S / request.param)


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def test_objects_validate(built):
    name, objs = built
    kinds = {o["kind"] for o in objs}
    assert {"RayService", "Service", "NetworkPolicy", "PersistentVolumeClaim"} <= kinds
    errors = []
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "rollout"
        if o["kind"] not in kube.CRD_KINDS:
            errors += kube.core_errors(o)
    (rs,) = by_kind(objs, "RayService")
    for o in kube.embedded_objects(rs):
        errors += kube.core_errors(o)
    crd = kube.kuberay_crd_dir() / "ray.io_rayservices.yaml"
    if crd.exists():
        errors += kube.crd_errors(rs, crd)
    assert errors == [], name


def test_serve_config_and_secrets(built):
    name, objs = built
    (rs,) = by_kind(objs, "RayService")
    app = kube.serve_app(rs)
    assert app["import_path"] == "rollout.app:build"
    cfg = config_from_serve_app(app)
    assert cfg.app_name == app["name"] == "rollout"
    example = yaml.safe_load((K8S / "base" / "secret.example.yaml").read_text())
    keys = set(example["stringData"])
    assert not any(v in rs["spec"]["serveConfigV2"] for v in example["stringData"].values())
    pods = [p for p in kube.embedded_objects(rs) if p["kind"] == "Pod"]
    for c in [c for p in pods if not p["metadata"]["name"].endswith("-tools") for c in kube.containers(p)]:
        env = {e["name"]: e for e in c["env"]}
        for var in ("ROLLOUT_API_KEY", "ROLLOUT_SYNC_TOKEN"):
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == example["metadata"]["name"] and ref["key"] in keys
    assert not by_kind(objs, "Secret"), "the example Secret must not be applied from kustomize"
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["groupName"] != "tools"
    gpus = worker["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
    if name == "overlays/gpu":
        assert cfg.model.device == "cuda" and gpus >= cfg.model.tensor_parallel_size
        a = cfg.deployment.autoscaling
        assert (worker["minReplicas"], worker["maxReplicas"]) == (a.min_replicas, a.max_replicas)
        assert worker["rayStartParams"]["num-gpus"] == str(gpus)
        assert not any("num_replicas" in d for d in app.get("deployments", [])), "Serve rejects num_replicas next to an autoscaling_config"
    else:
        assert cfg.model.device == "cpu" and gpus == 0
        # The replica count is a deployments override, not args (which restart the app).
        assert "replicas" not in app["args"]["deployment"]
        assert worker["minReplicas"] == worker["maxReplicas"] == cfg.deployment.replicas


def test_trainer_job():
    job, policy = kube.load_manifests((K8S / "examples" / "trainer-job.yaml").read_text())
    assert job["kind"] == "Job" and kube.core_errors(job) == []
    assert policy["kind"] == "NetworkPolicy" and kube.core_errors(policy) == []
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"]["rollout-platform/role"] == "trainer"
    (c,) = pod["spec"]["containers"]
    script = c["args"][0]
    compile(script, "trainer-job.yaml", "exec")
    assert "RolloutClient.http(" in script
    assert 'WeightPublisher.connect(app_name="rollout", backend="nccl")' in script
    env = {e["name"]: e for e in c["env"]}
    assert "value" not in env["ROLLOUT_API_KEY"] and env["ROLLOUT_API_KEY"]["valueFrom"]["secretKeyRef"]
    # A driver needs a Ray node of its own host, joined with both halves of Ray's token auth.
    assert c["command"][:2] == ["sh", "-c"] and c["command"][2].startswith('ray start --address="$RAY_ADDRESS" --num-cpus=0 --num-gpus=0')
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "rollout-secrets", "key": "auth_token"}


def test_monitoring_assets_are_generated_from_rollout_monitoring():
    from rollout.monitoring import render

    stale = [str(p) for p, text in render().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"stale: {stale}; run `rollout monitoring-assets`"


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    out = subprocess.run([promtool, "check", "rules", str(K8S / "monitoring" / "rollout-rules.yaml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_alert_signal_pads_itself_with_data():
    from rollout.monitoring import ALERTS

    # A signal ending in `or vector(0)` has data whether or not the platform reports: the e2e
    # test that every signal returns data could not fail. Absence fires through
    # fires_when_absent. (A padded numerator is fine: the ratio still needs its denominator.)
    assert [a.name for a in ALERTS if a.signal.replace(" ", "").endswith("vector(0)")] == []


def test_no_ready_replica_fires_when_nothing_reports_and_not_while_a_replica_does(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    from rollout.monitoring import ALERTS

    (alert,) = [a for a in ALERTS if a.name == "RolloutNoReadyReplica"]
    fired = [{"exp_labels": {"severity": alert.severity}, "exp_annotations": {"summary": alert.summary, "description": alert.description}}]
    case = lambda series, expected: {  # noqa: E731
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [{"eval_time": "15m", "alertname": alert.name, "exp_alerts": expected}],
    }
    tests = {
        "rule_files": [str(K8S / "monitoring" / "rollout-rules.yaml")],
        "evaluation_interval": "1m",
        "tests": [
            case([], fired),  # no replica has ever reported
            case([{"series": 'ray_rollout_engine_running{replica="a"}', "values": "1x20"}], []),
            case([{"series": 'ray_rollout_engine_running{replica="a"}', "values": "1x2 stale"}], fired),  # it stopped
        ],
    }
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_never_uses_metric_names_vllm_dropped():
    dash = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    # Names vLLM dropped in v1 leave panels empty (field notes): never use them.
    assert "gpu_cache_usage_perc" not in exprs and "gpu_prefix_cache" not in exprs and "vllm:" not in exprs
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert {v["name"] for v in dash["templating"]["list"]} >= {"namespace", "app", "replica"}


def test_checkov(tmp_path, built):
    if kube.checkov_binary() is None:
        pytest.skip("checkov not found on PATH or in .venv-tools (see helm/rollout-platform/README.md)")
    name, objs = built
    (rs,) = by_kind(objs, "RayService")
    flat = objs + kube.embedded_objects(rs) + kube.load_manifests((K8S / "examples" / "trainer-job.yaml").read_text())
    for i, o in enumerate(flat):
        (tmp_path / f"{i:02d}-{o['kind'].lower()}.yaml").write_text(yaml.safe_dump(o))
    failed = kube.unwaived(kube.run_checkov(tmp_path, kube.CHECKOV_SKIPS))
    assert failed == [], [(f["check_id"], f["check_name"], f["resource"]) for f in failed]


def test_tool_workers_mirror_the_chart(built):
    """The tool worker group, its ServiceAccount and NetworkPolicy match what the Helm chart
    renders for the same release (name and instance `rollout`), so both install paths get
    the same hardened pod; and the serve config pins tools and the 0-CPU deployments (deployment.control_resource)."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (test extra)")
    name, objs = built
    with helm.Chart.load(ROOT / "helm" / "rollout-platform") as chart:
        out = chart.render({"fullnameOverride": "rollout"}, name="rollout", namespace="rollout", is_install=True)
    chart_objs = [o for p, t in out.items() if not p.endswith("NOTES.txt") for o in kube.load_manifests(t)]
    (chart_rs,) = by_kind(chart_objs, "RayService")
    (rs,) = by_kind(objs, "RayService")

    def group(r, g):
        (x,) = [w for w in r["spec"]["rayClusterConfig"]["workerGroupSpecs"] if w["groupName"] == g]
        return x

    assert group(rs, "tools") == group(chart_rs, "tools")
    # Every group pins the ports the tool NetworkPolicy names, like the chart's.
    ports = ("node-manager-port", "object-manager-port", "min-worker-port", "max-worker-port", "resources")
    for mine, theirs in [(rs["spec"]["rayClusterConfig"]["headGroupSpec"], chart_rs["spec"]["rayClusterConfig"]["headGroupSpec"]),
                         (rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0], chart_rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0])]:
        assert {k: mine["rayStartParams"][k] for k in ports} == {k: theirs["rayStartParams"][k] for k in ports}
    np = [o for o in by_kind(objs, "NetworkPolicy") if o["metadata"]["name"] == "rollout-tools"]
    (chart_np,) = [o for o in by_kind(chart_objs, "NetworkPolicy") if o["metadata"]["name"] == "rollout-tools"]
    assert len(np) == 1 and np[0]["spec"] == chart_np["spec"]
    (main,) = [o for o in by_kind(objs, "NetworkPolicy") if o["metadata"]["name"] == "rollout"]
    assert {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["tools"]} in main["spec"]["podSelector"]["matchExpressions"]
    (sa,) = by_kind(objs, "ServiceAccount")
    assert sa["metadata"]["name"] == "rollout-tools" and sa["automountServiceAccountToken"] is False
    app, chart_app = kube.serve_app(rs), kube.serve_app(chart_rs)
    assert config_from_serve_app(app).tools.worker_resource == "rollout_tools"
    assert config_from_serve_app(app).sync.require_token is True
    from rollout.app import control_actor_options

    # The 0-CPU ingress and coordinator ask for the resource only non-tool nodes offer, as in the chart.
    assert control_actor_options(config_from_serve_app(app)) == control_actor_options(config_from_serve_app(chart_app)) == {"num_cpus": 0, "resources": {"rollout_serve": 0.001}}
