"""A whole platform on this machine: local Ray, the Serve app, torn down afterwards.

Used by ``rollout demo``, the benchmarks and the tests; the CPU defaults here are the
measured ones for a small model on a small machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from rollout.config import PlatformConfig, load_config

logger = logging.getLogger(__name__)

# On CPU, gpu_memory_utilization is a fraction of one NUMA node after the model's share,
# which varies by machine; an explicit KV-cache size starts everywhere.
CPU_MODEL_DEFAULTS = {"max_model_len": 1024, "kv_cache_memory_bytes": 512 << 20, "device": "cpu", "dtype": "float32"}


# Ray starts its worker processes at nice 15 (Ray's worker_niceness): the replicas, vLLM's
# engine core and GPU workers under them, the coordinator and the tool workers, below every
# other process of the node. Issue 41 measured every Ray worker of a `rollout serve` on an
# H200 at 15, the engine core included, where `vllm serve` runs at 0. The platform's
# clusters start their workers at 0: `rollout serve`'s own and local_platform's (through
# ray_worker_environment), the Helm chart's pods (its rollout.env, checked equal to this by
# tests/test_helm_chart.py) and the test suite's. A value the operator set wins; a cluster
# the platform joins keeps the niceness it was started with.
RAY_WORKER_ENV = {"RAY_worker_niceness": "0"}


def ray_worker_environment() -> None:
    """Give the Ray cluster this process starts (``ray.init`` without an address: its
    raylet inherits this environment) :data:`RAY_WORKER_ENV`, where unset."""
    for key, value in RAY_WORKER_ENV.items():
        os.environ.setdefault(key, value)


def cpu_config(model_dir: str | Path, **overrides: Any) -> PlatformConfig:
    """A config for the built model on CPU; ``overrides`` are merged per section
    (top-level scalars such as ``app_name`` replace)."""
    data: dict[str, Any] = {"model": {"path": str(model_dir), **CPU_MODEL_DEFAULTS}}
    for section, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return load_config(data, environ={})


@contextlib.contextmanager
def local_platform(cfg: PlatformConfig, num_cpus: int = 8, quiet: bool = False) -> Iterator[PlatformConfig]:
    """Start Ray (logical CPUs, not cores: replicas reserve 1 each), deploy, yield, tear down.

    ``quiet``: Ray's and Serve's notes of their own progress (a cluster started, an app
    ready) are not printed here; their warnings and errors are. A cluster it starts has
    token authentication on, as Ray chooses for a new local cluster, said rather than
    left to Ray's warning that it chose it.

    Torn down in order: the app deleted, and awaited (its replicas stop their engines),
    then the cluster this started. ``serve.shutdown()`` is not how: its controller kills
    itself under the call that asks it to, and the driver's calls still pending on it
    (that one, Serve's long poll) are each reported as a task of a dead actor."""
    if quiet and "ray" not in sys.modules:
        # Read once, as Ray is imported: set later, the driver and the cluster would disagree.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if not ray.is_initialized():
        from rollout.http.front_door import prepare

        # Serve's switches, in the environment the cluster's processes inherit; before Serve
        # is imported here, which reads them once.
        prepare(cfg.http)
    from ray import serve

    from rollout.app import deploy

    started = not ray.is_initialized()
    if started:
        ray_worker_environment()
        # Ray's metrics agent serves every process's metrics on this port.
        ray.init(
            num_cpus=num_cpus, namespace="rollout", log_to_driver=False, _metrics_export_port=cfg.metrics.port,
            logging_level=logging.WARNING if quiet else logging.INFO,
        )
    if quiet:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        deploy(cfg)
        yield cfg
    finally:
        if started:
            try:
                serve.delete(cfg.app_name)
            finally:
                ray.shutdown()  # the driver leaves first, then the cluster's processes end
        else:
            serve.shutdown()  # a cluster of the caller's: Serve goes, the cluster stays
