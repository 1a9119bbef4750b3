"""vLLM's own Qwen2ForCausalLM built on CPU from the demo model, for checks that compare a
weight-loading path with vLLM's ``load_weights`` on the real model's loaders. Run it in a
process of its own (it initializes vLLM's distributed state): the checks that use it run a
script in a subprocess."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch


@contextmanager
def qwen2_on_cpu(model_dir: str, port: int, tied: Optional[bool] = None) -> Iterator[tuple[torch.nn.Module, torch.Generator]]:
    """The model (float32, its parameters random: nothing loaded yet) inside vLLM's config
    context, and the generator that randomized them (seeded 0). ``tied`` overrides the
    config's ``tie_word_embeddings``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    cfg = EngineArgs(model=model_dir, dtype="float32", max_model_len=256).create_engine_config()
    if tied is not None:
        cfg.model_config.hf_config.tie_word_embeddings = tied
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = Qwen2ForCausalLM(vllm_config=cfg)
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
        yield model, g
