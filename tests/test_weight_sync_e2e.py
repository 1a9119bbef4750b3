"""Weight publishing end to end: real Ray, Serve, vLLM (CPU) and the gloo backend.

Runs after the other e2e modules (it changes the shared app's weights).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest
import ray
import torch

from rollout.api import RolloutRequest, SamplingConfig
from rollout.client import RolloutClient
from rollout.errors import AuthenticationError, InvalidRequestError
from rollout.sync import WeightPublisher
from tests.conftest import KV_BYTES, MAX_MODEL_LEN, SYNC_TOKEN

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 5, [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def perturbed_policy(model_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def save_policy(model, model_dir, out_dir):
    model.save_pretrained(str(out_dir))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (model_dir / f).exists():
            shutil.copy(model_dir / f, out_dir / f)
    return out_dir


def greedy(ids, n_tokens, session_id=None):
    return RolloutRequest(prompt_token_ids=ids, session_id=session_id, sampling=SamplingConfig(max_tokens=n_tokens, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def publisher(platform):
    return WeightPublisher.connect(app_name=platform.app_name, token=SYNC_TOKEN)


def saved_policy(model_dir, tmp_path_factory, seed: int):
    """A perturbed policy (the 'trained' weights) and its checkpoint directory."""
    model = perturbed_policy(model_dir, seed=seed)
    return model, save_policy(model, model_dir, tmp_path_factory.mktemp(f"policy-seed{seed}"))


def reference_engine(checkpoint):
    """The reference on ``checkpoint`` (answers like a fresh engine loaded with it): what
    every replica must answer like."""
    from tests.reference import reference_engine as shared

    return shared(checkpoint, MAX_MODEL_LEN, KV_BYTES)


async def assert_every_replica_serves(handle_client, reference, replicas: int, prompts=PROMPTS, version=None, rounds: int = 8):
    """Greedy from every replica equals ``reference``'s (and carries ``version``)."""
    expected = ray.get(reference.greedy.remote(prompts, 16, ignore_eos=True))
    seen = set()
    for k in range(rounds):
        # Separate calls with distinct sessions, so the affinity router spreads them over every replica.
        results = await asyncio.gather(*(handle_client.generate([greedy(p, 16, f"every-{k}-{i}")]) for i, p in enumerate(prompts)))
        for (r,), want in zip(results, expected):
            assert r.samples[0].token_ids == want
            if version is not None:
                assert r.samples[0].weight_versions[0].version == version
            seen.add(r.replica_id)
    assert len(seen) == replicas, f"requests reached only {seen}"


@pytest.fixture(scope="module")
def policy_v1(model_dir, tmp_path_factory):
    return saved_policy(model_dir, tmp_path_factory, seed=1)


@pytest.fixture(scope="module")
def reference_v1(ray_cluster, policy_v1):
    return reference_engine(policy_v1[1])


async def test_bad_publishes_are_rejected_before_any_replica_changes(publisher, policy_v1, handle_client, platform):
    model, _ = policy_v1
    (before,) = await handle_client.generate([greedy(PROMPTS[0], 16)])
    params = dict(model.named_parameters())
    name = next(iter(params))
    cases = [
        ({**params, "model.not_a_layer.weight": torch.zeros(2)}, InvalidRequestError, "unknown parameter names"),
        ({k: v for k, v in params.items() if k != name}, InvalidRequestError, "missing"),
        ({**params, name: params[name][:-1]}, InvalidRequestError, "shape"),
        ({**params, name: params[name].to(torch.bfloat16)}, InvalidRequestError, "dtype"),
    ]
    for tensors, exc, words in cases:
        with pytest.raises(exc, match=words):
            await asyncio.to_thread(publisher.publish, tensors)
    with pytest.raises(InvalidRequestError, match="version"):
        await asyncio.to_thread(publisher.publish, params, 0)
    for token in (None, "wrong"):
        bad = WeightPublisher.connect(app_name=platform.app_name, token=token or "")
        with pytest.raises(AuthenticationError):
            await asyncio.to_thread(bad.publish, params)
    (after,) = await handle_client.generate([greedy(PROMPTS[0], 16)])
    assert after.samples[0].token_ids == before.samples[0].token_ids
    assert after.samples[0].weight_versions[0].version == 0, "the checkpoint's own weights (vLLM's label \"default\") are version 0"


