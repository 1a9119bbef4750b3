"""The image and what deploys it agree, read without building the image: the Dockerfile's
final stage against the Helm chart rendered by the real Helm engine (default values and every
case of tests/test_helm_chart.py's matrix) and against k8s/base. The user, the writable paths
(HOME and the caches, under the chart's emptyDir mounts; the root filesystem is read-only),
the ports, the command KubeRay runs in every Ray container, and the health check's route.
`make image-test` then runs the built image the same way (tests/image/run.sh)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import manifest_checks as kube
from tests.test_dockerfile import FINAL, STAGES, instructions

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# What KubeRay runs in each Ray container (head, workers, the autoscaler, its wait-gcs-ready
# init container): a login shell, `/bin/bash -lc -- "ulimit -n 65536; ray start ..."`.
KUBERAY_COMMAND = ["/bin/bash", "-lc", "--"]


def kv_pairs(args: str) -> dict[str, str]:
    """ENV/ARG/LABEL arguments (`K=V K2="V 2"` or `K V`) as a dict."""
    tokens = shlex.split(args)
    if len(tokens) == 2 and "=" not in tokens[0]:
        return {tokens[0]: tokens[1]}
    return dict(t.split("=", 1) if "=" in t else (t, "") for t in tokens)


def final_stage_chain() -> list[list[tuple[str, str]]]:
    """The final stage and the stages it is built FROM, base first."""
    by_name = {s[0][1].split()[-1]: s for s in STAGES if " AS " in s[0][1].upper()}
    chain = [FINAL]
    while (parent := chain[0][0][1].split()[0]) in by_name:
        chain.insert(0, by_name[parent])
    return chain


def image_config() -> dict[str, Any]:
    chain = final_stage_chain()
    env: dict[str, str] = {}
    for stage in chain:
        for word, args in stage:
            if word == "ENV":
                for k, v in kv_pairs(args).items():
                    env[k] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), v)
    (user,) = [args for word, args in FINAL if word == "USER"][-1:]
    uid, _, gid = user.partition(":")
    ports = {int(p.split("/")[0]) for word, args in FINAL if word == "EXPOSE" for p in args.split()}
    runs = " ".join(args for stage in chain for word, args in stage if word == "RUN")
    cmd = [args for word, args in FINAL if word == "CMD"]
    entrypoint = [args for word, args in FINAL if word == "ENTRYPOINT"]
    health = [args for word, args in FINAL if word == "HEALTHCHECK"]
    return {"env": env, "uid": int(uid), "gid": int(gid or uid), "ports": ports, "runs": runs, "cmd": cmd, "entrypoint": entrypoint, "health": health}


IMAGE = image_config()


def under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


# ---- the Dockerfile alone: one file, its base and vLLM build arguments ----


def test_one_dockerfile_base_and_vllm_are_build_arguments():
    """The published image's base (CUDA) and vLLM build (gpu) are the defaults; every stage
    starts FROM that base, so CI's build (BASE=Debian, VLLM=cpu) differs in its arguments only."""
    before_from = []
    for word, args in instructions(DOCKERFILE):
        if word == "FROM":
            break
        before_from.append((word, args))
    global_args = {k: v for word, args in before_from if word == "ARG" for k, v in kv_pairs(args).items()}
    assert global_args["BASE"].startswith("nvidia/cuda:") and "-runtime-ubuntu" in global_args["BASE"], global_args
    assert global_args["VLLM"] == "gpu", global_args
    names = set()
    for stage in STAGES:
        frm = stage[0][1].split()
        assert frm[0] in ("${BASE}", "$BASE") or frm[0] in names, f"stage FROM {frm[0]}: neither the BASE argument nor an earlier stage"
        names.add(frm[-1])
    # The final stage reads the argument; an unknown value fails the build rather than
    # falling back to one of the two.
    assert ("ARG", "VLLM") in FINAL
    assert re.search(r'case "\$VLLM" in gpu\|cpu\) ;; \*\) echo "VLLM=\$VLLM: expected gpu or cpu" >&2; exit 1', IMAGE["runs"]), "no check of VLLM's value"


def test_the_cpu_build_installs_the_cpu_extra_as_make_install_does():
    make = (ROOT / "Makefile").read_text()
    removed = re.search(r"pip uninstall --yes --quiet (torchvision torchaudio torchcodec)", make).group(1)
    assert f"pip uninstall --yes {removed}" in IMAGE["runs"]
    assert 'optional-dependencies"][sys.argv[1]]' in IMAGE["runs"] and '"$VLLM"' in IMAGE["runs"]


# ---- the image against the chart and k8s/ ----


def rendered_chart_cases() -> dict[str, list[dict[str, Any]]]:
    pytest.importorskip("helm_python", reason="helm-python-sdk not installed (test extra)")
    from tests.test_helm_chart import CASE_APIS, MATRIX, all_objects, render

    return {name: all_objects(render(values, CASE_APIS.get(name, ()))) for name, values in MATRIX.items()}


@pytest.fixture(scope="module")
def chart_cases() -> dict[str, list[dict[str, Any]]]:
    return rendered_chart_cases()


@pytest.fixture(scope="module")
def kustomize_base() -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all((ROOT / "k8s" / "base" / "rayservice.yaml").read_text()) if o]


