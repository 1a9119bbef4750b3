"""A fresh vLLM engine (``vllm.LLM``) in a Ray actor: the reference our service must match."""

from __future__ import annotations

from typing import Any

import ray


@ray.remote(num_cpus=0)
class ReferenceLLM:
    def __init__(self, model_path: str, max_model_len: int, kv_cache_memory_bytes: int):
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            dtype="float32",
            seed=0,
            enable_prefix_caching=True,
        )

    def greedy(self, prompts: list[list[int]], max_tokens: int, **params: Any) -> list[list[int]]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def teacher_forced_logprobs(self, token_ids: list[int]) -> list[float | None]:
        """The model's logprob of each token of ``token_ids`` given the ones before it (the
        first has none): what a trainer recomputes for a trajectory."""
        from vllm import SamplingParams

        (out,) = self.llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        return [None] + [step[t].logprob for t, step in zip(token_ids[1:], out.prompt_logprobs[1:])]
