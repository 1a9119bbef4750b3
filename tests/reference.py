"""The reference our service must match: a bare vLLM engine (``vllm.LLM``) in a Ray actor,
loaded with the checkpoint each call names.

One engine serves the whole test session (base model, policy v1, v2, ...): an engine start
costs ~15-22 CPU-s on this 2-core machine (issue 28), a weight reload well under one. It
switches checkpoints with vLLM's own reload path (the worker's ``reload_weights``, the one
the replicas use for a shared-storage publish) and then drops its prefix cache, so no KV
computed with other weights is reused. A reload equals a fresh engine on that checkpoint:
checked by hand, see the commit that introduced :class:`Reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

ACTOR_NAME = "reference-llm"


@ray.remote(num_cpus=0)
class ReferenceLLM:
    def __init__(self, model_path: str, max_model_len: int, kv_cache_memory_bytes: int, enforce_eager: bool):
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            dtype="float32",
            seed=0,
            enable_prefix_caching=True,
            enforce_eager=enforce_eager,
        )
        self.loaded = model_path

    def _load(self, checkpoint: str | None) -> None:
        """Make ``checkpoint`` the engine's weights (None: keep the loaded ones). The actor
        runs one call at a time (Ray's default for a sync actor), so no request of another
        checkpoint is in flight while the weights change."""
        if checkpoint is None or checkpoint == self.loaded:
            return
        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 (tests/conftest.py) the engine core and its
        # one worker (the uni executor) run in this actor; the CPU worker inherits vLLM's
        # Worker.reload_weights, which reads the directory in checkpoint format.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})
        self.loaded = checkpoint
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"the reference engine could not drop its prefix cache after loading {checkpoint}")

    def greedy(self, prompts: list[list[int]], max_tokens: int, checkpoint: str | None = None, **params: Any) -> list[list[int]]:
        from vllm import SamplingParams

        self._load(checkpoint)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def teacher_forced_logprobs(self, token_ids: list[int], checkpoint: str | None = None) -> list[float | None]:
        """The model's logprob of each token of ``token_ids`` given the ones before it (the
        first has none): what a trainer recomputes for a trajectory."""
        from vllm import SamplingParams

        self._load(checkpoint)
        (out,) = self.llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        return [None] + [step[t].logprob for t, step in zip(token_ids[1:], out.prompt_logprobs[1:])]


@dataclass(frozen=True)
class _Method:
    actor_method: Any
    checkpoint: str

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.actor_method.remote(*args, checkpoint=self.checkpoint, **kwargs)


@dataclass(frozen=True)
class Reference:
    """The shared engine bound to one checkpoint, used exactly like an actor handle
    (``ray.get(ref.greedy.remote(prompts, n, **params))``), so the tests that compare
    against "a fresh engine on checkpoint X" read as before while one engine serves them all.
    Frozen: a fixture's reference stays bound to its checkpoint."""

    actor: Any
    checkpoint: str

    @property
    def greedy(self) -> _Method:
        return _Method(self.actor.greedy, self.checkpoint)

    @property
    def teacher_forced_logprobs(self) -> _Method:
        return _Method(self.actor.teacher_forced_logprobs, self.checkpoint)


def reference_engine(checkpoint, max_model_len: int, kv_cache_memory_bytes: int) -> Reference:
    """The session's reference engine, bound to ``checkpoint``. The engine is a named actor
    in the test session's Ray cluster: the first call starts it (loading ``checkpoint``, so
    the first user pays no reload), later calls find it. It runs in the test engines' mode
    (tests/engines.py), as the replicas it is compared with."""
    from ray import cloudpickle

    import tests.reference
    from tests.engines import ENFORCE_EAGER

    # Workers cannot import the tests package; ship the actor's code with it.
    cloudpickle.register_pickle_by_value(tests.reference)
    path = str(checkpoint)
    actor = ReferenceLLM.options(name=ACTOR_NAME, get_if_exists=True).remote(path, max_model_len, kv_cache_memory_bytes, ENFORCE_EAGER)
    return Reference(actor, path)