async def test_after_publish_greedy_output_equals_a_fresh_engine_with_the_published_weights(
    publisher, policy_v1, reference_v1, handle_client
):
    model, _ = policy_v1
    before = await handle_client.generate([greedy(p, 24) for p in PROMPTS])
    version = await asyncio.to_thread(publisher.publish, model.named_parameters())
    assert version == 1
    after = await handle_client.generate([greedy(p, 24) for p in PROMPTS])
    expected = ray.get(reference_v1.greedy.remote(PROMPTS, 24, ignore_eos=True))
    assert [r.samples[0].token_ids for r in after] == expected
    assert [r.samples[0].token_ids for r in after] != [r.samples[0].token_ids for r in before]
    assert all((r.committed_version, r.staleness) == (1, 0) for r in after)
    for r in after:
        assert [(s.version, s.start, s.end) for s in r.samples[0].weight_versions] == [(1, 0, 24)]
    status = await asyncio.to_thread(publisher.status)
    assert status["committed_version"] == 1
    assert all(r["version"] == 1 for r in status["replicas"].values())


async def test_a_request_for_a_newer_policy_waits_for_its_commit_and_reports_no_staleness(publisher, policy_v1, handle_client, http_client, platform):
    from rollout.errors import InvalidRequestError, StaleWeightsError

    committed = (await asyncio.to_thread(publisher.status))["committed_version"]
    (now,) = await handle_client.generate([RolloutRequest(prompt_token_ids=PROMPTS[0], min_weight_version=committed, sampling=SamplingConfig(max_tokens=4))])
    assert (now.committed_version, now.staleness) == (committed, 0)
    # A trainer that asks for the policy it is about to publish: held, not served stale.
    held = asyncio.create_task(handle_client.generate([RolloutRequest(prompt_token_ids=PROMPTS[0], min_weight_version=committed + 1, sampling=SamplingConfig(max_tokens=4))]))
    await asyncio.sleep(2)
    assert not held.done()
    version = await asyncio.to_thread(publisher.publish, policy_v1[0].named_parameters())
    (result,) = await asyncio.wait_for(held, 60)
    assert [s.version for s in result.samples[0].weight_versions] == [version]
    assert (result.committed_version, result.staleness) == (version, 0)
    # The next version, but nobody publishes it: a retryable error after the sync deadline, not
    # a hang (over HTTP: a 409 of type stale_weights, the client's StaleWeightsError).
    with pytest.raises(StaleWeightsError, match=f"version {version + 1} did not arrive"):
        await asyncio.wait_for(http_client.generate([RolloutRequest(prompt_token_ids=PROMPTS[0], min_weight_version=version + 1)]), platform.sync.timeout_s + 30)
    # A version no publish in progress can bring: refused at once, naming the field.
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError) as exc:
        await handle_client.generate([RolloutRequest(prompt_token_ids=PROMPTS[0], min_weight_version=version + 5)])
    assert exc.value.field == "requests[0].min_weight_version" and time.monotonic() - t0 < platform.sync.timeout_s / 2


async def test_in_flight_request_keeps_going_on_the_new_weights_and_its_spans_show_the_switch(
    publisher, policy_v2, reference_v2, handle_client, ray_cluster
):
    model, _ = policy_v2
    prompt, total = [9, 8, 7, 6], 400
    chunks = []
    serving = (await asyncio.to_thread(publisher.status))["committed_version"]

    async def consume():
        async for c in handle_client.stream(greedy(prompt, total)):
            chunks.append(c)

    task = asyncio.create_task(consume())
    while sum(len(c.token_ids) for c in chunks) < 20:
        await asyncio.sleep(0.05)
    version = await asyncio.to_thread(publisher.publish, model.named_parameters())
    await task
    tokens = [t for c in chunks for t in c.token_ids]
    spans = chunks[-1].weight_versions
    assert len(tokens) == total
    assert [s.version for s in spans] == [serving, version]
    switch = spans[0].end
    assert spans[0].start == 0 and spans[1].start == switch and spans[1].end == total
    assert 20 <= switch < total
    (continuation,) = ray.get(reference_v2.greedy.remote([prompt + tokens[:switch]], total - switch, ignore_eos=True))
    assert tokens[switch:] == continuation


# Two whole KV blocks on CPU (128 tokens each) and the one token always recomputed.
LONG_SHARED = [(i * 53) % 900 + 7 for i in range(2 * 128 + 1)]