def platform_pods(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod, container) for every container that runs the platform's image, and the
    RayService's autoscaler options (KubeRay runs the autoscaler in the head's image) as a
    container of the head pod."""
    out = []
    for obj in objects:
        if obj["kind"] != "RayService":
            continue
        pods = [p for p in kube.embedded_objects(obj) if p["kind"] == "Pod"]
        for pod in pods:
            for c in pod["spec"]["containers"]:
                if "rollout-platform" in c["image"]:
                    out.append((pod, c))
        auto = obj["spec"]["rayClusterConfig"].get("autoscalerOptions")
        if auto:
            (head,) = [p for p in pods if p["metadata"]["name"].endswith("-head")]
            out.append((head, {"name": "autoscaler", **auto}))
    assert out, "no container runs the platform's image"
    return out


def check_against_the_image(pod: dict[str, Any], c: dict[str, Any]) -> None:
    where = f"{pod['metadata']['name']}/{c['name']}"
    # KubeRay sets the command of every Ray container: the chart must leave it unset.
    assert "command" not in c and "args" not in c, f"{where}: sets command/args; KubeRay runs {KUBERAY_COMMAND}"
    sc, psc = c.get("securityContext", {}), pod["spec"].get("securityContext", {})
    uid = sc.get("runAsUser", psc.get("runAsUser"))
    gid = sc.get("runAsGroup", psc.get("runAsGroup", IMAGE["gid"]))
    assert (uid, gid) == (IMAGE["uid"], IMAGE["gid"]), f"{where}: runs as {uid}:{gid}, the image's USER is {IMAGE['uid']}:{IMAGE['gid']}"
    assert sc.get("readOnlyRootFilesystem") is True, f"{where}: the root filesystem is not read-only"
    # Writable: the container's mounts that are not read-only (emptyDirs).
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = [m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly") and "emptyDir" in volumes.get(m["name"], {})]
    # (KubeRay gives the autoscaler its mounts: the chart sets only its user, env and securityContext.)
    assert "/tmp" in mounts or c["name"] == "autoscaler", f"{where}: no writable /tmp"
    env = {e["name"]: e.get("value") for e in c.get("env", []) if "value" in e}
    for name in ("HOME", "XDG_CACHE_HOME"):
        if name in env:
            assert env[name] == IMAGE["env"][name], f"{where}: {name}={env[name]}, the image's is {IMAGE['env'][name]}"
    for name in ("HOME", "XDG_CACHE_HOME"):
        value = env.get(name, IMAGE["env"][name])
        if c["name"] != "autoscaler":
            assert under(value, mounts), f"{where}: {name}={value} is not under a writable mount ({mounts})"
    ports = {p["containerPort"] for p in c.get("ports", [])}
    assert ports <= IMAGE["ports"], f"{where}: ports {sorted(ports - IMAGE['ports'])} not EXPOSEd by the image"


def test_the_image_is_what_kuberay_runs():
    """KubeRay's login shell finds the venv (Debian's /etc/profile resets PATH for uid 1000);
    the image has no ENTRYPOINT, which KubeRay's command would be handed to."""
    assert IMAGE["entrypoint"] == []
    env = IMAGE["env"]
    assert env["PATH"].split(":")[0] == f"{env['VIRTUAL_ENV']}/bin"
    assert f"echo 'PATH={env['VIRTUAL_ENV']}/bin:$PATH; export PATH' > /etc/profile.d/" in IMAGE["runs"]
    # The user has a home where the chart's HOME is (useradd's --home-dir).
    assert f"useradd --uid {IMAGE['uid']} --gid {IMAGE['gid']} --no-create-home --home-dir {env['HOME']}" in IMAGE["runs"]


def test_chart_containers_agree_with_the_image(chart_cases):
    for name, objects in chart_cases.items():
        for pod, c in platform_pods(objects):
            try:
                check_against_the_image(pod, c)
            except AssertionError as exc:
                raise AssertionError(f"chart case {name!r}: {exc}") from None


def test_the_chart_uses_every_port_the_image_exposes(chart_cases):
    used = {p["containerPort"] for objects in chart_cases.values() for _, c in platform_pods(objects) for p in c.get("ports", [])}
    assert used == IMAGE["ports"], f"EXPOSEd but unused: {sorted(IMAGE['ports'] - used)}; used but not EXPOSEd: {sorted(used - IMAGE['ports'])}"


def test_the_health_check_is_the_charts_probe(chart_cases):
    """The image's HEALTHCHECK asks the route and port the chart's startup probe asks."""
    (health,) = IMAGE["health"]
    m = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", health)
    assert m, health
    for _, c in platform_pods(chart_cases["default"]):
        probe = c.get("startupProbe", {}).get("httpGet", {})
        if probe.get("port") == "serve":
            serve_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "serve")
            assert (int(m.group(1)), m.group(2)) == (serve_port, probe["path"]), (health, probe)
            return
    raise AssertionError("no container probes the serve port")


def test_k8s_base_agrees_with_the_image(kustomize_base):
    for pod, c in platform_pods(kustomize_base):
        check_against_the_image(pod, c)


def test_the_check_catches_a_disagreement(chart_cases):
    """What the checks above catch: another user, HOME outside the writable mounts, an
    unexposed port, a command set by the chart."""
    pod, c = platform_pods(chart_cases["default"])[0]
    bad = [
        {**c, "securityContext": {**c["securityContext"], "runAsUser": 1001}},
        {**c, "env": [*c.get("env", []), {"name": "HOME", "value": "/home/rollout"}]},
        {**c, "ports": [*c.get("ports", []), {"name": "x", "containerPort": 9999}]},
        {**c, "command": ["rollout", "serve"]},
        {**c, "securityContext": {**c["securityContext"], "readOnlyRootFilesystem": False}},
    ]
    for container in bad:
        with pytest.raises(AssertionError):
            check_against_the_image(pod, container)
