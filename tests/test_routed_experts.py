"""Routed experts (router replay, "R3") and FP8 replicas on the CPU: the wire format of
:class:`rollout.api.RoutedExperts`, its alignment with the tokens of samples, streams and
episodes (over a fake engine that answers as vLLM 0.32's AuxOutput connector does), and the
clear refusals where the CPU build cannot run them. The engines themselves return routed
experts and quantize to FP8 only on GPU: tests/gpu/test_gpu_moe.py checks those."""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from rollout.api import EpisodeRef, EpisodeStart, EpisodeTurn, RolloutBatchResult, RolloutChunk, RolloutRequest, RoutedExperts, SamplingConfig, Trajectory, TurnResult
from rollout.config import load_config
from rollout.engine.adapter import EngineAdapter
from rollout.engine.replica import RolloutEngine
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.sync_gate import SyncGate
from rollout.engine.validation import ROUTED_EXPERTS_OFF, ModelLimits, routed_experts_refusal
from rollout.errors import InvalidRequestError
from rollout.rewards import RewardScorer

LAYERS, TOP_K = 3, 2


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# ---- the wire format --------------------------------------------------------------------


def test_routed_experts_round_trip_through_json_as_little_endian_base64_with_shape_and_dtype():
    rows = np.arange(5 * LAYERS * TOP_K, dtype=np.uint8).reshape(5, LAYERS, TOP_K)
    re = RoutedExperts.from_numpy(rows, start=2)
    assert (re.start, re.shape, re.dtype, re.num_tokens) == (2, [5, LAYERS, TOP_K], "uint8", 5)
    assert base64.b64decode(re.data) == rows.tobytes()
    back = RoutedExperts.model_validate_json(re.model_dump_json())
    assert back == re and back.to_numpy().dtype == np.uint8 and np.array_equal(back.to_numpy(), rows)

    # More than 256 experts: uint16, little-endian whatever the machine.
    wide = np.array([[[258, 1]]], dtype=np.uint16)
    re16 = RoutedExperts.from_numpy(wide)
    assert re16.dtype == "uint16" and base64.b64decode(re16.data) == b"\x02\x01\x01\x00"
    assert np.array_equal(RoutedExperts.model_validate_json(re16.model_dump_json()).to_numpy(), wide)
    # Other integer arrays take the narrowest of the two that holds them.
    assert RoutedExperts.from_numpy(np.array([[[3, 255]]], dtype=np.int64)).dtype == "uint8"
    assert RoutedExperts.from_numpy(np.array([[[3, 256]]], dtype=np.int32)).dtype == "uint16"
    # An empty run (a one-token sequence has no row) is still a well-formed array.
    empty = RoutedExperts.from_numpy(np.zeros((0, LAYERS, TOP_K), dtype=np.uint8))
    assert empty.shape == [0, LAYERS, TOP_K] and empty.to_numpy().shape == (0, LAYERS, TOP_K)


def test_routed_experts_whose_data_does_not_fit_the_shape_or_is_not_an_expert_array_are_refused():
    re = RoutedExperts.from_numpy(np.ones((4, LAYERS, TOP_K), dtype=np.uint8))
    with pytest.raises(ValidationError, match="needs"):
        RoutedExperts(start=0, shape=[5, LAYERS, TOP_K], dtype="uint8", data=re.data)
    with pytest.raises(ValidationError, match="needs"):
        RoutedExperts(start=0, shape=[4, LAYERS, TOP_K], dtype="uint16", data=re.data)
    with pytest.raises(ValidationError):
        RoutedExperts(start=0, shape=[4, LAYERS], dtype="uint8", data=re.data)
    with pytest.raises(ValidationError):
        RoutedExperts(start=0, shape=[4, LAYERS, TOP_K], dtype="int8", data=re.data)
    with pytest.raises(ValueError, match=r"\[num_tokens, num_layers, top_k\]"):
        RoutedExperts.from_numpy(np.ones((4, LAYERS), dtype=np.uint8))
    with pytest.raises(ValueError, match="outside 0..65535"):
        RoutedExperts.from_numpy(np.array([[[-1, 2]]]))


# ---- a fake engine answering as vLLM's AuxOutput connector does -------------------------


def expert_ids(position: int) -> np.ndarray:
    """The experts the fake model routes the token at ``position`` to (a function of the
    position only, so any run can be checked against it)."""
    return np.array([[(position * 7 + layer * 3 + k) % 64 for k in range(TOP_K)] for layer in range(LAYERS)], dtype=np.uint8)


def routed_rows(start: int, end: int) -> np.ndarray:
    return np.stack([expert_ids(p) for p in range(start, end)]) if end > start else np.zeros((0, LAYERS, TOP_K), dtype=np.uint8)


