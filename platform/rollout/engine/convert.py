"""Translation between our API models and vLLM's types (the only place that knows both)."""

from __future__ import annotations

from typing import Any, Optional

from vllm import SamplingParams
from vllm.logprobs import FlatLogprobs
from vllm.sampling_params import RequestOutputKind

from rollout.api import RolloutChunk, RoutedExperts, Sample, SamplingConfig, StructuredOutputs, WeightVersionSpan
from rollout.errors import InvalidRequestError
from rollout.sync.adapters import ServedAdapter
from rollout.contracts.version import version_of


def to_structured_outputs(so: Optional[StructuredOutputs]) -> Any:
    from vllm.sampling_params import StructuredOutputsParams

    if so is None:
        return None
    return StructuredOutputsParams(json=so.json_schema, regex=so.regex, choice=so.choice)


# Our request fields for the names vLLM's validation errors give (``parameter``).
_FIELDS = {"n": "n", **{name: f"sampling.{name}" for name in SamplingConfig.model_fields}}


def to_sampling_params(
    cfg: SamplingConfig, n: int, stream: bool = False, constraint: Any = None, skip_special_tokens: bool = True, routed_experts_start: int = 0
) -> SamplingParams:
    """``constraint`` (vLLM's StructuredOutputsParams) is an episode's tool-call constraint;
    the request's own ``structured_outputs`` replace it.

    Raises :class:`InvalidRequestError` for a combination vLLM refuses that our own checks
    (:mod:`rollout.api`, :mod:`rollout.engine.validation`) let through: a request's fault,
    not the platform's (it was a bare 500 before)."""
    from vllm.exceptions import VLLMValidationError

    try:
        params = _sampling_params(cfg, n, stream, constraint, skip_special_tokens)
    except VLLMValidationError as e:
        raise InvalidRequestError(_FIELDS.get(e.parameter or "", "sampling"), str(e.args[0]) if e.args else str(e)) from None
    # An episode's turn asks only for the rows after those its earlier turns returned.
    params.routed_experts_prompt_start = routed_experts_start
    return params


def _sampling_params(cfg: SamplingConfig, n: int, stream: bool, constraint: Any, skip_special_tokens: bool) -> SamplingParams:
    return SamplingParams(
        n=n,
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=cfg.seed,
        stop=list(cfg.stop) or None,
        stop_token_ids=list(cfg.stop_token_ids) or None,
        ignore_eos=cfg.ignore_eos,
        structured_outputs=to_structured_outputs(cfg.structured_outputs) if cfg.structured_outputs is not None else constraint,
        skip_special_tokens=skip_special_tokens,
        # 0 asks vLLM for the logprob of the sampled token only: what a policy gradient needs.
        logprobs=0 if cfg.logprobs else None,
        # Kept in flat lists (vLLM's FlatLogprobs) rather than a dict and a Logprob object
        # per token: a constant number of objects a request, read back as a slice
        # (sampled_logprobs). `vllm serve` has no such option (its API returns dicts).
        flat_logprobs=True,
        # Unary calls only need the final output; per-step outputs would cost CPU for nothing.
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> Optional[list[float]]:
    """The sampled tokens' logprobs, in token order.

    vLLM puts the sampled token first at every position. Asked for it alone (``logprobs=0``,
    :func:`to_sampling_params`) in flat form, each position holds one entry, and the list is
    vLLM's own, as it stands; a position with more (top-k asked for elsewhere, or the
    per-position dicts of a non-flat output) is read position by position."""
    if logprobs is None:
        return None
    if isinstance(logprobs, FlatLogprobs):
        if len(logprobs.logprobs) == len(token_ids) == len(logprobs.start_indices):
            return logprobs.logprobs
        return [logprobs.logprobs[start] for start in logprobs.start_indices[: len(token_ids)]]
    return [float(step[tid].logprob) for tid, step in zip(token_ids, logprobs)]


def spans(completion: Any, lora: Optional[ServedAdapter] = None) -> list[WeightVersionSpan]:
    """vLLM's per-token version spans, each naming the adapter version the request ran
    with: fixed for the request's life (a commit serves the next request)."""
    named = {"adapter": lora.name, "adapter_version": lora.version} if lora is not None else {}
    # vLLM labels versions with strings ("default", then the numbers this platform sets):
    # ours are the integers publishes return.
    return [
        WeightVersionSpan(version=version_of(s.version), start=s.start, end=s.end, **named)
        for s in (completion.weight_versions or [])
    ]


def routed_experts(completion: Any, prompt_len: int, start: int = 0) -> Optional[RoutedExperts]:
    """vLLM's routed experts of a finished sample (``[tokens, layers, top_k]``, from the
    prompt position ``start``, every token but the last: the last was never run through the
    model), checked against the tokens they belong to. None for an aborted sample."""
    rows = completion.routed_experts
    expected = prompt_len + len(completion.token_ids) - 1 - start
    if rows is None:
        if completion.finish_reason in (None, "abort"):
            return None
        raise RuntimeError(
            f"the engine returned no routed experts for a finished sample ({completion.finish_reason}, {len(completion.token_ids)} tokens) although "
            "model.return_routed_experts is on: its V2 model runner did not capture them"
        )
    if rows.ndim != 3 or rows.shape[0] != expected:
        raise RuntimeError(
            f"the engine's routed experts (shape {tuple(rows.shape)}) do not cover the sample's tokens: {prompt_len} prompt + "
            f"{len(completion.token_ids)} sampled - 1 - start {start} = {expected} rows expected"
        )
    return RoutedExperts.from_numpy(rows, start=start)


def to_sample(completion: Any, lora: Optional[ServedAdapter] = None, routed: Optional[tuple[int, int]] = None) -> Sample:
    """``routed``: (prompt length, first row's position) when the request asked for routed experts."""
    token_ids = list(completion.token_ids)
    return Sample(
        token_ids=token_ids,
        logprobs=sampled_logprobs(token_ids, completion.logprobs),
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        text=completion.text,
        weight_versions=spans(completion, lora),
        routed_experts=routed_experts(completion, *routed) if routed is not None else None,
    )


def to_chunk(
    request_id: str, completion: Any, prompt_token_ids: Optional[list[int]] = None, lora: Optional[ServedAdapter] = None, routed: Optional[tuple[int, int]] = None
) -> RolloutChunk:
    """``routed``: when the request asked for routed experts, (the prompt's length, the
    sample's tokens before this chunk): vLLM hands them over with a sample's last output,
    its rows covering the whole sample, while the output holds only the new tokens."""
    token_ids = list(completion.token_ids)
    experts = None
    if routed is not None and completion.finish_reason is not None:
        prompt_len, before = routed
        experts = routed_experts(completion, prompt_len + before)
    return RolloutChunk(
        request_id=request_id,
        index=completion.index,
        token_ids=token_ids,
        logprobs=sampled_logprobs(token_ids, completion.logprobs),
        text=completion.text or "",
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        weight_versions=spans(completion, lora),
        prompt_token_ids=prompt_token_ids,
        routed_experts=experts,
    )
