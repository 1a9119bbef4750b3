"""A whole platform on this machine: local Ray, the Serve app, torn down afterwards.

Used by ``rollout demo``, the benchmarks and the tests; the CPU defaults here are the
measured ones for a small model on a small machine.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

from rollout.config import PlatformConfig, load_config

logger = logging.getLogger(__name__)

# On CPU, gpu_memory_utilization is a fraction of one NUMA node after the model's share,
# which varies by machine; an explicit KV-cache size starts everywhere.
CPU_MODEL_DEFAULTS = {"max_model_len": 1024, "kv_cache_memory_bytes": 512 << 20, "device": "cpu", "dtype": "float32"}


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
def local_platform(cfg: PlatformConfig, num_cpus: int = 8) -> Iterator[PlatformConfig]:
    """Start Ray (logical CPUs, not cores: replicas reserve 1 each), deploy, yield, tear down."""
    import ray
    from ray import serve

    from rollout.app import deploy

    started = not ray.is_initialized()
    if started:
        # Ray's metrics agent serves every process's metrics on this port.
        ray.init(num_cpus=num_cpus, namespace="rollout", log_to_driver=False, _metrics_export_port=cfg.metrics.port)
    try:
        deploy(cfg)
        yield cfg
    finally:
        try:
            serve.shutdown()
        finally:
            if started:
                ray.shutdown()