async def test_after_a_commit_a_long_shared_prompt_is_not_served_from_the_old_versions_kv_and_is_cached_again(
    publisher, policy_v1, reference_v1, handle_client, platform
):
    """sync.prefix_cache: salt. The update does not flush (nothing is in flight), yet the
    first request after the commit finds none of the blocks the same prompt cached under
    the old weights; the next one hits the blocks the first computed under the new."""
    from rollout.bench.scaling import settled_prefix_counters
    from tests.conftest import METRICS_PORT

    assert platform.sync.prefix_cache == "salt"
    metrics_url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    counters = [await settled_prefix_counters(metrics_url, platform.app_name)]

    async def serve_long():
        # One session: the affinity router keeps every call on one replica (asserted below).
        (r,) = await handle_client.generate([greedy(LONG_SHARED, 16, "salted-prefix")])
        counters.append(await settled_prefix_counters(metrics_url, platform.app_name))
        (h0, q0), (h1, q1) = counters[-2:]
        return r, h1 - h0, q1 - q0

    first, _, _ = await serve_long()  # caches LONG_SHARED's blocks under the served version
    again, hits, _ = await serve_long()
    assert hits >= 256, f"the same version reuses them ({hits} tokens hit)"
    # Different weights from those served now (the previous test published seed 2's).
    version = await asyncio.to_thread(publisher.publish, policy_v1[0].named_parameters())
    after, hits, queries = await serve_long()
    assert queries >= len(LONG_SHARED) and hits == 0, f"{hits} prompt tokens came from blocks computed under the old weights"
    (expected,) = ray.get(reference_v1.greedy.remote([LONG_SHARED], 16, ignore_eos=True))
    assert after.samples[0].token_ids == expected
    assert [(s.version, s.start, s.end) for s in after.samples[0].weight_versions] == [(version, 0, 16)]
    cached, hits, _ = await serve_long()
    assert hits >= 256, f"the new version's blocks are reused ({hits} tokens hit)"
    assert cached.samples[0].token_ids == expected
    assert {r.replica_id for r in (first, again, after, cached)} == {first.replica_id}, "one replica served them all"


async def test_a_trainer_that_never_sends_ends_the_round_with_an_error_and_the_next_publish_succeeds(
    publisher, platform, handle_client, policy_v1
):
    """The trainer opens a round and dies before sending: the replicas' receive times out."""
    from rollout.contracts.net import free_port as _free_port, own_address as _own_address
    from rollout.contracts.sync_protocol import ParamSpec, RoundRequest

    model, _ = policy_v1
    status = await asyncio.to_thread(publisher.status)
    committed = status["committed_version"]
    (before,) = await handle_client.generate([greedy(PROMPTS[1], 16)])
    coord = publisher._coordinator
    specs = [ParamSpec.of(n, p) for n, p in model.named_parameters()]
    plan = await asyncio.to_thread(coord.begin_round, SYNC_TOKEN, RoundRequest(tuple(specs), _own_address(), _free_port()))
    outcome = await asyncio.wait_for(asyncio.to_thread(coord.finish, SYNC_TOKEN, plan.round_id, "trainer died"), timeout=3 * platform.sync.timeout_s + 30)
    assert not outcome.committed and "trainer" in outcome.error
    assert (await asyncio.to_thread(publisher.status))["committed_version"] == committed
    (after,) = await handle_client.generate([greedy(PROMPTS[1], 16)])
    assert after.samples[0].token_ids == before.samples[0].token_ids
    assert after.samples[0].weight_versions[0].version == committed
    assert await asyncio.to_thread(publisher.publish, model.named_parameters()) == committed + 1


TRAINER_THAT_DIES = r"""
import os, sys, torch, ray
from ray import serve
from transformers import AutoModelForCausalLM
from rollout.contracts.net import free_port as _free_port, own_address as _own_address
from rollout.contracts.sync_protocol import COORDINATOR_NAME
from rollout.contracts.sync_protocol import ParamSpec, RoundRequest
from rollout.sync.backends.gloo_group import GlooGroup, Rendezvous
from rollout.sync.wire import pack, plan_buckets

ray.init(address=os.environ["RAY_ADDRESS"], namespace="rollout-tests", log_to_driver=False)
coord = serve.get_deployment_handle(COORDINATOR_NAME, app_name=sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
tensors = dict(model.named_parameters())
specs = [ParamSpec.of(n, t) for n, t in tensors.items()]
plan = coord.begin_round.remote(os.environ["ROLLOUT_SYNC_TOKEN"], RoundRequest(tuple(specs), _own_address(), _free_port())).result()
group = GlooGroup(Rendezvous(plan.round_id, plan.transfer.master_address, plan.transfer.master_port, plan.transfer.world_size, plan.timeout_s), 0)
buckets = plan_buckets(plan.params, 1 << 16)
assert plan.bucket_bytes == 1 << 16 and len(buckets) > 4, len(buckets)
for b in buckets[: len(buckets) // 2]:
    group.broadcast(pack(tensors[plan.params[i].name] for i in b))
print("SENT HALF", flush=True)
os._exit(1)  # the trainer dies mid-transfer
"""


