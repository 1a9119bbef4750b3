"""LoRA adapters as versioned policies end to end: real Ray, Serve, vLLM (CPU) with its
LoRA support, the coordinator and the HTTP ingress.

Runs last but one (before test_scaling_e2e, which replaces the shared app too): it
replaces the shared app with one whose engines start with LoRA on (``model.lora``), so
the other modules' engines keep starting without it.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import ray
import torch

from rollout.api import RolloutRequest, SamplingConfig
from rollout.client import RolloutClient
from rollout.errors import InvalidRequestError
from rollout.sync import WeightPublisher
from tests.conftest import API_KEY, KV_BYTES, MAX_MODEL_LEN, SYNC_TOKEN
from tests.lora import demo_adapter, reference_with_lora, write_adapter

pytestmark = pytest.mark.e2e

APP = "rollout-lora"
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 5]
TOKENS = 16
RANK = 8


@pytest.fixture(scope="module")
def lora_app(ray_cluster, platform_config, model_dir):
    """The shared app replaced by one with LoRA on; yields a function that (re)deploys it
    with ``replicas`` engine replicas (a new count is a scale: same engines, same coordinator)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from rollout.app import deploy
    from rollout.config import LoraConfig

    try:
        serve.delete(platform_config.app_name)
    except RayServeException:
        pass  # Serve is not running yet: no shared app to replace
    model = platform_config.model.model_copy(update={"lora": LoraConfig(enabled=True, max_loras=2, max_lora_rank=RANK)})
    base = platform_config.model_copy(update={"app_name": APP, "model": model})

    def scaled(replicas: int):
        cfg = base.model_copy(update={"deployment": base.deployment.model_copy(update={"replicas": replicas})})
        deploy(cfg)
        return cfg

    yield scaled
    serve.delete(APP)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Versions 1 and 2 of adapter "math" (different tensors), and their PEFT directories."""
    out = []
    for seed in (1, 2):
        tensors, config = demo_adapter(model_dir, seed, r=RANK)
        out.append((tensors, config, write_adapter(tmp_path_factory.mktemp(f"adapter-v{seed}"), tensors, config)))
    return out


@pytest.fixture(scope="module")
def lora_reference(ray_cluster, model_dir, adapters):
    """A fresh vLLM engine with LoRA on: the base model's and each adapter version's greedy output."""
    engine = reference_with_lora(MAX_MODEL_LEN, KV_BYTES, RANK)
    ray.get(engine.start.remote(str(model_dir)))
    return {
        "base": ray.get(engine.greedy.remote(PROMPTS, TOKENS)),
        1: ray.get(engine.greedy.remote(PROMPTS, TOKENS, adapters[0][2], 1)),
        2: ray.get(engine.greedy.remote(PROMPTS, TOKENS, adapters[1][2], 2)),
    }


def greedy(ids, session: str, adapter: str | None = "math") -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=ids, session_id=session, adapter=adapter, sampling=SamplingConfig(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))


async def assert_every_replica_serves(client, want: list[list[int]], replicas: int, adapter_version: int | None, rounds: int = 6, name: str = "math") -> None:
    """Greedy with adapter ``name`` (``adapter_version`` None: without) on every replica
    equals ``want``, and its spans name the adapter version."""
    seen = set()
    adapter = name if adapter_version else None
    for k in range(rounds):
        # Separate calls with distinct sessions: the affinity router spreads them over every replica.
        results = await asyncio.gather(*(client.generate([greedy(p, f"lora-{name}-{adapter_version}-{k}-{i}", adapter)]) for i, p in enumerate(PROMPTS)))
        for (r,), expected in zip(results, want):
            sample = r.samples[0]
            assert sample.token_ids == expected, f"replica {r.replica_id}"
            assert [(s.adapter, s.adapter_version, s.start, s.end) for s in sample.weight_versions] == [(adapter, adapter_version, 0, TOKENS)]
            seen.add(r.replica_id)
    assert len(seen) == replicas, f"requests reached only {seen}"


EPISODE = [{"role": "user", "content": "What is 6 times 7?"}]


async def assert_episode_turns_run_the_adapter(client, version: int) -> None:
    """An episode naming "math": each turn's tokens are what a plain request with the
    adapter samples from the same tokens (not the base model's), and its spans name it."""
    episode = await client.start_episode(EPISODE, adapter="math")
    sampling = SamplingConfig(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    turns = [await episode.turn(sampling=sampling), await episode.turn([{"role": "user", "content": "Again."}], sampling=sampling)]
    traj = await episode.end()
    prefix = list(episode.prompt_token_ids)
    for turn, span in zip(turns, traj.turns):
        prefix += turn.appended_token_ids
        # One at a time, as the turn ran: a batch mixing them is not what is compared.
        (with_it,) = await client.generate([RolloutRequest(prompt_token_ids=prefix, adapter="math", sampling=sampling)])
        (without,) = await client.generate([RolloutRequest(prompt_token_ids=prefix, sampling=sampling)])
        assert turn.sample.token_ids == with_it.samples[0].token_ids != without.samples[0].token_ids
        assert [(sp.adapter, sp.adapter_version, sp.start, sp.end) for sp in span.weight_versions] == [("math", version, span.start, span.end)]
        prefix += turn.sample.token_ids


async def test_an_adapter_serves_like_a_fresh_engine_with_it_on_every_replica_and_the_next_version_is_seen_at_once(lora_app, adapters, lora_reference):
    reference = lora_reference
    assert reference[1] != reference["base"] and reference[2] != reference[1], "the adapters must change greedy output for this test to tell them apart"
    cfg = await asyncio.to_thread(lora_app, 1)
    base_url = f"http://127.0.0.1:{cfg.http.port}"  # the shared app's port (Serve runs one HTTP proxy), not its fixture: it is not deployed
    client = RolloutClient.connect(app_name=cfg.app_name)
    http_client = RolloutClient.http(base_url, api_key=API_KEY)
    publisher = WeightPublisher.connect(app_name=cfg.app_name, token=SYNC_TOKEN)
    try:
        # Before any publish: a request naming it is refused, naming the field (400 over HTTP).
        with pytest.raises(InvalidRequestError) as e:
            await http_client.generate([greedy(PROMPTS[0], "unknown")])
        assert e.value.field == "requests[0].adapter" and "not a published LoRA adapter" in e.value.message
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"requests": [greedy(PROMPTS[0], "raw").model_dump(mode="json", exclude_none=True) | {"adapter": "nope"}]}
            r = await http.post(f"{base_url}/v1/rollouts", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "requests[0].adapter", r.text

        # A bad publish is refused naming the tensor, before any replica changes.
        tensors, config, _ = adapters[0]
        q_a = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
        with pytest.raises(InvalidRequestError) as e:
            await asyncio.to_thread(publisher.publish_adapter, "math", {**tensors, q_a: torch.zeros(RANK, 3)}, config)
        assert e.value.field == f'tensors["{q_a}"]'

        assert await asyncio.to_thread(publisher.publish_adapter, "math", tensors, config) == 1

        # A replica that starts after the publish loads the adapter before its first request.
        await asyncio.to_thread(lora_app, 2)
        await assert_every_replica_serves(client, reference[1], 2, adapter_version=1)
        await assert_every_replica_serves(client, reference["base"], 2, adapter_version=None)

        # Version 2, published over HTTP: the next request on every replica runs it.
        http_publisher = WeightPublisher.http(base_url, api_key=API_KEY, token=SYNC_TOKEN)
        tensors2, config2, _ = adapters[1]
        assert await asyncio.to_thread(http_publisher.publish_adapter, "math", tensors2, config2) == 2
        await assert_every_replica_serves(client, reference[2], 2, adapter_version=2, rounds=4)
        status = await asyncio.to_thread(http_publisher.status)
        assert status["adapters"] == {"math": 2} and status["committed_version"] == 0

        # The OpenAI routes take the adapter by `model`; an unknown one is vLLM's own 404 naming it.
        async with httpx.AsyncClient(timeout=120) as http:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            r = await http.post(f"{base_url}/v1/completions", headers=headers, json={"model": "math", "prompt": PROMPTS[0], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == reference[2][0]
            assert r.json()["model"] == "math@2", "vLLM names the adapter version that answered"
            r = await http.post(f"{base_url}/v1/completions", headers=headers, json={"model": "nope", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 404 and "nope" in r.text, r.text

            # Episodes take the adapter too: an unknown one is a 400 naming `adapter`.
            r = await http.post(f"{base_url}/v1/episodes", headers=headers, json={"messages": EPISODE, "adapter": "nope"})
            assert r.status_code == 400 and r.json()["error"]["field"] == "adapter" and "not a published LoRA adapter" in r.json()["error"]["message"], r.text
        await assert_episode_turns_run_the_adapter(client, 2)
        await assert_episode_turns_run_the_adapter(http_client, 2)
    finally:
        publisher.close()
        client.close()
        http_client.close()


async def test_a_trainer_written_for_vllm_serve_loads_and_unloads_adapters_with_vllms_lora_routes_on_every_replica(lora_app, adapters, lora_reference, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, as its clients call them
    (the sync token as the Bearer), over the same app and engines."""
    import os

    reference = lora_reference
    cfg = await asyncio.to_thread(lora_app, 2)  # as the test above left it: no engine starts
    base_url = f"http://127.0.0.1:{cfg.http.port}"
    client = RolloutClient.connect(app_name=cfg.app_name)
    trainer = {"Authorization": f"Bearer {SYNC_TOKEN}"}
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:

            async def load(path: str, **extra) -> httpx.Response:
                return await http.post("/v1/load_lora_adapter", headers=trainer, json={"lora_name": "routes", "lora_path": path, **extra})

            def refused(r: httpx.Response, status: int, field: str | None) -> str:
                assert r.status_code == status and r.json()["error"].get("field") == field, r.text
                return r.json()["error"]["message"]

            # Without the sync token nothing is read or loaded.
            r = await http.post("/v1/load_lora_adapter", headers={"Authorization": f"Bearer {API_KEY}"}, json={"lora_name": "routes", "lora_path": adapters[0][2]})
            assert r.status_code == 401, r.text

            # vLLM's answer: 200 and its text; every replica serves the directory's adapter.
            r = await load(adapters[0][2])
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'routes' added successfully.", r.text
            assert r.headers["x-rollout-adapter-version"] == "1"
            await assert_every_replica_serves(client, reference[1], 2, adapter_version=1, rounds=4, name="routes")

            # load_inplace false on a loaded name: vLLM's 400, and nothing changes.
            message = refused(await load(adapters[1][2]), 400, "lora_name")
            assert "The lora adapter 'routes' has already been loaded" in message and "load_inplace" in message
            # load_inplace true: the next version, on every replica.
            r = await load(adapters[1][2], load_inplace=True)
            assert r.status_code == 200 and r.headers["x-rollout-adapter-version"] == "2", r.text
            await assert_every_replica_serves(client, reference[2], 2, adapter_version=2, rounds=4, name="routes")

            # Directories that are not a PEFT adapter's own files: 400 naming lora_path.
            missing = tmp_path / "missing"
            missing.mkdir()
            (missing / "adapter_config.json").write_text(json.dumps(adapters[0][1]))
            assert "has no adapter_model.safetensors" in refused(await load(str(missing), load_inplace=True), 400, "lora_path")
            escaping = tmp_path / "escaping"
            escaping.mkdir()
            (escaping / "adapter_config.json").write_text(json.dumps(adapters[0][1]))
            os.symlink(os.path.join(adapters[0][2], "adapter_model.safetensors"), escaping / "adapter_model.safetensors")
            assert "outside the directory" in refused(await load(str(escaping), load_inplace=True), 400, "lora_path")
            refused(await load(adapters[0][2], load_inplace=True, is_3d_lora_weight=True), 400, "is_3d_lora_weight")

            # Unload (lora_int_id as vLLM's clients send it, and as vLLM, ignored): every
            # replica refuses a request naming it, the coordinator forgets it.
            r = await http.post("/v1/unload_lora_adapter", headers=trainer, json={"lora_name": "routes", "lora_int_id": 2})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'routes' removed successfully.", r.text
            key = {"Authorization": f"Bearer {API_KEY}"}
            answers = await asyncio.gather(*(
                http.post("/v1/rollouts", headers=key, json={"requests": [greedy(p, f"unloaded-{k}-{i}", "routes").model_dump(mode="json", exclude_none=True)]})
                for k in range(3) for i, p in enumerate(PROMPTS)
            ))
            for answer in answers:
                assert "not a published LoRA adapter" in refused(answer, 400, "requests[0].adapter")
            r = await http.post("/v1/completions", headers=key, json={"model": "routes", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 404 and "routes" in r.text, r.text
            status = (await http.get("/v1/sync/status", headers=key)).json()
            assert "routes" not in status["adapters"], status
            # vLLM's 404 for a name it does not serve.
            r = await http.post("/v1/unload_lora_adapter", headers=trainer, json={"lora_name": "routes"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "adapter_not_found", r.text
    finally:
        client.close()


async def test_a_publisher_unloads_an_adapter_from_every_replica_and_a_replica_that_starts_later_does_not_load_it(lora_app, adapters, lora_reference):
    """``WeightPublisher.unload_adapter`` (in the cluster; over HTTP for a name not
    published): every replica refuses requests naming it, the coordinator forgets it, a
    replica that starts afterwards loads only the adapters still published, and a later
    publish of the name continues after the version removed."""
    from rollout.errors import AdapterNotFoundError

    cfg = await asyncio.to_thread(lora_app, 2)  # as the tests above left it: no engine starts
    base_url = f"http://127.0.0.1:{cfg.http.port}"
    client = RolloutClient.connect(app_name=cfg.app_name)
    publisher = WeightPublisher.connect(app_name=cfg.app_name, token=SYNC_TOKEN)
    http_publisher = WeightPublisher.http(base_url, api_key=API_KEY, token=SYNC_TOKEN)
    try:
        (tensors, config, _), (tensors2, config2, _) = adapters
        kept = await asyncio.to_thread(publisher.publish_adapter, "kept", tensors2, config2)
        gone = await asyncio.to_thread(publisher.publish_adapter, "gone", tensors, config)
        await assert_every_replica_serves(client, lora_reference[1], 2, adapter_version=gone, name="gone")

        assert await asyncio.to_thread(publisher.unload_adapter, "gone") is None
        assert publisher.last_outcome.committed and not publisher.last_outcome.failed_replicas, publisher.last_outcome

        async def refused_everywhere(tag: str) -> None:
            for k in range(3):
                for i, p in enumerate(PROMPTS):
                    with pytest.raises(InvalidRequestError) as e:
                        await client.generate([greedy(p, f"{tag}-{k}-{i}", "gone")])
                    assert e.value.field == "requests[0].adapter" and "not a published LoRA adapter" in e.value.message

        await refused_everywhere("unloaded")
        status = await asyncio.to_thread(http_publisher.status)
        assert "gone" not in status["adapters"] and status["adapters"]["kept"] == kept, status

        # A name not published: typed, naming the field (a 404 over HTTP), nothing changes.
        with pytest.raises(AdapterNotFoundError) as e:
            await asyncio.to_thread(http_publisher.unload_adapter, "gone")
        assert e.value.field == "name" and "'gone' is not a published LoRA adapter" in e.value.message

        # A replica that starts after the unload loads what is still published, not it.
        await asyncio.to_thread(lora_app, 1)
        await asyncio.to_thread(lora_app, 2)
        await assert_every_replica_serves(client, lora_reference[2], 2, adapter_version=kept, name="kept")
        await refused_everywhere("after-restart")

        # Published again: the version after the one removed.
        assert await asyncio.to_thread(publisher.publish_adapter, "gone", tensors, config) == gone + 1
        await assert_every_replica_serves(client, lora_reference[1], 2, adapter_version=gone + 1, name="gone")
    finally:
        publisher.close()
        http_publisher.close()
        client.close()
