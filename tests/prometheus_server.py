"""A real Prometheus server (Debian's package) on loopback, scraping the test cluster."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml

from rollout.processes import end

from tests.conftest import answers_ok


class PrometheusServer:
    def __init__(self, workdir: Path, scrape_port: int, port: int, rule_files: list[Path], scrape_interval_s: int = 5):
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: `apt-get install prometheus` (.ci/run does it)")
        # A scrape's timeout is at most its interval. Ray's metrics agent, beside the other
        # test lane's clusters on 2 cores, took over 1 s per scrape for minutes on end (a CI
        # run's TSDB: `up` 0 and `scrape_duration_seconds` 1.0 throughout), so Prometheus
        # stored nothing. 5 s answers a loaded agent; `settle_s` covers two scrapes.
        self.scrape_interval_s = scrape_interval_s
        self.settle_s = 2 * scrape_interval_s + 1.0
        config = {
            "global": {"scrape_interval": f"{scrape_interval_s}s", "scrape_timeout": f"{scrape_interval_s}s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{scrape_port}"]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / "prometheus.log", "w"),
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60) -> None:
        if not answers_ok(f"{self.url}/-/ready", timeout_s, poll_s=0.5):
            raise RuntimeError("prometheus did not become ready")

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{expr}: {body}")
        return body["data"]["result"]

    def targets(self) -> list[dict[str, Any]]:
        """Each scrape target's health, last error and last scrape's duration: what a failed
        query's message needs to tell an empty store from a slow or unreachable target."""
        body = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
        return [
            {k: t.get(k) for k in ("scrapeUrl", "health", "lastError", "lastScrapeDuration")}
            for t in body.get("data", {}).get("activeTargets", [])
        ]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")

    def stop(self) -> None:
        end(self.proc, 30)
