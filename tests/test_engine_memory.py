"""Unit tests of rollout.engine.memory: what a replica asks vLLM for, from the node's memory."""

from __future__ import annotations

import json

import pytest

from rollout.config import ModelConfig
from rollout.engine.memory import (
    CPU_KV_CEILING,
    CPU_KV_FLOOR,
    GIB,
    MIB,
    EngineStartError,
    NodeMemory,
    memory_kwargs,
)


@pytest.fixture
def checkpoint(tmp_path):
    """A model folder: 100 MiB of weights; 2 layers x 2 KV heads x 64 dims (fp32: 2 KiB a token)."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (100 * MIB))
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256, "num_hidden_layers": 2, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def model(path, **kw) -> ModelConfig:
    return ModelConfig(path=str(path), **kw)


def test_cpu_without_a_size_takes_a_quarter_of_the_free_memory_after_the_weights(checkpoint):
    node = NodeMemory(total=24 * GIB, available=8 * GIB)
    kv = memory_kwargs(model(checkpoint, max_model_len=2048, max_num_seqs=4096), "cpu", node)["kv_cache_memory_bytes"]
    assert kv == int((8 * GIB - 100 * MIB - 512 * MIB) * 0.25)


def test_cpu_without_a_size_is_capped_by_what_the_sequences_can_fill_and_by_the_ceiling(checkpoint):
    node = NodeMemory(total=256 * GIB, available=200 * GIB)
    # fp32: 2 (K, V) x 2 layers x 2 heads x 64 dims x 4 bytes = 2 KiB a token; 8 x 2048 tokens = 32 MiB -> the floor.
    small = memory_kwargs(model(checkpoint, dtype="float32", max_model_len=2048, max_num_seqs=8), "cpu", node)
    assert small == {"kv_cache_memory_bytes": CPU_KV_FLOOR}
    big = memory_kwargs(model(checkpoint, max_model_len=4096, max_num_seqs=4096), "cpu", node)
    assert big == {"kv_cache_memory_bytes": CPU_KV_CEILING}


def test_cpu_without_room_for_the_smallest_cache_names_the_field(checkpoint):
    with pytest.raises(EngineStartError, match="model.kv_cache_memory_bytes") as e:
        memory_kwargs(model(checkpoint), "cpu", NodeMemory(total=4 * GIB, available=700 * MIB))
    assert e.value.field == "model.kv_cache_memory_bytes"


def test_a_cpu_kv_size_larger_than_free_memory_fails_naming_the_field(checkpoint):
    node = NodeMemory(total=24 * GIB, available=8 * GIB)
    assert memory_kwargs(model(checkpoint, kv_cache_memory_bytes=GIB), "cpu", node) == {"kv_cache_memory_bytes": GIB}
    with pytest.raises(EngineStartError, match=r"model.kv_cache_memory_bytes = 64.00 GiB does not fit.*8.00 GiB free") as e:
        memory_kwargs(model(checkpoint, kv_cache_memory_bytes=64 * GIB), "cpu", node)
    assert e.value.field == "model.kv_cache_memory_bytes"
    assert "\n" not in str(e.value)


def test_a_cpu_utilization_that_is_not_free_fails_like_vllms_check_but_names_the_field(checkpoint):
    node = NodeMemory(total=24 * GIB, available=20 * GIB)
    assert memory_kwargs(model(checkpoint, gpu_memory_utilization=0.5), "cpu", node) == {"gpu_memory_utilization": 0.5}
    with pytest.raises(EngineStartError, match="model.gpu_memory_utilization = 0.9 asks for 21.60 GiB") as e:
        memory_kwargs(model(checkpoint, gpu_memory_utilization=0.9), "cpu", node)
    assert e.value.field == "model.gpu_memory_utilization"


def test_gpus_keep_vllms_default_and_read_no_node_memory(checkpoint):
    assert memory_kwargs(model(checkpoint), "cuda") == {"gpu_memory_utilization": 0.9}
    assert memory_kwargs(model(checkpoint, gpu_memory_utilization=0.35), "cuda") == {"gpu_memory_utilization": 0.35}
    assert memory_kwargs(model(checkpoint, kv_cache_memory_bytes=GIB), "cuda") == {"kv_cache_memory_bytes": GIB}


def test_the_node_reading_is_vllms_own():
    node = NodeMemory.here()
    assert 0 < node.available <= node.total
