"""The Dockerfile, read as text: pins match pyproject.toml and the GPU check's
(tests/gpu/overlay-pins.txt), the final stage is non-root, carries no build tools, has OCI
labels and a health check; and its GPU build's `pip install` resolves (pip's dry run, PyPI
metadata only) for the published image's own Python and platform (the default BASE, CUDA's
Ubuntu image, which cannot be pulled here), so an image that cannot build fails here. CI
builds and runs the CPU build of the same file (`make image image-test`; tests/test_image.py
checks it against the chart)."""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

try:
    from packaging.specifiers import SpecifierSet
except ImportError:  # pip vendors it
    from pip._vendor.packaging.specifiers import SpecifierSet

from tests import manifest_checks as kube  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


DOCKERFILE = (ROOT / "Dockerfile").read_text()
STAGES = stages(DOCKERFILE)
FINAL = STAGES[-1]


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults (the published image's)."""
    out = {}
    for word, args in instructions(DOCKERFILE):
        if word == "FROM":
            break
        if word == "ARG":
            name, _, default = args.partition("=")
            out[name] = default
    return out


def stage_named(name: str) -> list[tuple[str, str]]:
    (stage,) = [s for s in STAGES if s[0][1].split()[-1] == name]
    return stage


def from_image(stage: list[tuple[str, str]]) -> str:
    """The image a stage starts from, through earlier stages and ${BASE} to the default."""
    image = stage[0][1].split()[0]
    names = {s[0][1].split()[-1]: s for s in STAGES if " AS " in s[0][1].upper()}
    if image in names and names[image] is not stage:
        return from_image(names[image])
    return global_args()["BASE"] if image in ("${BASE}", "$BASE") else image


def final_runs() -> str:
    """Every RUN the final image is made of (its stage and the stages it starts from)."""
    chain, stage = [FINAL], FINAL
    names = {s[0][1].split()[-1]: s for s in STAGES if " AS " in s[0][1].upper()}
    while stage[0][1].split()[0] in names:
        stage = names[stage[0][1].split()[0]]
        chain.insert(0, stage)
    return " ".join(args for st in chain for word, args in st if word == "RUN")


def pyproject_pins() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for req in meta["dependencies"] + meta["optional-dependencies"]["gpu"]:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+(?:\[[^\]]+\])?)==(\S+)", req)
        if m:
            pins[m.group(1)] = m.group(2)
    return pins


def test_multi_stage_wheel_build():
    assert len(STAGES) >= 2
    assert any(word == "RUN" and "--wheel" in args for word, args in stage_named("build"))
    assert any(word == "COPY" and args.startswith("--from=build") and ".whl" not in args for word, args in FINAL)
    assert any(word == "RUN" and "/tmp/dist/*.whl" in args for word, args in FINAL)


def test_base_images_are_pinned():
    for stage in STAGES:
        image = from_image(stage)
        assert ":" in image and not image.endswith(":latest"), image
    final_image = from_image(FINAL)
    assert final_image.startswith(("nvidia/cuda:", "rayproject/ray:")) and "cu" in final_image


def test_pins_match_pyproject():
    """The image installs pyproject.toml's dependencies and the extra VLLM names (read from the
    file in the build), so ray's pin is pyproject's by construction; the GPU build adds torch,
    torchvision and the one vLLM of the gpu extra's range (0.32 and 0.33) the GPU checks proved."""
    from packaging.requirements import Requirement

    pins = pyproject_pins()
    assert dockerfile_pins()["ray[serve]"] == pins["ray[serve]"]
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (extra,) = [Requirement(r) for r in meta["optional-dependencies"]["gpu"] if Requirement(r).name == "vllm"]
    assert extra.specifier.contains(dockerfile_pins()["vllm"]), (str(extra), dockerfile_pins()["vllm"])
    assert any(word == "COPY" and args.split()[0] == "pyproject.toml" for word, args in FINAL)
    assert set(gpu_arm_pins()) == {"vllm", "torch", "torchvision"}


