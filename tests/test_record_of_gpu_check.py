"""The GPU check's record (tests/gpu/conftest.py): a check stopped by the run's own time
limit is recorded as cut off, not as a failure of what it checks."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from tests.gpu import conftest as gpu_record


def _failed_report(nodeid: str):
    return SimpleNamespace(nodeid=nodeid, when="call", outcome="failed", skipped=False, failed=True, duration=12.0, longreprtext="E   SystemExit: 1", longrepr="SystemExit: 1")


def _outcome_when_run_ends_at(end: float, tmp_path, monkeypatch) -> dict:
    path = tmp_path / "results.json"
    monkeypatch.setattr(gpu_record, "_record", gpu_record.Record(path))
    monkeypatch.setenv(gpu_record.END_ENV, str(end))
    gpu_record.pytest_runtest_logreport(_failed_report("tests/gpu/test_gpu_platform.py::test_tp"))
    return json.loads(path.read_text())["checks"]["test_tp"]


def test_a_check_failing_as_the_run_ends_is_recorded_as_cut_off(tmp_path, monkeypatch):
    entry = _outcome_when_run_ends_at(time.time() + 1, tmp_path, monkeypatch)
    assert entry["outcome"] == "cut off"
    assert gpu_record.END_ENV in entry["reason"] and entry["error"] == "SystemExit: 1"


def test_a_check_failing_well_before_the_run_ends_is_a_failure(tmp_path, monkeypatch):
    entry = _outcome_when_run_ends_at(time.time() + 600, tmp_path, monkeypatch)
    assert entry["outcome"] == "failed" and entry["error"] == "SystemExit: 1"