async def test_a_trainer_killed_mid_publish_leaves_every_replica_on_the_last_committed_version_reloaded_from_its_checkpoint(
    publisher, platform, handle_client, model_dir, tmp_path, policy_v1
):
    import subprocess
    import sys

    # The committed weights are also saved where replicas can read them: the rollback
    # reloads them from there (vLLM's reload_weights), not from the coordinator's copy.
    model_v1, dir_v1 = policy_v1
    committed = await asyncio.to_thread(publisher.publish, model_v1.named_parameters(), None, str(dir_v1))
    before = await handle_client.generate([greedy(p, 16) for p in PROMPTS])
    model = perturbed_policy(model_dir, seed=3)
    policy_dir = save_policy(model, model_dir, tmp_path / "policy-v3")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_THAT_DIES)
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(script), str(policy_dir), platform.app_name], capture_output=True, text=True, timeout=300, env=_cluster_env()
    )
    assert "SENT HALF" in proc.stdout, proc.stderr[-2000:]
    outcome = await _wait_for_outcome(publisher, committed)
    assert not outcome["committed"] and outcome["error"]
    after = await asyncio.wait_for(handle_client.generate([greedy(p, 16) for p in PROMPTS]), timeout=120)
    assert [r.samples[0].token_ids for r in after] == [r.samples[0].token_ids for r in before]
    assert all(r.samples[0].weight_versions[0].version == committed for r in after)
    status = await asyncio.to_thread(publisher.status)
    reloads = [r for r in status["recent_rounds"] if r["round_id"].startswith(f"reload-{committed}-")]
    assert reloads and all(r["committed"] for r in reloads), status["recent_rounds"]
    # A publish without a checkpoint: later restores use the coordinator's copy again.
    assert await asyncio.to_thread(publisher.publish, model_v1.named_parameters()) == committed + 1


def _cluster_env() -> dict:
    """The environment for a trainer process joining this test's Ray cluster (by its
    exact address: other clusters may run on the machine)."""
    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


async def _wait_for_outcome(publisher, committed):
    """The outcome of the publish round that tried to commit ``committed + 1``."""
    for _ in range(300):
        status = await asyncio.to_thread(publisher.status)
        rounds = [r for r in status["recent_rounds"] if r["round_id"].startswith(f"round-{committed + 1}-")]
        if rounds:
            return rounds[-1]
        await asyncio.sleep(0.5)
    raise AssertionError(f"no decision: {status}")


async def test_a_replica_added_later_serves_the_committed_version_before_its_first_request(
    publisher, platform, handle_client, policy_v1, reference_v1
):
    from rollout.app import deploy

    def scaled(n):
        return platform.model_copy(update={"deployment": platform.deployment.model_copy(update={"replicas": n})})

    # Two replicas hold the committed version; the trainer publishes to both...
    await asyncio.to_thread(deploy, scaled(2))
    version = await asyncio.to_thread(publisher.publish, policy_v1[0].named_parameters())
    status = await asyncio.to_thread(publisher.status)
    assert len(status["replicas"]) == 2 and all(r["version"] == version for r in status["replicas"].values()), status
    rounds_before = len(status["recent_rounds"])
    # ...then a third is added by changing the deployment: it catches up from the
    # coordinator's copy before Serve routes anything to it; the trainer sends nothing.
    await asyncio.to_thread(deploy, scaled(3))
    status = await asyncio.to_thread(publisher.status)
    assert len(status["replicas"]) == 3
    assert all(r["version"] == version for r in status["replicas"].values()), status
    new_rounds = status["recent_rounds"][rounds_before:]
    assert new_rounds and all(r["round_id"].startswith("restore-") for r in new_rounds), new_rounds
    await assert_every_replica_serves(handle_client, reference_v1, replicas=3, version=version)


