"""The Dockerfile, read as text (no Docker engine here): pins match pyproject.toml,
the final stage is non-root, carries no build tools, has OCI labels and a health check."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest

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
    assert any(word == "RUN" and "--wheel" in args for word, args in STAGES[0])
    assert any(word == "COPY" and args.startswith("--from=build") and ".whl" not in args for word, args in FINAL)
    assert any(word == "RUN" and "/tmp/dist/*.whl" in args for word, args in FINAL)


def test_base_images_are_pinned():
    for stage in STAGES:
        image = stage[0][1].split()[0]
        assert ":" in image and not image.endswith(":latest"), image
    final_image = FINAL[0][1].split()[0]
    assert final_image.startswith(("nvidia/cuda:", "rayproject/ray:")) and "cu" in final_image


def test_pins_match_pyproject():
    pins = pyproject_pins()
    installs = " ".join(args for word, args in FINAL if word == "RUN" and "pip install" in args)
    found = dict(re.findall(r'"?([A-Za-z0-9_.\-]+(?:\[[^\]]+\])?)==([^"\s]+)"?', installs))
    assert found.get("vllm") == pins["vllm"]
    assert found.get("ray[serve]") == pins["ray[serve]"]


def test_final_stage_is_non_root_and_lean():
    users = [args for word, args in FINAL if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    final_runs = " ".join(args for word, args in FINAL if word == "RUN")
    for tool in ("build-essential", "gcc", "g++", "make ", "python3-dev", "cuda-nvcc", "git "):
        assert tool not in final_runs, tool
    assert "--no-install-recommends" in final_runs


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