class RoutingEngine:
    """Generates ``max_tokens`` tokens (ids 10, 11, ...) in steps of one; the final output of
    each sample carries rows for every token the model ran: from the request's
    ``routed_experts_prompt_start`` up to, not including, the last sampled token (vLLM's
    scheduler: token_end = num_tokens - 1), as vLLM returns them only with a finished sample."""

    errored = False
    dead_error = None

    def __init__(self):
        self.params = []

    async def generate(self, prompt, params, request_id, **_):
        self.params.append(params)
        prompt_len, tokens = len(prompt["prompt_token_ids"]), params.max_tokens
        delta = params.output_kind.name == "DELTA"

        def completion(index: int, upto: int) -> SimpleNamespace:
            last = upto == tokens
            return SimpleNamespace(
                index=index,
                token_ids=[10 + upto - 1] if delta else [10 + i for i in range(upto)],
                logprobs=None,
                finish_reason="length" if last else None,
                stop_reason=None,
                text="",
                weight_versions=None,
                routed_experts=routed_rows(params.routed_experts_prompt_start, prompt_len + upto - 1) if last else None,
            )

        if not delta:  # FINAL_ONLY: one output holding every sample
            await asyncio.sleep(0)
            yield SimpleNamespace(outputs=[completion(i, tokens) for i in range(params.n)])
            return
        for upto in range(1, tokens + 1):
            await asyncio.sleep(0)
            yield SimpleNamespace(outputs=[completion(i, upto) for i in range(params.n)])

    async def check_health(self):
        return None

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self):
        pass


def replica(engine, on: bool = True, **config) -> RolloutEngine:
    r = object.__new__(RolloutEngine)  # the parts only: no vLLM engine behind them
    cfg = load_config({"model": {"path": "/models/x", "return_routed_experts": on}, **config}, environ={})
    limits = ModelLimits(vocab_size=100, max_model_len=64, max_n=4, routed_experts_refusal=routed_experts_refusal(cfg.model, "cuda"))
    adapter = EngineAdapter(engine, None, limits, SchedulerSnapshot())
    r._assemble(cfg, "r", adapter, SyncGate.over(None, cfg.sync, "r"), RewardScorer.from_config(cfg.rewards))
    return r


def request(**fields) -> RolloutRequest:
    return RolloutRequest(**{"prompt_token_ids": [1, 2, 3, 4], "sampling": SamplingConfig(max_tokens=3), **fields})


async def test_each_sample_carries_the_experts_of_its_prompt_and_sampled_tokens_only_when_asked_and_they_survive_the_http_body():
    engine = RoutingEngine()
    r = replica(engine)
    asked, plain = await r.generate([request(return_routed_experts=True, n=2, sampling=SamplingConfig(max_tokens=3, temperature=1.0)), request()])
    assert engine.params[0].routed_experts_prompt_start == 0
    for sample in asked.samples:
        re = sample.routed_experts
        # prompt 4 + sampled 3 tokens: rows for all but the last (never run through the model).
        assert re.start == 0 and re.shape == [4 + 3 - 1, LAYERS, TOP_K]
        assert np.array_equal(re.to_numpy(), routed_rows(0, 6))
    assert plain.samples[0].routed_experts is None, "the engine captures them for every request; only one that asked gets them"

    body = RolloutBatchResult(results=[asked, plain]).model_dump_json(exclude_none=True)  # as the ingress answers /v1/rollouts
    parsed = RolloutBatchResult.model_validate_json(body)
    assert parsed.results[0].samples[1].routed_experts == asked.samples[1].routed_experts
    assert "routed_experts" not in body.split('"request_id"')[2], "a request that did not ask carries no field"


async def test_a_stream_carries_the_whole_samples_experts_on_its_last_chunk():
    r = replica(RoutingEngine())
    chunks = [c async for c in r.generate_stream(request(return_routed_experts=True, sampling=SamplingConfig(max_tokens=4)))]
    assert [c.routed_experts is None for c in chunks] == [True, True, True, False]
    last = RolloutChunk.model_validate_json(chunks[-1].model_dump_json())  # an NDJSON line
    assert last.routed_experts.shape == [4 + 4 - 1, LAYERS, TOP_K] and np.array_equal(last.routed_experts.to_numpy(), routed_rows(0, 7))


