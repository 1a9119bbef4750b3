"""vLLM's RL control routes at the ingress, driven by a trainer written for ``vllm serve``:
vLLM's own HTTP weight-sync client (with the sync token) and trainer-engine interface,
gloo on CPU, two replicas. Runs after the weight-sync module (it changes the weights).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import requests

from rollout.contracts.net import free_port, own_address
from tests.conftest import API_KEY, SYNC_TOKEN
from tests.test_weight_sync_e2e import PROMPTS, assert_every_replica_serves, greedy

pytestmark = pytest.mark.e2e

# Long enough to fill whole KV blocks: served before an update, its cached prefix must
# not be reused after it (a pause held by /pause must still reset the prefix cache).
LONG = [(i * 37) % 1000 + 5 for i in range(300)]


def scaled(platform, n):
    return platform.model_copy(update={"deployment": platform.deployment.model_copy(update={"replicas": n})})


@pytest.fixture(scope="module")
def two_replicas(platform):
    from rollout.app import deploy

    deploy(scaled(platform, 2))
    return platform


@pytest.fixture(scope="module")
def routes(base_url):
    from rollout.sync.route_client import WeightRoutesClient

    return WeightRoutesClient(base_url, token=SYNC_TOKEN, timeout=120)


def sync_status(routes):
    resp = requests.get(f"{routes.base_url}/v1/sync/status", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    resp.raise_for_status()
    return resp.json()


def wait_for_world_size(routes, want: int, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (world := routes.get_world_size()) != want and time.monotonic() < deadline:
        time.sleep(1.0)
    return world


def post(base_url, path, token=SYNC_TOKEN, **kwargs):
    headers = {"X-Rollout-Sync-Token": token} if token else {}
    return requests.post(f"{base_url}/{path}", headers=headers, timeout=60, **kwargs)


def test_bad_sequences_get_a_4xx_naming_the_problem_and_change_no_replica(two_replicas, base_url, routes):
    # A replica removed by the scale-down counts until the coordinator misses 3 of its polls.
    world = wait_for_world_size(routes, 2 + 1)
    assert world == 2 + 1, "two replicas of one rank, plus the coordinator's copy"
    before = sync_status(routes)
    cases = [
        (post(base_url, "start_weight_update", token=None), 401, "missing sync token"),
        (post(base_url, "start_weight_update", token="wrong"), 401, "wrong sync token"),
        (post(base_url, "update_weights", json={"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}}), 409, "call /get_world_size and /init_weight_transfer_engine"),
        (post(base_url, "finish_weight_update"), 409, "no weight update is in progress"),
        (
            post(base_url, "init_weight_transfer_engine", json={"init_info": {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": world, "group_name": "g"}}),
            400,
            "init_info.world_size",
        ),
        (post(base_url, "init_weight_transfer_engine", json={"init_info": {"master_port": 29999, "world_size": world + 1}}), 400, "init_info.master_address"),
        (post(base_url, "collective_rpc", json={"method": "reset_weights"}), 403, "arbitrary methods"),
        # A misspelt parameter is named, not ignored (which would pause with the default).
        (post(base_url, "pause", params={"mode": "keep", "clear_cach": "false"}), 400, "clear_cach"),
        # vLLM's CPU platform has no sleep mode: the deployed app names the platform it resolved.
        (post(base_url, "sleep", params={"level": 1}), 409, "its replicas run on CPU"),
        (post(base_url, "wake_up"), 409, "sleep_unavailable"),
    ]
    for resp, status, needle in cases:
        assert resp.status_code == status and needle in resp.text, (resp.status_code, resp.text)
    after = sync_status(routes)
    assert after["committed_version"] == before["committed_version"]
    assert {r: v["version"] for r, v in after["replicas"].items()} == {r: v["version"] for r, v in before["replicas"].items()}
    assert after["recent_rounds"] == before["recent_rounds"], "no round was opened"
    assert routes._request("GET", "is_paused") == {"is_paused": False}


async def test_a_trainer_written_for_vllm_serve_publishes_to_every_replica_through_the_routes(
    two_replicas, routes, handle_client, policy_v2, reference_v2
):
    from vllm.distributed.weight_transfer.base import ModuleSource

    from rollout.sync.backends.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine

    committed = sync_status(routes)["committed_version"]
    for k in range(4):  # cache LONG's prefix under the old weights, on both replicas
        await handle_client.generate([greedy(LONG, 4, f"long-before-{k}")])
    # The async-GRPO order: pause (keep) → init → start → update while broadcasting → finish → resume.
    await asyncio.to_thread(routes.pause, "keep")
    assert routes._request("GET", "is_paused") == {"is_paused": True}
    held = asyncio.ensure_future(handle_client.generate([greedy(PROMPTS[0], 8, "held")]))
    await asyncio.sleep(3.0)
    assert not held.done(), "a request sent while paused is held"

    world = await asyncio.to_thread(routes.get_world_size)
    info = GlooTrainerInitInfo(master_address=own_address(), master_port=free_port(), world_size=1 + world, rank=0, timeout_s=30, bucket_bytes=1 << 16)
    source = ModuleSource(policy_v2[0])
    engine = await asyncio.to_thread(GlooTrainerWeightTransferEngine.trainer_init, info, client=routes, source=source)
    with pytest.raises(requests.HTTPError, match="409.*call /start_weight_update first"):
        await asyncio.to_thread(routes.update_weights, {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]})
    await asyncio.to_thread(engine.send_weights)  # /start_weight_update, /update_weights + broadcast, /finish_weight_update
    status = sync_status(routes)
    version = committed + 1
    assert status["committed_version"] == version, status
    assert len(status["replicas"]) == 2 and all(r["version"] == version for r in status["replicas"].values()), status
    assert status["weight_copy_version"] == version, "the coordinator's copy took the broadcast too"
    assert routes.weight_version() == str(version)
    assert not held.done(), "still paused until /resume"

    await asyncio.to_thread(routes.resume)
    (result,) = await asyncio.wait_for(held, 120)
    assert [s.version for s in result.samples[0].weight_versions] == [version], "generated only after the update"
    # Both replicas serve exactly the published weights.
    await assert_every_replica_serves(handle_client, reference_v2, replicas=2, prompts=[*PROMPTS, LONG], version=version, rounds=6)

    # The session's group serves the next round too (vLLM's trainer engine keeps it).
    await asyncio.to_thread(engine.send_weights)
    assert sync_status(routes)["committed_version"] == version + 1
    engine.shutdown()


async def test_a_replica_added_after_a_route_publish_serves_the_committed_version_before_its_first_request(
    two_replicas, routes, handle_client, reference_v2
):
    from rollout.app import deploy

    version = sync_status(routes)["committed_version"]
    await asyncio.to_thread(deploy, scaled(two_replicas, 3))
    status = sync_status(routes)
    assert len(status["replicas"]) == 3 and all(r["version"] == version for r in status["replicas"].values()), status
    # The next start says the group no longer covers every replica.
    resp = post(routes.base_url, "start_weight_update")
    assert resp.status_code == 409 and "call /get_world_size and /init_weight_transfer_engine" in resp.text, resp.text
    await assert_every_replica_serves(handle_client, reference_v2, replicas=3, version=version)


async def test_openai_requests_with_one_session_id_land_on_one_replica(two_replicas, base_url):
    """Agent frameworks send X-Session-ID with every turn of a conversation."""
    from tests.conftest import API_KEY

    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": two_replicas.model.name, "messages": [{"role": "user", "content": "turn"}], "max_tokens": 2}
    by_session = {}
    for session in [f"session-{i}" for i in range(8)]:
        replicas = set()
        for turn in range(3):
            body["messages"][0]["content"] = f"turn {turn} of {session}"  # a different prefix every turn
            r = requests.post(f"{base_url}/v1/chat/completions", json=body, headers={**headers, "X-Session-ID": session}, timeout=60)
            assert r.status_code == 200, r.text
            replicas.add(r.headers["x-rollout-replica"])
        assert len(replicas) == 1, f"session {session} spread over {replicas}"
        by_session[session] = replicas.pop()
    assert len(set(by_session.values())) > 1, f"every session went to one replica: {by_session}"