def test_final_stage_is_non_root_and_lean():
    users = [args for word, args in FINAL if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    runs = final_runs()
    # g++ (and the gcc it brings) and python3-dev are there on purpose: torch's inductor
    # compiles the code of a compiled engine at run time, including Python.h (the Dockerfile
    # says why); nothing else to build with.
    for tool in ("build-essential", "make ", "cuda-nvcc", "git "):
        assert tool not in runs, tool
    assert "--no-install-recommends" in runs


def test_labels_and_healthcheck():
    labels = " ".join(args for word, args in FINAL if word == "LABEL")
    for key in ("title", "description", "version", "licenses", "source"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    (health,) = [args for word, args in FINAL if word == "HEALTHCHECK"]
    assert "/healthz" in health and "--start-period=" in health


def test_dockerignore_keeps_the_build_context_small():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert {".venv", "build", ".git", "tests"} <= set(ignored)
    assert "platform" not in ignored and "README.md" not in ignored and "pyproject.toml" not in ignored


def test_checkov_dockerfile(tmp_path):
    if kube.checkov_binary() is None:
        pytest.skip("checkov not found on PATH or in .venv-tools")
    shutil.copy(ROOT / "Dockerfile", tmp_path / "Dockerfile")
    failed = kube.run_checkov(tmp_path, skip=[], framework="dockerfile")
    assert failed == [], [(f["check_id"], f["check_name"]) for f in failed]


# ---- the image's pins equal the GPU check's, and its install resolves for its own Python ----

GPU_PINS = ROOT / "tests" / "gpu" / "overlay-pins.txt"
# What an Ubuntu release's python3 and glibc are: the final stage installs the distribution's
# python3, so its Ubuntu release decides which wheels the image's `pip install` can take.
UBUNTU = {"22.04": ("3.10", 35), "24.04": ("3.12", 39)}
IMAGE_PYTHON = "3.12"  # the GPU check's CPython, and Ubuntu 24.04's python3
OLD_IMAGE_PYTHON = "3.10"  # Ubuntu 22.04's python3, which the image used when it could not build


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_check_pins() -> dict[str, str]:
    pins = {}
    for line in GPU_PINS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonical(name)] = version.strip()
    return pins


def gpu_arm_pins() -> dict[str, str]:
    """The requirements the GPU build (VLLM=gpu) adds to pyproject's: its `gpu)` arm's `pip install`."""
    runs = " ".join(args for word, args in FINAL if word == "RUN")
    m = re.search(r"\bgpu\) pip install (.*?) ;;", runs)
    assert m, "no `gpu) pip install ... ;;` in the final stage"
    tokens = [t for t in shlex.split(m.group(1)) if not t.startswith("-") and t != "/tmp/rollout/requirements.txt"]
    return dict(t.split("==", 1) for t in tokens)


def dockerfile_install() -> list[str]:
    """What the GPU build installs: pyproject.toml's dependencies and gpu extra (the
    requirements file the build writes from it), the gpu arm's pins, and the project's wheel
    (installed after them, --no-deps: the same set)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(word == "RUN" and "pip install --no-cache-dir --no-deps /tmp/dist/*.whl" in args for word, args in FINAL)
    return [*meta["dependencies"], *meta["optional-dependencies"]["gpu"], *(f"{k}=={v}" for k, v in gpu_arm_pins().items()), "/tmp/dist/*.whl"]


def dockerfile_pins() -> dict[str, str]:
    pins = {}
    for req in dockerfile_install():
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+(?:\[[^\]]+\])?)==(\S+)", req)
        if m:
            pins[m.group(1)] = m.group(2)
    return pins


def image_platform() -> tuple[str, int, int]:
    """(python3 version, glibc minor, CUDA major) of the final stage's base image."""
    image = from_image(FINAL)
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+(?:\.\d+)?-[a-z]+-ubuntu(\d+\.\d+)", image)
    assert m, f"{image}: expected an nvidia/cuda:<version>-<flavor>-ubuntu<release> image"
    assert m.group(2) in UBUNTU, f"{image}: unknown Ubuntu release {m.group(2)}"
    python, glibc = UBUNTU[m.group(2)]
    return python, glibc, int(m.group(1))


def test_image_python_is_the_gpu_checks():
    python, _, _ = image_platform()
    assert python == IMAGE_PYTHON
    # The final stage runs the distribution's python3 (no other interpreter) ...
    apt = " ".join(args for word, args in stage_named("base") if word == "RUN" and "apt-get install" in args)
    assert re.search(r"\bpython3\b", apt) and not re.search(r"\bpython3\.\d+\b", apt)
    # ... and the build stage builds the wheel with the same interpreter: it starts from the
    # same stage.
    assert stage_named("build")[0][1].split()[0] == "base" and FINAL[0][1].split()[0] == "base"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(IMAGE_PYTHON), requires


def test_pins_match_the_gpu_check():
    pins, gpu = dockerfile_pins(), gpu_check_pins()
    for name in ("vllm", "torch", "torchvision", "ray[serve]"):
        assert name in pins, f"the Dockerfile does not pin {name}"
        assert pins[name] == gpu[canonical(name.split("[")[0])], (name, pins[name])
    assert set(pins) == {"vllm", "torch", "torchvision", "ray[serve]"}, pins
    assert [a for a in dockerfile_install() if a.endswith(".whl")] == ["/tmp/dist/*.whl"]


# pip matches manylinux tags exactly: offer every glibc level the image can load.
def pip_platforms(glibc: int) -> list[str]:
    tags = ["manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, glibc + 1)]
    return [arg for tag in tags for arg in ("--platform", tag)]


def pip_env() -> dict[str, str]:
    """pip as `docker build` runs it: no pip config file, constraints or local wheel folders of
    this machine (its pip.conf caps torch and adds local indexes); PIP_INDEX_URL, PIP_CERT and
    proxies from the environment still apply."""
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_CONSTRAINT", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_REQUIREMENT")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_CONSTRAINT="", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def interpreter_for(version: str) -> str:
    """A Python `version` with pip, to run pip under: pip evaluates environment markers
    (python_version < "3.12" ...) against the interpreter it runs in, whatever --python-version
    says. Falls back to this interpreter (tags and Requires-Python still follow --python-version)."""
    candidates = [sys.executable, shutil.which(f"python{version}") or ""]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")), reverse=True)
    for exe in candidates:
        if not exe:
            continue
        probe = subprocess.run([exe, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return exe
    return sys.executable


def pip_resolve(requirements: list[str], python: str, glibc: int, workdir: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`pip install --dry-run` of `requirements` for CPython `python` on manylinux x86_64 up to
    glibc 2.`glibc`: binary wheels only (the image has no compilers). Returns pip's result and its report."""
    report = workdir / f"report-{python}.json"
    cmd = [interpreter_for(python), "-m", "pip", "install", "--dry-run", "--ignore-installed",
           # pip (before 24.1) takes platform options only with --target; nothing is written with --dry-run.
           "--target", str(workdir / "target"),
           "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
           *pip_platforms(glibc), "--cache-dir", str(ROOT / "build" / "pip-cache"),
           "--report", str(report), "--quiet", *requirements]
    result = subprocess.run(cmd, capture_output=True, text=True, env=pip_env(), timeout=600)
    return result, (json.loads(report.read_text()) if result.returncode == 0 else {})


def require_pypi():
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(f"{index}/vllm/", method="HEAD"), timeout=10).close()
    except urllib.error.HTTPError:
        pass  # it answered: pip will say what is wrong
    except (OSError, ValueError) as exc:
        pytest.skip(f"the package index {index} is unreachable ({exc}): cannot resolve the image's install")


def build_project_wheel(workdir: Path) -> Path:
    """The project's wheel, built from what the Dockerfile's build stage copies."""
    src, out = workdir / "src", workdir / "dist"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "platform", src / "platform", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)]
    try:
        import wheel  # noqa: F401
        from setuptools import __version__ as setuptools_version

        if int(setuptools_version.split(".")[0]) >= 68:
            cmd.insert(4, "--no-build-isolation")  # no download of the build backend
    except ImportError:
        pass
    result = subprocess.run(cmd, capture_output=True, text=True, env=pip_env(), timeout=600)
    assert result.returncode == 0, result.stderr
    (whl,) = out.glob("rollout_platform-*.whl")
    return whl


def resolve_image_install(workdir: Path) -> dict[str, dict]:
    """The image's `pip install`, resolved for its Python and platform: {name: report item}."""
    require_pypi()
    project_wheel = build_project_wheel(workdir)  # after the check: may download setuptools
    python, glibc, _ = image_platform()
    requirements = [str(project_wheel) if a == "/tmp/dist/*.whl" else a for a in dockerfile_install()]
    (workdir / "resolve").mkdir()
    result, report = pip_resolve(requirements, python, glibc, workdir / "resolve")
    assert result.returncode == 0, f"the image's pip install does not resolve for CPython {python}:\n{result.stderr[-4000:]}"
    return {canonical(item["metadata"]["name"]): item for item in report["install"]}


_resolving: list[concurrent.futures.Future] = []


def start_image_resolve() -> None:
    """Called once the session's tests are collected (conftest): the resolve spends about two
    minutes waiting on the package index, so it runs beside the tests collected before it."""
    if not _resolving:
        workdir = Path(tempfile.mkdtemp(prefix="image-resolve-"))
        _resolving.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="image-resolve").submit(resolve_image_install, workdir))


