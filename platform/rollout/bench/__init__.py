"""``make bench``: benchmarks writing JSON results (speed goals live here, never in tests)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rollout.modelbuild import build_model, is_built

logger = logging.getLogger(__name__)


def write_result(out_dir: Path, name: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


BENCHMARKS = ("engine_throughput", "weight_sync", "weight_delta", "scaling", "rollout_stream", "python_tool", "hosts_publish", "coordinator_scale", "prefix_cache", "per_request")
# Benchmarks that run no model: `--only` these builds none.
WITHOUT_MODEL = ("python_tool", "coordinator_scale")


def run_benchmarks(model_dir: Path, out_dir: Path, only: tuple[str, ...] = BENCHMARKS, quick: bool = False) -> int:
    """``quick``: the benchmarks that have a quick size run it (per_request: a few minutes)."""
    unknown = set(only) - set(BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; choose from {BENCHMARKS}")
    if set(only) - set(WITHOUT_MODEL) and not is_built(model_dir):
        build_model(model_dir)
    if "engine_throughput" in only:
        from rollout.bench.engine_throughput import run as run_throughput

        write_result(out_dir, "engine_throughput", run_throughput(model_dir))
    if "weight_sync" in only:
        from rollout.bench.weight_sync import run as run_sync

        write_result(out_dir, "weight_sync", run_sync(model_dir.parent))
    if "weight_delta" in only:
        from rollout.bench.weight_sync import run_deltas

        write_result(out_dir, "weight_delta", run_deltas(model_dir.parent))
    if "scaling" in only:
        from rollout.bench.scaling import run as run_scaling

        write_result(out_dir, "scaling", run_scaling(model_dir))
    if "rollout_stream" in only:
        from rollout.bench.rollout_stream import run as run_stream

        write_result(out_dir, "rollout_stream", run_stream(model_dir))
    if "python_tool" in only:
        from rollout.bench.python_tool import run as run_python_tool

        write_result(out_dir, "python_tool", run_python_tool())
    if "hosts_publish" in only:
        from rollout.bench.hosts_publish import run as run_hosts_publish

        write_result(out_dir, "hosts_publish", run_hosts_publish(model_dir.parent))
    if "coordinator_scale" in only:
        from rollout.bench.coordinator_scale import run as run_coordinator_scale

        write_result(out_dir, "coordinator_scale", run_coordinator_scale())
    if "prefix_cache" in only:
        from rollout.bench.prefix_cache import run as run_prefix_cache

        write_result(out_dir, "prefix_cache", run_prefix_cache(model_dir))
    if "per_request" in only:
        from rollout.bench.per_request import cpu_run as run_per_request

        write_result(out_dir, "per_request", run_per_request(model_dir, quick=quick))
    return 0
