"""Episodes, one module at a time: rendering only the new messages after a model turn (with
the built model's own tokenizer and chat template), the store's bounds and errors, the
router's pin of an episode to its replica, and an episode's LoRA adapter."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from rollout.episodes import EpisodeLostError, EpisodeState, EpisodeStore, episode_id_for, render_after_model_turn, render_initial, replica_of
from rollout.errors import InvalidRequestError
from rollout.routing.router import AffinityRouter


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_new_messages_are_rendered_on_their_own_and_close_the_models_turn(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tool = [{"role": "tool", "content": "42"}]
    after_cut_off = render_after_model_turn(tokenizer, tool, last_token=1234)
    assert tokenizer.decode(after_cut_off) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # A model turn that ended with the turn's closing token is not closed twice.
    after_closed = render_after_model_turn(tokenizer, tool, last_token=im_end)
    assert after_closed == after_cut_off[1:] and after_cut_off[0] == im_end


def test_the_opening_messages_are_the_templates_own_rendering(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert render_initial(tokenizer, messages) == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def state(eid: str) -> EpisodeState:
    return EpisodeState(eid, [], [], [], max_turns=4, max_tokens=100)


def test_the_store_is_bounded_and_names_what_happened():
    store = EpisodeStore(max_episodes=2, idle_expiry_s=0.2)
    store.add(state("r.a"))
    store.add(state("r.b"))
    with pytest.raises(InvalidRequestError, match="episodes.max_per_replica=2"):
        store.add(state("r.c"))
    time.sleep(0.3)
    with pytest.raises(EpisodeLostError, match="idle longer than episodes.idle_expiry_s=0.2 s, or the replica that held it restarted"):
        store.get("r.a")
    store.add(state("r.c"))  # the expired ones made room
    assert store.pop("r.c").episode_id == "r.c" and len(store) == 0


def test_an_episode_id_names_its_replica_and_the_router_pins_to_it():
    eid = episode_id_for("abc123")
    assert replica_of(eid) == "abc123" and replica_of("no-dot") is None

    class Pending:
        def __init__(self, arg):
            self.args = [arg]

    assert AffinityRouter._pinned(Pending({"episode_id": eid})) == "abc123"
    assert AffinityRouter._pinned(Pending({"prompt": "x"})) is None


async def test_an_episode_names_an_adapter_each_turn_takes_its_newest_committed_version_and_an_unknown_or_unloaded_one_is_refused(model_dir, tokenizer):
    from rollout.api import EpisodeRef, EpisodeStart, EpisodeTurn, Sample, SamplingConfig, WeightVersionSpan
    from rollout.config import PlatformConfig, SyncConfig
    from rollout.engine.episode_service import EpisodeService
    from rollout.engine.sync_gate import SyncGate
    from rollout.rewards import RewardScorer
    from rollout.sync.adapters import ServedAdapter
    from rollout.sync.agent import SyncAgent

    cfg = PlatformConfig.model_validate({"model": {"path": str(model_dir)}, "tools": {"python": {"enabled": False}}})
    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir))
    gate = SyncGate.over(agent, SyncConfig(), "r")
    agent.adapters.served["math"] = ServedAdapter("math", 2, 1, "/unused")
    sent = []

    async def sample(request, plan):
        # As the replica samples: the adapter's version served when the request starts.
        sent.append(request)
        lora = gate.adapter(request.adapter) if request.adapter is not None else None
        span = WeightVersionSpan(version=0, start=0, end=2, adapter=lora and lora.name, adapter_version=lora and lora.version)
        return Sample(token_ids=[11, 12], logprobs=[-0.5, -0.5], finish_reason="length", weight_versions=[span])

    service = EpisodeService(cfg, tokenizer, "r", 512, sample, RewardScorer.from_config(cfg.rewards), check_adapter=gate.adapter)
    opening = [{"role": "user", "content": "2+2?"}]
    try:
        with pytest.raises(InvalidRequestError) as e:
            service.start(EpisodeStart(messages=opening, adapter="nope"))
        assert e.value.field == "adapter" and "not a published LoRA adapter (published: math)" in e.value.message
        assert len(service.store) == 0, "a refused start leaves no episode"

        started = service.start(EpisodeStart(messages=opening, adapter="math"))
        await service.turn(EpisodeTurn(episode_id=started.episode_id, sampling=SamplingConfig(max_tokens=2)))
        agent.adapters.served["math"] = ServedAdapter("math", 3, 2, "/unused")  # a publish committed between the turns
        await service.turn(EpisodeTurn(episode_id=started.episode_id, messages=[{"role": "user", "content": "sure?"}], sampling=SamplingConfig(max_tokens=2)))
        traj = await service.trajectory(EpisodeRef(episode_id=started.episode_id), end=True)
        assert [r.adapter for r in sent] == ["math", "math"]
        first, second = traj.turns
        assert [(sp.adapter, sp.adapter_version, sp.start, sp.end) for sp in first.weight_versions] == [("math", 2, first.start, first.end)]
        assert [(sp.adapter, sp.adapter_version, sp.start, sp.end) for sp in second.weight_versions] == [("math", 3, second.start, second.end)]

        unloaded = service.start(EpisodeStart(messages=opening, adapter="math"))
        del agent.adapters.served["math"]  # an unload committed before the episode's first turn
        with pytest.raises(InvalidRequestError) as e:
            await service.turn(EpisodeTurn(episode_id=unloaded.episode_id, sampling=SamplingConfig(max_tokens=2)))
        assert e.value.field == "episode_id" and "LoRA adapter 'math', which is no longer served" in e.value.message, e.value
        assert len(sent) == 2, "refused before any sampling"

        base = service.start(EpisodeStart(messages=opening))
        await service.turn(EpisodeTurn(episode_id=base.episode_id, sampling=SamplingConfig(max_tokens=2)))
        assert sent[-1].adapter is None, "no adapter named: the base model"
    finally:
        service.close()
        agent.adapters.close()
