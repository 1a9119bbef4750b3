"""A LoRA adapter for the demo model, built in code in PEFT's layout (what
``get_peft_model_state_dict`` and ``adapter_config.json`` hold), and written as PEFT writes
it for a reference vLLM engine to load."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGETS = ("q_proj", "v_proj", "down_proj")


def demo_adapter(model_dir: Path, seed: int, r: int = 8, scale: float = 0.5) -> tuple[dict[str, torch.Tensor], dict]:
    """Random LoRA tensors for every target module of every layer: large enough that the
    adapter changes greedy output, so a test can tell which adapter version produced it."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    shapes = {  # module -> (in, out), as the base model's weights are (out, in)
        "self_attn.q_proj": (hidden, cfg["num_attention_heads"] * head_dim),
        "self_attn.v_proj": (hidden, cfg["num_key_value_heads"] * head_dim),
        "mlp.down_proj": (cfg["intermediate_size"], hidden),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * scale
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(TARGETS), "bias": "none", "base_model_name_or_path": str(model_dir)}
    return tensors, config


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> str:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)


def reference_with_lora(max_model_len: int, kv_cache_memory_bytes: int, max_lora_rank: int):
    """A fresh vLLM engine (``vllm.LLM``, in a Ray actor) with vLLM's LoRA support: what the
    platform must answer like for a request naming an adapter; in the test engines' mode
    (tests/engines.py), as the replicas it is compared with."""
    import ray
    from ray import cloudpickle

    import tests.lora
    from tests.engines import ENFORCE_EAGER

    cloudpickle.register_pickle_by_value(tests.lora)  # workers cannot import the tests package
    return ray.remote(num_cpus=0)(LoraReferenceLLM).remote(max_model_len, kv_cache_memory_bytes, max_lora_rank, ENFORCE_EAGER)


class LoraReferenceLLM:
    def __init__(self, max_model_len: int, kv_cache_memory_bytes: int, max_lora_rank: int, enforce_eager: bool):
        self.args = dict(max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes, max_lora_rank=max_lora_rank, enforce_eager=enforce_eager)
        self.llm = None

    def start(self, model_path: str) -> None:
        from vllm import LLM

        self.llm = LLM(model=model_path, dtype="float32", seed=0, enable_prefix_caching=True, enable_lora=True, max_loras=2, **self.args)

    def greedy(self, prompts: list[list[int]], max_tokens: int, adapter_dir: str | None = None, lora_id: int = 1) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(f"reference-{lora_id}", lora_id, adapter_dir) if adapter_dir else None
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=lora)
        return [list(o.outputs[0].token_ids) for o in outs]