async def test_rows_that_do_not_cover_the_tokens_fail_loudly_rather_than_misalign():
    class ShortEngine(RoutingEngine):
        async def generate(self, prompt, params, request_id, **_):
            async for out in super().generate(prompt, params, request_id):
                c = out.outputs[0]
                if c.routed_experts is not None:
                    c.routed_experts = c.routed_experts[1:]
                yield out

    with pytest.raises(RuntimeError, match="do not cover the sample's tokens: 4 prompt \\+ 3 sampled - 1 - start 0 = 6 rows expected"):
        await replica(ShortEngine()).generate([request(return_routed_experts=True)])

    class NoRowsEngine(RoutingEngine):
        async def generate(self, prompt, params, request_id, **_):
            async for out in super().generate(prompt, params, request_id):
                out.outputs[0].routed_experts = None
                yield out

    with pytest.raises(RuntimeError, match="returned no routed experts for a finished sample"):
        await replica(NoRowsEngine()).generate([request(return_routed_experts=True)])


async def test_a_request_or_episode_asking_where_the_setting_is_off_or_on_cpu_gets_a_400_naming_the_field():
    r = replica(RoutingEngine(), on=False)
    with pytest.raises(InvalidRequestError) as e:
        await r.generate([request(), request(return_routed_experts=True)])
    assert e.value.field == "requests[1].return_routed_experts" and ROUTED_EXPERTS_OFF in e.value.message

    cfg = load_config({"model": {"path": "/models/x"}}, environ={})
    assert routed_experts_refusal(cfg.model, "cuda") == ROUTED_EXPERTS_OFF
    on_cpu = routed_experts_refusal(cfg.model, "cpu")
    assert "V2 model runner" in on_cpu and "Triton" in on_cpu, on_cpu


# ---- episodes ---------------------------------------------------------------------------


async def test_each_turn_returns_the_rows_after_the_earlier_turns_and_the_trajectory_all_of_them_aligned_with_its_tokens(model_dir, tokenizer):
    from rollout.engine.episode_service import EpisodeService

    engine = RoutingEngine()
    r = replica(engine, tools={"python": {"enabled": False}})
    r.adapter.limits = ModelLimits(vocab_size=len(tokenizer), max_model_len=512, max_n=4, routed_experts_refusal=None)
    r.admission.model = r.adapter.limits
    service = EpisodeService(r.config, tokenizer, "r", 512, r._sample_in_episode, r.rewards, check_adapter=r.gate.adapter, routed_experts_refusal=None)
    started = service.start(EpisodeStart(messages=[{"role": "user", "content": "2+2?"}], return_routed_experts=True))
    first = await service.turn(EpisodeTurn(episode_id=started.episode_id, sampling=SamplingConfig(max_tokens=3)))
    second = await service.turn(EpisodeTurn(episode_id=started.episode_id, messages=[{"role": "user", "content": "sure?"}], sampling=SamplingConfig(max_tokens=2)))
    first, second = (TurnResult.model_validate_json(t.model_dump_json()) for t in (first, second))

    opening = len(started.prompt_token_ids)
    # Turn 1: the opening and its own tokens but the last; turn 2 begins at that last token,
    # which it ran as a prompt token, and asks vLLM only for the rows from there.
    assert [p.routed_experts_prompt_start for p in engine.params] == [0, opening + 3 - 1]
    assert (first.sample.routed_experts.start, first.sample.routed_experts.num_tokens) == (0, opening + 3 - 1)
    end = opening + 3 + len(second.appended_token_ids) + 2
    assert (second.sample.routed_experts.start, second.sample.routed_experts.num_tokens) == (opening + 2, end - 1 - (opening + 2))

    traj = Trajectory.model_validate_json((await service.trajectory(EpisodeRef(episode_id=started.episode_id), end=True)).model_dump_json())
    assert len(traj.token_ids) == end and traj.routed_experts.start == 0
    assert np.array_equal(traj.routed_experts.to_numpy(), routed_rows(0, end - 1)), "row i is token i's, across turns"


async def test_an_episode_without_routed_experts_asks_for_none_and_one_asking_where_they_are_off_is_refused_at_its_start(model_dir, tokenizer):
    from rollout.engine.episode_service import EpisodeService

    engine = RoutingEngine()
    r = replica(engine, on=False, tools={"python": {"enabled": False}})
    r.adapter.limits = r.admission.model = ModelLimits(vocab_size=len(tokenizer), max_model_len=512, max_n=4)
    service = EpisodeService(r.config, tokenizer, "r", 512, r._sample_in_episode, r.rewards, check_adapter=r.gate.adapter)
    with pytest.raises(InvalidRequestError) as e:
        service.start(EpisodeStart(messages=[{"role": "user", "content": "hi"}], return_routed_experts=True))
    assert e.value.field == "return_routed_experts" and ROUTED_EXPERTS_OFF in e.value.message and len(service.store) == 0
    started = service.start(EpisodeStart(messages=[{"role": "user", "content": "hi"}]))
    turn = await service.turn(EpisodeTurn(episode_id=started.episode_id, sampling=SamplingConfig(max_tokens=2)))
    traj = await service.trajectory(EpisodeRef(episode_id=started.episode_id), end=True)
    assert turn.sample.routed_experts is None and traj.routed_experts is None