async def test_a_rank_that_never_joins_ends_the_round_within_the_deadline_and_it_drops_out(
    publisher, platform, handle_client, policy_v1
):
    from rollout.contracts.sync_protocol import COORDINATOR_NAME
    from rollout.contracts.sync_protocol import ParamSpec

    from ray import serve

    model, _ = policy_v1
    committed = (await asyncio.to_thread(publisher.status))["committed_version"]
    before = await handle_client.generate([greedy(p, 16) for p in PROMPTS])
    coordinator = serve.get_deployment_handle(COORDINATOR_NAME, app_name=platform.app_name)
    specs = [ParamSpec.of(n, p) for n, p in model.named_parameters()]
    # A member that registers and then never polls or joins a group.
    await coordinator.register.remote("ghost-replica", 1, committed, specs)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(Exception, match="aborted"):
        await asyncio.to_thread(publisher.publish, model.named_parameters())
    assert loop.time() - t0 < 3 * platform.sync.timeout_s + 15
    after = await asyncio.wait_for(handle_client.generate([greedy(p, 16) for p in PROMPTS]), timeout=120)
    assert [r.samples[0].token_ids for r in after] == [r.samples[0].token_ids for r in before]
    assert all(r.samples[0].weight_versions[0].version == committed for r in after)
    # The silent member drops out of membership; the next publish commits without it.
    for _ in range(60):
        if "ghost-replica" not in (await asyncio.to_thread(publisher.status))["replicas"]:
            break
        await asyncio.sleep(1)
    assert await asyncio.to_thread(publisher.publish, model.named_parameters()) == committed + 1


TRAINER_THAT_WAITS = TRAINER_THAT_DIES.replace(
    "os._exit(1)  # the trainer dies mid-transfer",
    "while not os.path.exists(sys.argv[3]):\n    import time; time.sleep(0.1)\n"
    "for b in buckets[len(buckets) // 2 :]:\n    group.broadcast(pack(tensors[plan.params[i].name] for i in b))\nprint('SENT ALL', flush=True)",
)


async def test_a_replica_killed_mid_update_fails_the_round_and_every_replica_stays_on_one_version(
    publisher, platform, handle_client, model_dir, tmp_path, reference_v1
):
    """Documented outcome: a member that dies mid-transfer fails the round; the survivors
    restore the committed weights from the coordinator's copy and the dead replica's
    replacement catches up from it before taking traffic."""
    import subprocess
    import sys

    status = await asyncio.to_thread(publisher.status)
    committed = status["committed_version"]
    replicas = len(status["replicas"])
    assert replicas >= 2, "runs after the scale-up test"
    victim_id = sorted(status["replicas"])[0]
    victim = next(
        a for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].endswith(f"#{victim_id}")
    )
    model = perturbed_policy(model_dir, seed=4)
    policy_dir = save_policy(model, model_dir, tmp_path / "policy-v4")
    script, go = tmp_path / "trainer.py", tmp_path / "go"
    script.write_text(TRAINER_THAT_WAITS)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(policy_dir), platform.app_name, str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_cluster_env()
    )
    try:
        while True:
            line = await asyncio.to_thread(proc.stdout.readline)
            if not line:  # the script ended without sending half
                raise AssertionError(proc.stderr.read()[-2000:])
            if "SENT HALF" in line:
                break
        # Rollouts in flight on both replicas (held: generation pauses for the round), one
        # request a call so the calls spread; the victim's die with it and are retried.
        expected = ray.get(reference_v1.greedy.remote(PROMPTS, 16, ignore_eos=True))
        spread = RolloutClient.connect(app_name=platform.app_name, batch_size=1)
        in_flight = asyncio.create_task(spread.generate([greedy(p, 16, f"in-flight-{i}-{j}") for j in range(3) for i, p in enumerate(PROMPTS)]))
        await asyncio.sleep(2)
        assert not in_flight.done()
        ray.kill(ray.get_actor(victim["name"], namespace="serve"), no_restart=True)
        go.write_text("go")
        await asyncio.to_thread(proc.wait, 300)
    finally:
        proc.kill()
    outcome = await _wait_for_outcome(publisher, committed)
    assert not outcome["committed"]
    # Nothing lost: every request of the batch answered, those on the dead replica by the survivor.
    results = await asyncio.wait_for(in_flight, 300)
    assert spread.retried_calls >= 1, "some calls were on the victim"
    for r, want in zip(results, expected * 3):
        assert r.replica_id != victim_id and r.samples[0].token_ids == want
        assert [s.version for s in r.samples[0].weight_versions] == [committed]
    spread.close()

    async def all_replicas_on_committed():
        s = await asyncio.to_thread(publisher.status)
        return len(s["replicas"]) == replicas and victim_id not in s["replicas"] and all(r["version"] == committed for r in s["replicas"].values())

    from tests.conftest import wait_until

    await wait_until(all_replicas_on_committed, timeout_s=300, interval_s=2)
    seen = set()
    # The replacement is registered with the coordinator a moment before the handle's
    # router knows it: keep sending (distinct sessions) until every replica has answered.
    for k in range(40):
        results = await asyncio.gather(*(handle_client.generate([greedy(p, 16, f"s{k}-{i}")]) for i, p in enumerate(PROMPTS)))
        for (r,), want in zip(results, expected):
            assert [s.version for s in r.samples[0].weight_versions] == [committed]
            assert r.samples[0].token_ids == want
            seen.add(r.replica_id)
        if len(seen) == replicas and k >= 7:
            break
        await asyncio.sleep(0.5 if k >= 7 else 0)
    assert len(seen) == replicas
    assert await asyncio.to_thread(publisher.publish, model.named_parameters()) == committed + 1


