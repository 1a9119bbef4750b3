"""vLLM general plugin (entry point ``vllm.general_plugins``): registers our backends' engines.

vLLM loads general plugins in every engine and worker process, so a backend with
weight-transfer engines of its own (``SyncBackend.worker_engine`` / ``trainer_engine``,
e.g. ``gloo``) is known wherever ``WeightTransferConfig(backend=...)`` is resolved.
Registration names the engine's module; vLLM imports it only when the engine is made.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from rollout.contracts.backend_registry import backend_names, get_backend

    for name in backend_names():
        backend = get_backend(name)
        # The worker engine under its own vLLM name where vLLM has one called ``name``
        # (``SyncBackend.engine_name``); trainers written for ``vllm serve`` ask for ``name``.
        for factory, key, target in ((WeightTransferEngineFactory, backend.vllm_engine, backend.worker_engine), (WeightTransferTrainerFactory, name, backend.trainer_engine)):
            if target is None:
                continue  # vLLM's own engine of that name
            module, cls = target.split(":")
            try:
                factory.register_engine(key, module, cls)
            except ValueError:
                # Plugins may load more than once per process: already registered is fine.
                pass
