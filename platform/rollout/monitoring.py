"""The Grafana dashboard and the Prometheus alert rules, generated from one list of queries.

Every panel query and every alert's signal is defined here once; ``rollout
monitoring-assets`` writes the dashboard JSON and the rules file into ``k8s/monitoring/``
and the Helm chart, and the end-to-end test evaluates each expression against a real
Prometheus scraping a real platform. A metric rename therefore breaks a test, not a
dashboard.

Metric names are those Ray's metrics agent exports: ours as ``ray_rollout_*`` (see
:mod:`rollout.metrics`), vLLM's as ``ray_vllm_*``, Serve's as ``ray_serve_*``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATHS = (ROOT / "k8s" / "monitoring" / "grafana-dashboard.json", ROOT / "helm" / "rollout-platform" / "files" / "grafana-dashboard.json")
RULES_PATHS = (ROOT / "k8s" / "monitoring" / "rollout-rules.yaml", ROOT / "helm" / "rollout-platform" / "files" / "rollout-rules.yaml")

# Dashboard variables. `=~` with `.*` also matches series that lack the label (e.g. no
# `namespace` outside Kubernetes), so the defaults show everything.
ENGINE = 'namespace=~"$namespace",app=~"$app",replica=~"$replica"'
VARIABLES = {
    "namespace": "label_values(ray_rollout_engine_running, namespace)",
    "app": 'label_values(ray_rollout_engine_running{namespace=~"$namespace"}, app)',
    "replica": 'label_values(ray_rollout_engine_running{namespace=~"$namespace",app=~"$app"}, replica)',
}
DEFAULTS = {name: ".*" for name in VARIABLES}


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (legend, PromQL)


PANELS = (
    Panel("Generated tokens / s", "tokens/s", (("generated", f"sum(rate(ray_rollout_generated_tokens_total{{{ENGINE}}}[1m]))"), ("prompt", f"sum(rate(ray_rollout_prompt_tokens_total{{{ENGINE}}}[1m]))"))),
    Panel(
        "Request latency (in replica)",
        "s",
        tuple(
            (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate(ray_rollout_request_latency_seconds_bucket{{{ENGINE}}}[5m])))")
            for q in (50, 90, 99)
        ),
    ),
    Panel("Time to first token (vLLM)", "s", (("p90", "histogram_quantile(0.9, sum by (le) (rate(ray_vllm_time_to_first_token_seconds_bucket[5m])))"),)),
    Panel("Queue depth per replica", "sequences", (("waiting {{replica}}", f"sum by (replica) (ray_rollout_engine_waiting{{{ENGINE}}})"), ("running {{replica}}", f"sum by (replica) (ray_rollout_engine_running{{{ENGINE}}})"))),
    Panel("KV-cache usage per replica", "percentunit", (("{{replica}}", f"max by (replica) (ray_rollout_kv_cache_usage{{{ENGINE}}})"),)),
    Panel(
        "Prefix-cache hit rate",
        "percentunit",
        # No hit yet means no hits series (Ray counters start at their first increment).
        (("hit rate", f"(sum(rate(ray_rollout_prefix_cache_hits_total{{{ENGINE}}}[5m])) or on() vector(0)) / sum(rate(ray_rollout_prefix_cache_queries_total{{{ENGINE}}}[5m]))"),),
    ),
    Panel("Weight version", "none", (("committed", "max(ray_rollout_committed_weight_version)"), ("{{replica}}", f"max by (replica) (ray_rollout_replica_weight_version{{{ENGINE}}})"))),
    Panel("Weight version lag", "none", (("{{replica}}", "max by (replica) (ray_rollout_weight_version_lag)"),)),
    Panel("Weight sync time", "s", (("p50", "histogram_quantile(0.5, sum by (le) (rate(ray_rollout_weight_sync_duration_seconds_bucket[15m])))"), ("p99", "histogram_quantile(0.99, sum by (le) (rate(ray_rollout_weight_sync_duration_seconds_bucket[15m])))"))),
    Panel("Weight sync bytes / s", "Bps", (("{{backend}}", "sum by (backend) (rate(ray_rollout_weight_sync_bytes_total[15m]))"),)),
    Panel("Requests by outcome", "req/s", (("{{outcome}}", f"sum by (outcome) (rate(ray_rollout_requests_total{{{ENGINE}}}[5m]))"),)),
    Panel(
        "Tool calls by tool and outcome",
        "calls/s",
        (("{{tool}} {{outcome}}", f"sum by (tool, outcome) (rate(ray_rollout_tool_calls_total{{{ENGINE}}}[5m]))"),),
    ),
    Panel(
        "Tool call time p90",
        "s",
        # Only tools called in the window: an idle tool's quantile is 0/0.
        (
            (
                "{{tool}}",
                f"histogram_quantile(0.9, sum by (le, tool) (rate(ray_rollout_tool_call_seconds_bucket{{{ENGINE}}}[15m])))"
                f" and on(tool) sum by (tool) (rate(ray_rollout_tool_call_seconds_count{{{ENGINE}}}[15m])) > 0",
            ),
        ),
    ),
    Panel("Sync failures", "none", (("{{reason}}", "sum by (reason) (increase(ray_rollout_weight_sync_failures_total[1h]))"),)),
    Panel("Replicas", "none", (("registered for sync", "max(ray_rollout_sync_replicas)"), ("reporting engine stats", f"count(ray_rollout_engine_running{{{ENGINE}}})"))),
)


@dataclass(frozen=True)
class Alert:
    name: str
    # PromQL that has data while the platform runs: the e2e test fails when it has none, so
    # a signal never pads itself with `or vector(0)` (it could not fail that test).
    signal: str
    condition: str  # appended to the signal, e.g. "> 0"
    for_: str
    severity: str
    summary: str
    description: str
    # A series whose absence fires the alert too ("nothing reports" is the worst case).
    fires_when_absent: Optional[str] = None

    @property
    def expr(self) -> str:
        expr = f"({self.signal}) {self.condition}"
        return f"{expr} or absent({self.fires_when_absent})" if self.fires_when_absent else expr


ALERTS = (
    Alert(
        "RolloutWeightSyncFailures",
        "sum(increase(ray_rollout_weight_sync_failures_total[10m]))",
        "> 0",
        "0m",
        "warning",
        "Weight syncs to rollout engines are failing",
        "{{ $value }} weight-sync rounds were aborted in the last 10 minutes; replicas keep serving the last committed version.",
    ),
    Alert(
        "RolloutWeightVersionLag",
        "max(ray_rollout_weight_version_lag)",
        "> 2",
        "10m",
        "warning",
        "Rollout replicas lag behind the committed weights",
        "A replica serves weights {{ $value }} versions behind the committed version.",
    ),
    Alert(
        "RolloutKVCacheSaturated",
        "max by (replica) (ray_rollout_kv_cache_usage)",
        "> 0.95",
        "15m",
        "warning",
        "KV cache of a rollout replica is saturated",
        "Replica {{ $labels.replica }} has used over 95% of its KV cache for 15 minutes: requests get preempted; add replicas or lower max_num_seqs.",
    ),
    Alert(
        "RolloutNoReadyReplica",
        "count(ray_rollout_engine_running)",
        "< 1",
        "10m",
        "critical",
        "No rollout engine replica reports",
        "No engine replica has reported metrics for 10 minutes: trainers get no rollouts.",
        fires_when_absent="ray_rollout_engine_running",
    ),
    Alert(
        "RolloutHighErrorRate",
        'sum(rate(ray_rollout_requests_total{outcome="error"}[5m]) or on() vector(0)) / sum(rate(ray_rollout_requests_total[5m]))',
        "> 0.05",
        "10m",
        "warning",
        "Rollout requests are failing",
        "{{ $value | humanizePercentage }} of rollout requests failed in the engines over the last 5 minutes.",
    ),
)


def substitute(expr: str, values: dict[str, str] = DEFAULTS) -> str:
    for name, value in values.items():
        expr = expr.replace(f"${name}", value)
    return expr


def all_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel query and alert signal, variables substituted."""
    out = [(f"panel {p.title!r} / {legend}", substitute(q)) for p in PANELS for legend, q in p.queries]
    out += [(f"alert {a.name}", a.signal) for a in ALERTS]
    return out