async def _sync_status(base_url) -> dict:
    import httpx

    from tests.conftest import API_KEY

    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        resp = await c.get("/v1/sync/status")
    resp.raise_for_status()
    return resp.json()


async def test_a_replica_that_received_corrupted_bytes_is_caught_named_and_every_replica_keeps_the_committed_version(
    publisher, policy_v1, reference_v1, policy_v2, reference_v2, handle_client, base_url
):
    """Fleet integrity: every replica digests what it received, per tensor, and the
    coordinator compares with what the publisher sent (rollout.sync.digest). One replica's
    received bytes are corrupted on purpose (the test hook: a marker in its digest
    directory makes its receiving engine flip a byte of the first tensor)."""
    from rollout.sync import SyncError
    from rollout.sync import digest
    from tests.conftest import wait_until

    model_v1, _ = policy_v1
    # A clean publish (the v1 weights again, as a new version): every replica's digest is
    # the publisher's, in /v1/sync/status.
    committed = await asyncio.to_thread(publisher.publish, model_v1.named_parameters())
    status = await _sync_status(base_url)
    sent = status["committed_digest"]
    assert sent["version"] == committed and sent["digest"] == publisher.last_outcome.digest != ""
    replicas = len(status["replicas"])
    assert {rid: r["received"] for rid, r in status["replicas"].items()} == {rid: sent for rid in status["replicas"]}
    await assert_every_replica_serves(handle_client, reference_v1, replicas, version=committed)

    victim = sorted(status["replicas"])[0]
    marker = digest.replica_dir(victim) / digest.CORRUPT_MARKER
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    model_v2, _ = policy_v2
    first = next(name for name, _ in model_v2.named_parameters())
    try:
        with pytest.raises(SyncError, match=rf"{victim}: received bytes differ from those sent in 1 tensor \({first}\)"):
            await asyncio.to_thread(publisher.publish, model_v2.named_parameters())
    finally:
        hooked = not marker.exists()
        marker.unlink(missing_ok=True)
    assert hooked, "the victim's engine took the hook"
    outcome = publisher.last_outcome
    assert not outcome.committed and outcome.failed_replicas == [victim] and outcome.mismatched == {victim: [first]}
    assert outcome.replica_digests[victim] != outcome.digest
    assert set(outcome.replica_digests) == set(status["replicas"]), "every member reported what it received"
    assert all(d == outcome.digest for rid, d in outcome.replica_digests.items() if rid != victim), "only the victim differs"

    # Every replica (those that loaded the aborted round's bytes restore from the
    # coordinator's copy, checked against the committed digests too) serves the committed version.
    async def all_on_committed():
        s = await _sync_status(base_url)
        return s["committed_version"] == committed and all(r["version"] == committed for r in s["replicas"].values()) and s
    status = await wait_until(all_on_committed, timeout_s=300, interval_s=1)
    assert status["committed_digest"] == sent
    # What the restores received (in the checkpoint's order, from the copy) is the committed bytes.
    assert {rid: r["received"] for rid, r in status["replicas"].items()} == {rid: sent for rid in status["replicas"]}
    await assert_every_replica_serves(handle_client, reference_v1, replicas, version=committed)

    # The hook was one-shot: the same publish now commits, every replica holding its bytes.
    version = await asyncio.to_thread(publisher.publish, model_v2.named_parameters())
    assert version == committed + 1
    status = await _sync_status(base_url)
    assert status["committed_digest"] == {"version": version, "digest": publisher.last_outcome.digest}
    assert status["committed_digest"]["digest"] != sent["digest"]
    assert {rid: r["received"] for rid, r in status["replicas"].items()} == {rid: status["committed_digest"] for rid in status["replicas"]}
    await assert_every_replica_serves(handle_client, reference_v2, replicas, version=version)