# ---- configuration and engine arguments ------------------------------------------------


def test_the_config_refuses_routed_experts_and_fp8_on_cpu_naming_the_field_and_the_reason():
    with pytest.raises(ValidationError, match=r"return_routed_experts: not on CPU: vLLM 0.32 returns routed experts only from its V2 model runner"):
        load_config({"model": {"path": "/m", "device": "cpu", "return_routed_experts": True}}, environ={})
    with pytest.raises(ValidationError, match=r"quantization: not on CPU: vLLM 0.32's CPU build has no FP8 quantization kernel"):
        load_config({"model": {"path": "/m", "device": "cpu", "quantization": "fp8"}}, environ={})
    with pytest.raises(ValidationError, match="return_routed_experts needs enable_prefix_caching"):
        load_config({"model": {"path": "/m", "return_routed_experts": True, "enable_prefix_caching": False}}, environ={})
    with pytest.raises(ValidationError):
        load_config({"model": {"path": "/m", "quantization": "int4"}}, environ={})
    with pytest.raises(ValidationError, match="sparse_nccl cannot publish into model.quantization replicas"):
        load_config({"model": {"path": "/m", "quantization": "fp8"}, "sync": {"backend": "sparse_nccl"}}, environ={})
    load_config({"model": {"path": "/m", "quantization": "fp8"}, "sync": {"backend": "nccl"}}, environ={})
    # From the environment as from a file.
    cfg = load_config({"model": {"path": "/m"}}, environ={"ROLLOUT_MODEL__RETURN_ROUTED_EXPERTS": "true", "ROLLOUT_MODEL__QUANTIZATION": "fp8"})
    assert cfg.model.return_routed_experts and cfg.model.vllm_quantization == "fp8_per_tensor"


def test_a_replica_resolved_to_cpu_refuses_to_start_and_a_gpu_one_asks_vllm_for_both(monkeypatch):
    from rollout.engine.args import V2_RUNNER_ENV, engine_kwargs, prepare_engine_environment
    from rollout.engine.memory import EngineStartError

    cfg = load_config({"model": {"path": "/m", "return_routed_experts": True, "quantization": "fp8_per_block"}}, environ={})  # device: auto
    with pytest.raises(EngineStartError) as e:
        engine_kwargs(cfg.model, "cpu")
    assert e.value.field == "model.return_routed_experts" and "V2 model runner" in str(e.value)
    fp8 = cfg.model.model_copy(update={"return_routed_experts": False})
    with pytest.raises(EngineStartError) as e:
        prepare_engine_environment("cpu", fp8)
    assert e.value.field == "model.quantization" and "FP8" in str(e.value)

    kw = engine_kwargs(cfg.model, "cuda")
    assert kw["enable_return_routed_experts"] is True and kw["quantization"] == "fp8_per_block" and kw["enable_prefix_caching"] is True
    plain = engine_kwargs(load_config({"model": {"path": "/m"}}, environ={}).model, "cuda")
    assert "enable_return_routed_experts" not in plain and "quantization" not in plain

    import os
    from unittest import mock

    # prepare_engine_environment writes os.environ itself (an engine's processes inherit it):
    # the whole environment is restored after, or V2 leaks into later tests' CPU engines
    # ("Model Runner V2 requires Triton").
    before = os.environ.get(V2_RUNNER_ENV)
    with mock.patch.dict(os.environ):
        os.environ.pop(V2_RUNNER_ENV, None)
        prepare_engine_environment("cuda", cfg.model)
        assert os.environ[V2_RUNNER_ENV] == "1", "vLLM returns routed experts only from its V2 model runner"
        os.environ[V2_RUNNER_ENV] = "0"
        with pytest.raises(EngineStartError) as e:
            prepare_engine_environment("cuda", cfg.model)
    assert e.value.field == "model.return_routed_experts" and "VLLM_USE_V2_MODEL_RUNNER='0'" in str(e.value)
    assert os.environ.get(V2_RUNNER_ENV) == before


def test_vllm_serve_gets_the_same_settings_for_the_openai_routes():
    from rollout.engine.args import engine_kwargs
    from rollout.engine.openai_app import parse_serve_args, serve_argv

    cfg = load_config({"model": {"path": "/m", "return_routed_experts": True, "quantization": "fp8"}}, environ={})
    argv = serve_argv(cfg.model, cfg.openai, engine_kwargs(cfg.model, "cuda"))
    assert "--enable-return-routed-experts" in argv and argv[argv.index("--quantization") + 1] == "fp8_per_tensor"
    args = parse_serve_args(argv)
    assert args.enable_return_routed_experts is True and args.quantization == "fp8_per_tensor"
