"""The GPU check's record: every GPU test's outcome and numbers, in one JSON file.

``tests/gpu/check.sh`` runs these tests on a lent GPU machine with
``ROLLOUT_GPU_RESULTS`` pointing at the results file; the file is rewritten after every
test, so a run cut short still says what passed, what failed (with the error) and what
did not run. ``rollout gpu-report`` renders the "Verified on GPU" section of docs/gpu.md from it.
"""

from __future__ import annotations

import json
import os
import platform as _stdlib_platform
import time
from pathlib import Path
from typing import Any

import pytest

RESULTS_ENV = "ROLLOUT_GPU_RESULTS"
# Wall-clock second (epoch) after which checks that have not started are skipped, so a
# lent machine's stay ends with a results file rather than a killed run.
DEADLINE_ENV = "ROLLOUT_GPU_DEADLINE"
# Wall-clock second at which check.sh's timeout stops the run: a check failing then was cut
# off (the SIGTERM surfaces as SystemExit), which says nothing about what it checks.
END_ENV = "ROLLOUT_GPU_END"
CUT_OFF_SLACK_S = 30.0


class Record:
    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": {}, "checks": {}}

    def check(self, nodeid: str) -> dict[str, Any]:
        name = nodeid.split("::")[-1]
        # The file too: the report groups the checks it has no row of its own for by file.
        return self.data["checks"].setdefault(name, {"file": nodeid.split("::")[0].replace(os.sep, "/"), "outcome": "not run", "metrics": {}})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


_record: Record | None = None


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": _stdlib_platform.python_version()}
    for module in ("vllm", "torch", "ray", "transformers"):
        try:
            env[module] = __import__(module).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            env[module] = f"not importable: {type(e).__name__}: {e}"
    try:
        import torch

        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001
        env["gpus"] = f"unknown: {e}"
    return env


def pytest_configure(config):
    global _record
    path = os.environ.get(RESULTS_ENV)
    if path:
        _record = Record(Path(path))
        _record.data["environment"] = _environment()
        _record.save()


def _is_gpu_test(nodeid: str) -> bool:
    # tests/gpu/* and tests/test_gpu_*.py: the GPU-only tests the check runs.
    path = nodeid.split("::")[0].replace(os.sep, "/")
    return "/gpu/" in f"/{path}" or Path(path).name.startswith("test_gpu_")


def pytest_collection_modifyitems(config, items):
    if _record is None:
        return
    for item in items:
        if _is_gpu_test(item.nodeid):
            _record.check(item.nodeid)
    _record.save()


def pytest_deselected(items):
    """A run of some checks (``-k``) still lists the others, as not run and why: the
    table of docs/gpu.md then shows where each of them last passed."""
    if _record is None:
        return
    for item in items:
        if _is_gpu_test(item.nodeid):
            entry = _record.check(item.nodeid)
            entry["outcome"] = "not run"
            entry["reason"] = f"deselected: this run selected -k {item.config.option.keyword!r}" if item.config.option.keyword else "deselected"
    _record.save()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # Each phase's report on the test item (item.rep_setup, item.rep_call), for fixtures
    # that clean up after a failed check.
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_runtest_logreport(report):
    if _record is None or not _is_gpu_test(report.nodeid):
        return
    entry = _record.check(report.nodeid)
    if report.when == "call" or report.outcome != "passed":
        if report.skipped:
            entry["outcome"] = "skipped"
            entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        elif report.failed and _cut_off():
            entry["outcome"] = "cut off"
            entry["reason"] = f"the run's time budget ended during this check ({END_ENV}); no verdict"
            entry["error"] = _short_error(report)
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
            entry["error"] = _short_error(report)
        else:
            entry["outcome"] = "passed"
        entry["seconds"] = round(report.duration, 1) + entry.get("setup_seconds", 0.0)
    elif report.when == "setup":
        entry["setup_seconds"] = round(report.duration, 1)
    _record.save()


def _cut_off() -> bool:
    end = os.environ.get(END_ENV)
    return bool(end) and time.time() >= float(end) - CUT_OFF_SLACK_S


def _short_error(report) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    lines = [l for l in text.splitlines() if l.strip()]
    # The assertion or exception lines (pytest marks them with "E"), else the tail.
    marked = [l[1:].strip() for l in lines if l.startswith("E ")]
    return "\n".join((marked or lines)[-12:])[:3000]


@pytest.fixture
def record(request):
    """``record(name=value, ...)``: numbers of the running check, kept in the results file."""

    def add(**metrics: Any) -> None:
        if _record is not None:
            _record.check(request.node.nodeid)["metrics"].update(metrics)
            _record.save()

    return add


@pytest.fixture(autouse=True)
def _within_deadline(request):
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline and time.time() > float(deadline):
        pytest.skip(f"not run: the GPU machine's time ran out (deadline {DEADLINE_ENV}={deadline})")