async def test_a_checkpoint_published_through_shared_storage_is_what_every_replica_serves_and_a_corrupted_one_loads_nowhere(
    publisher, platform, policy_v1, reference_v1, handle_client, base_url, model_dir, tmp_path
):
    """A trainer with no network path to the engines (rollout.sync.storage): it writes a
    checkpoint, manifest last, and publishes its path over HTTP; every replica verifies
    it against the manifest, then reloads it itself. Nothing travels between them."""
    from rollout.contracts.sync_protocol import StorageRequest
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.remote import HttpCoordinator
    from rollout.sync.storage import CheckpointError, manifest_id, read_manifest, write_checkpoint
    from tests.conftest import API_KEY

    model_v1, _ = policy_v1
    good = tmp_path / "storage-v1"
    manifest = await asyncio.to_thread(write_checkpoint, model_v1.named_parameters(), good, shard_bytes=1 << 20, source_dir=model_dir)
    assert len(manifest.shards) > 1
    bad = tmp_path / "storage-v1-corrupted"
    shutil.copytree(good, bad)
    victim = read_manifest(bad).shards[-1].file
    data = bytearray((bad / victim).read_bytes())
    data[-1] ^= 0x40  # one bit of the last tensor
    (bad / victim).write_bytes(bytes(data))
    status = await _sync_status(base_url)
    committed, replicas = status["committed_version"], len(status["replicas"])
    before = await handle_client.generate([greedy(p, 16) for p in PROMPTS])
    trainer = WeightPublisher.http(base_url, api_key=API_KEY, token=SYNC_TOKEN)

    # The trainer's own check refuses it before any round opens, naming the shard.
    with pytest.raises(CheckpointError) as refused:
        await asyncio.to_thread(trainer.publish_checkpoint, bad)
    assert (refused.value.file, refused.value.problem) == (victim, "digest")
    # Replicas that find it corrupted (their mount differs, or it changed after the trainer
    # checked it) load nothing: the round aborts naming the replica and the shard.
    coordinator = HttpCoordinator(base_url, API_KEY, 120)
    plan = await asyncio.to_thread(coordinator.begin_storage, SYNC_TOKEN, StorageRequest(str(bad), manifest_id(bad), tuple(checkpoint_spec(bad))))
    outcome = await asyncio.to_thread(coordinator.finish, SYNC_TOKEN, plan.round_id, None)
    assert not outcome.committed and outcome.version == committed and outcome.failed_replicas
    assert all(f"{rid}: CheckpointError: checkpoint {bad}: {victim}: sha256" in outcome.error for rid in outcome.failed_replicas), outcome.error
    after = await handle_client.generate([greedy(p, 16) for p in PROMPTS])
    assert [r.samples[0].token_ids for r in after] == [r.samples[0].token_ids for r in before]
    assert [r.samples[0].weight_versions for r in after] == [r.samples[0].weight_versions for r in before]
    assert all(r["version"] == committed for r in (await _sync_status(base_url))["replicas"].values())

    # The good one: every replica serves exactly what a fresh engine on those weights does.
    version = await asyncio.to_thread(trainer.publish_checkpoint, good)
    assert version == committed + 1 and set(trainer.last_phases) == {"verify", "open", "commit"}
    await assert_every_replica_serves(handle_client, reference_v1, replicas, version=version)
    status = await _sync_status(base_url)
    assert status["recent_rounds"][-1]["round_id"].startswith(f"storage-{version}-") and status["recent_rounds"][-1]["committed"]
    assert all(r["version"] == version for r in status["replicas"].values())
    # Leave the app as a push leaves it (its copy, not this directory, serves restores).
    assert await asyncio.to_thread(publisher.publish, model_v1.named_parameters()) == version + 1
