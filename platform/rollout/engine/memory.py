"""How much memory a replica's engine asks for, decided on the replica's node before vLLM starts.

vLLM reports a start that cannot fit from inside its engine-core process: the replica sees
only "Engine core initialization failed. See root cause above", and the cause is a log
line of another process. So the replica checks first, with the same numbers vLLM uses,
and fails with one line that names the config field to change (:class:`EngineStartError`).

On CPU, vLLM's default (``gpu_memory_utilization`` 0.9 of a NUMA node) does not start on a
machine whose memory is partly in use, which is every machine running Ray. When neither
``model.kv_cache_memory_bytes`` nor ``model.gpu_memory_utilization`` is set, the KV cache
is sized from the memory actually free on the node (:func:`auto_cpu_kv_bytes`). On GPUs,
vLLM's own default (0.9 of the device) stands.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rollout.config import ModelConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
# vLLM's own default on GPUs.
GPU_MEMORY_UTILIZATION = 0.9
# CPU, automatic: this share of the memory left free after the weights ...
CPU_KV_SHARE = 0.25
# ... at least this much (below it a replica holds too few sequences to be of use) ...
CPU_KV_FLOOR = 256 * MIB
# ... and at most this much, or what max_num_seqs sequences of max_model_len tokens can fill.
CPU_KV_CEILING = 4 * GIB
# What the engine needs beside weights and KV cache (activations, runtime, tokenizer).
CPU_ENGINE_OVERHEAD = 512 * MIB


class EngineStartError(RuntimeError):
    """The engine cannot start with this config; the message names the field to change."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class NodeMemory:
    """Memory of the NUMA node the engine allocates from, in bytes."""

    total: int
    available: int

    @classmethod
    def here(cls) -> "NodeMemory":
        """vLLM's own reading (the node its CPU worker binds to first)."""
        from vllm.utils.cpu_resource_utils import get_memory_node_info, get_visible_memory_node

        nodes = get_visible_memory_node() or [0]
        info = get_memory_node_info(nodes[0])
        return cls(total=int(info.total_memory), available=int(info.available_memory))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


def weights_bytes(model: ModelConfig) -> int:
    """Bytes of the checkpoint's weight files (0 when ``model.path`` is no local directory)."""
    root = Path(model.path)
    if not root.is_dir():
        return 0
    return sum(f.stat().st_size for f in root.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


def _hf_config(model: ModelConfig) -> dict:
    """The checkpoint's ``config.json`` ({} when unreadable: the sizes below then go without it)."""
    try:
        return json.loads((Path(model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def kv_bytes_per_token(model: ModelConfig, hf: dict) -> Optional[int]:
    """K and V of one token over every layer (None when ``hf`` lacks the shapes)."""
    try:
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        kv_heads = hf.get("num_key_value_heads") or heads
        layers = hf["num_hidden_layers"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    dtype_bytes = 4 if model.dtype == "float32" else 2
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def auto_cpu_kv_bytes(model: ModelConfig, node: NodeMemory, weights: int) -> int:
    """The KV cache for a CPU replica that set no size: see the module's docstring."""
    free = node.available - weights - CPU_ENGINE_OVERHEAD
    ceiling = CPU_KV_CEILING
    hf = _hf_config(model)
    per_token, max_len = kv_bytes_per_token(model, hf), model.max_model_len or hf.get("max_position_embeddings")
    if per_token and max_len:
        ceiling = min(ceiling, max(CPU_KV_FLOOR, per_token * max_len * model.max_num_seqs))
    if free < CPU_KV_FLOOR:
        raise EngineStartError(
            f"not enough free memory for the engine: the node has {_gib(node.available)} free, the weights take "
            f"{_gib(weights)} and the smallest KV cache {_gib(CPU_KV_FLOOR)}; free memory, or set "
            f"model.kv_cache_memory_bytes to a size that fits",
            "model.kv_cache_memory_bytes",
        )
    return int(min(ceiling, max(CPU_KV_FLOOR, free * CPU_KV_SHARE)))


def memory_kwargs(model: ModelConfig, device: str, node: Optional[NodeMemory] = None) -> dict[str, object]:
    """``kv_cache_memory_bytes`` or ``gpu_memory_utilization`` for vLLM's engine arguments.

    On CPU this reads the node's memory (``node``, or :meth:`NodeMemory.here`) and raises
    :class:`EngineStartError` for a size that cannot fit; call it where the engine runs.
    """
    if device != "cpu":
        if model.kv_cache_memory_bytes is not None:
            return {"kv_cache_memory_bytes": model.kv_cache_memory_bytes}
        return {"gpu_memory_utilization": model.gpu_memory_utilization or GPU_MEMORY_UTILIZATION}
    node = node or NodeMemory.here()
    weights = weights_bytes(model)
    if model.kv_cache_memory_bytes is not None:
        need = model.kv_cache_memory_bytes + weights + CPU_ENGINE_OVERHEAD
        if need > node.available:
            raise EngineStartError(
                f"model.kv_cache_memory_bytes = {_gib(model.kv_cache_memory_bytes)} does not fit: with the weights "
                f"({_gib(weights)}) the engine needs about {_gib(need)}, and the node has {_gib(node.available)} free; "
                f"lower model.kv_cache_memory_bytes",
                "model.kv_cache_memory_bytes",
            )
        return {"kv_cache_memory_bytes": model.kv_cache_memory_bytes}
    if model.gpu_memory_utilization is not None:
        # vLLM's own check on CPU: the fraction of the node's total must be free now.
        want = int(node.total * model.gpu_memory_utilization)
        if want > node.available:
            raise EngineStartError(
                f"model.gpu_memory_utilization = {model.gpu_memory_utilization} asks for {_gib(want)} of the node's "
                f"{_gib(node.total)}, and {_gib(node.available)} is free; lower model.gpu_memory_utilization, or leave it "
                f"unset to size the KV cache from free memory",
                "model.gpu_memory_utilization",
            )
        return {"gpu_memory_utilization": model.gpu_memory_utilization}
    kv = auto_cpu_kv_bytes(model, node, weights)
    logger.info(
        "KV cache sized from free memory: %s (node: %s free of %s; weights %s); set model.kv_cache_memory_bytes to choose",
        _gib(kv), _gib(node.available), _gib(node.total), _gib(weights),
    )
    return {"kv_cache_memory_bytes": kv}
