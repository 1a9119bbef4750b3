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


def run_benchmarks(model_dir: Path, out_dir: Path) -> int:
    from rollout.bench.engine_throughput import run as run_throughput

    if not is_built(model_dir):
        build_model(model_dir)
    write_result(out_dir, "engine_throughput", run_throughput(model_dir))
    return 0
