"""vLLM general plugin (entry point ``vllm.general_plugins``): registers our backends.

vLLM loads general plugins in every engine and worker process, so the ``gloo`` backend
is known wherever ``WeightTransferConfig(backend="gloo")`` is resolved.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in (
        (WeightTransferEngineFactory, "rollout.sync.backends.gloo_worker", "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, "rollout.sync.backends.gloo_trainer", "GlooTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine("gloo", module, cls)
        except ValueError:
            # Plugins may load more than once per process: already registered is fine.
            pass
