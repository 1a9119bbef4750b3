"""What every GPU check shares about the machine it runs on: where the check's files and
the built model are (``check.sh`` sets both), and the skip for a machine with too few
GPUs."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("ROLLOUT_GPU_WORK", ROOT / "build" / "gpu"))
MODEL = Path(os.environ.get("ROLLOUT_GPU_MODEL", WORK / "model-1.5b"))


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int, why: str = "") -> pytest.MarkDecorator:
    """Skip unless this machine has ``n`` CUDA GPUs; ``why`` says what they are for."""
    return pytest.mark.skipif(
        gpus() < n,
        reason=f"needs {n} CUDA GPUs{why} (this machine has {gpus()}); run tests/gpu/check.sh on a {n}-GPU machine",
    )


@contextmanager
def gpu_cluster(**ray_init: Any) -> Iterator[None]:
    """A Ray cluster for one module's checks (``ray_init``: more of ``ray.init``'s
    arguments), with Serve shut down and Ray stopped after them."""
    import ray
    from ray import cloudpickle, serve

    import tests.gpu.engines

    WORK.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", "gpu-check-sync-token")
    ray.init(namespace="rollout-gpu", log_to_driver=False, **ray_init)
    # Workers cannot import the tests package: ship the actors' code by value.
    cloudpickle.register_pickle_by_value(tests.gpu.engines)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