@pytest.fixture(scope="session")
def image_install() -> dict[str, dict]:
    start_image_resolve()  # (already started, unless this module runs alone)
    return _resolving[0].result(timeout=900)  # a skip or failure in the resolve is raised here


def test_image_install_resolves(image_install):
    versions = {name: item["metadata"]["version"] for name, item in image_install.items()}
    assert versions["vllm"] == "0.32.0"
    assert versions["torch"] == "2.13.0"  # no local version: PyPI's default (CUDA 13.0) build
    assert versions["torchvision"] == "0.28.0" and versions["ray"] == "2.60.0"
    assert versions["rollout-platform"] == "0.1.0"
    gpu = gpu_check_pins()
    assert {n: versions[n] for n in ("vllm", "torch", "torchvision", "ray")} == {n: gpu[n] for n in ("vllm", "torch", "torchvision", "ray")}


def test_image_cuda_matches_the_wheels(image_install):
    """The base image's CUDA major is that of the CUDA runtime wheel torch brings (cu13: driver >= 580)."""
    _, _, cuda = image_platform()
    runtimes = [item["metadata"]["version"] for name, item in image_install.items() if re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", name)]
    assert runtimes, "torch brought no CUDA runtime wheel"
    assert {int(v.split(".")[0]) for v in runtimes} == {cuda}, (runtimes, from_image(FINAL))


def test_requires_python_is_vllms(image_install):
    """The project claims exactly the Python versions its pinned vLLM installs on."""
    project = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    vllm = SpecifierSet(image_install["vllm"]["metadata"]["requires_python"])
    minors = [f"3.{n}" for n in range(8, 20)]
    assert [v for v in minors if project.contains(v)] == [v for v in minors if vllm.contains(v)], (str(project), str(vllm))


def test_old_image_python_cannot_install_vllm(tmp_path):
    """What the test above catches: Ubuntu 22.04's Python 3.10 (the image's before) gets no vllm 0.32.0."""
    require_pypi()
    _, glibc = UBUNTU["22.04"]
    requirements = [a for a in dockerfile_install() if not a.endswith(".whl")]
    result, _ = pip_resolve(requirements, OLD_IMAGE_PYTHON, glibc, tmp_path)
    assert result.returncode != 0
    # pip's "Ignored the following versions that require a different python version: ... 0.32.0 Requires-Python ..."
    assert f"{dockerfile_pins()['vllm']} Requires-Python" in result.stderr, result.stderr[-2000:]