def dashboard() -> dict:
    panels = []
    for i, p in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": p.title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "targets": [{"refId": chr(ord("A") + j), "expr": q, "legendFormat": legend} for j, (legend, q) in enumerate(p.queries)],
            }
        )
    templating = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}]
    for name, query in VARIABLES.items():
        templating.append(
            {
                "name": name,
                "type": "query",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": query,
                "includeAll": True,
                "allValue": ".*",
                "multi": True,
                "current": {"text": "All", "value": "$__all"},
                "refresh": 2,
            }
        )
    return {
        "title": "Rollout Platform",
        "uid": "rollout-platform",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "tags": ["rollout", "vllm", "ray"],
        "templating": {"list": templating},
        "panels": panels,
    }


def rules() -> dict:
    return {
        "groups": [
            {
                "name": "rollout-platform",
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr,
                        "for": a.for_,
                        "labels": {"severity": a.severity},
                        "annotations": {"summary": a.summary, "description": a.description},
                    }
                    for a in ALERTS
                ],
            }
        ]
    }


RULES_HEADER = "# Generated by `rollout monitoring-assets` from rollout/monitoring.py; do not edit.\n"


def render() -> dict[Path, str]:
    dash = json.dumps(dashboard(), indent=2) + "\n"
    rule_text = RULES_HEADER + yaml.safe_dump(rules(), sort_keys=False, width=1000)
    return {**{p: dash for p in DASHBOARD_PATHS}, **{p: rule_text for p in RULES_PATHS}}


def write_assets() -> list[Path]:
    changed = []
    for path, text in render().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed
