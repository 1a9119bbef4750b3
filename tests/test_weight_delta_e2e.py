"""Deltas end to end: real Ray, Serve, vLLM (CPU) and the ``gloo_delta`` backend, published
through a Serve handle and through the HTTP ingress.

The shared app is redeployed with ``sync.backend: gloo_delta`` for this module. It runs
after every module that uses the shared app as configured and before those that replace
it with apps of their own (tests/conftest.py's ``E2E_ORDER``), so it leaves it as it is:
putting it back would start two engines that the next module deletes at once.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.sync import WeightPublisher, digest
from tests.conftest import API_KEY, E2E_ORDER, SYNC_TOKEN
from tests.test_weight_sync_e2e import assert_every_replica_serves, perturbed_policy, reference_engine, save_policy

pytestmark = pytest.mark.e2e
# The modules after this one in E2E_ORDER: each deletes the shared app and deploys its own.
REPLACE_THE_SHARED_APP = {"test_lora_e2e", "test_scaling_e2e"}


def sparse_change(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    from rollout.bench.weight_sync import changed_weights

    return changed_weights(tensors, fraction, torch.Generator().manual_seed(seed))


def combined(tensors: dict[str, torch.Tensor]) -> str:
    return digest.combine(digest.digest_all(tensors.items()))


async def refused_then_full(publisher: WeightPublisher, tensors: dict[str, torch.Tensor], theirs: int) -> int:
    """Publish ``tensors`` as a delta onto a base that is no longer committed (another
    publisher committed ``theirs``): refused before any round opens, it goes in full
    (logged), and every replica ends on what it sent."""
    mine = await asyncio.to_thread(publisher.publish, tensors)
    assert mine == theirs + 1
    assert publisher.last_choice.mode == "full" and "the coordinator refused the delta" in publisher.last_choice.rule, publisher.last_choice
    status = await asyncio.to_thread(publisher.status)
    assert status["committed_digest"] == {"version": mine, "digest": combined(tensors)}
    assert all(r["version"] == mine and r["received"] == status["committed_digest"] for r in status["replicas"].values()), status
    return mine


@pytest.fixture(scope="module")
def delta_platform(platform):
    from rollout.app import deploy

    def with_replicas(n: int):
        return platform.model_copy(
            update={"sync": platform.sync.model_copy(update={"backend": "gloo_delta"}), "deployment": platform.deployment.model_copy(update={"replicas": n})}
        )

    after = E2E_ORDER[E2E_ORDER.index(__name__.rsplit(".", 1)[-1]) + 1 :]
    assert set(after) <= REPLACE_THE_SHARED_APP, f"runs only before modules that replace the shared app, not before {after}"
    deploy(with_replicas(1))
    yield with_replicas


@pytest.fixture(scope="module")
def policies(model_dir, tmp_path_factory):
    """v1 (a perturbed policy) and v2 (v1 with 1% of every tensor changed), v2 saved."""
    model = perturbed_policy(model_dir, seed=5)
    v1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    v2 = sparse_change(v1, 0.01, seed=6)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(v2[n])
    return v1, v2, save_policy(model, model_dir, tmp_path_factory.mktemp("policy-delta-v2"))


async def test_a_sparse_change_goes_as_a_delta_and_serves_like_a_fresh_engine_and_a_later_replica_catches_up_to_its_bytes(
    delta_platform, policies, handle_client, ray_cluster, base_url
):
    from rollout.app import deploy

    v1, v2, v2_dir = policies
    reference = reference_engine(v2_dir)  # the session's engine; it loads v2 when first asked
    publisher = WeightPublisher.connect(app_name=delta_platform(1).app_name, token=SYNC_TOKEN)
    try:
        first = await asyncio.to_thread(publisher.publish, v1)
        assert publisher.last_choice.mode == "full" and "no committed base" in publisher.last_choice.rule

        version = await asyncio.to_thread(publisher.publish, v2)
        assert version == first + 1
        choice = publisher.last_choice
        assert choice.mode == "delta", choice
        # 1% of the elements, each an int64 index and a float32 value: about 3% of the bytes.
        assert choice.bytes_sent == choice.delta_bytes < choice.full_bytes / 10, choice
        # The digest check passed on the full new tensors: the publisher's digest is of v2,
        # and so is what the replica reports it holds.
        want = combined(v2)
        outcome = publisher.last_outcome
        assert outcome.committed and outcome.digest == want and set(outcome.replica_digests.values()) == {want}, outcome
        await assert_every_replica_serves(handle_client, reference, replicas=1, version=version)

        # A replica added afterwards catches up from the coordinator's copy (sent in full
        # after the delta committed) to the same bytes.
        await asyncio.to_thread(deploy, delta_platform(2))
        status = await asyncio.to_thread(publisher.status)
        assert len(status["replicas"]) == 2 and status["committed_digest"] == {"version": version, "digest": want}, status
        assert {rid: r["received"] for rid, r in status["replicas"].items()} == {rid: {"version": version, "digest": want} for rid in status["replicas"]}, status
        await assert_every_replica_serves(handle_client, reference, replicas=2, version=version)

        # Another publisher commits meanwhile: this one's base (v2) is not the committed
        # version any more. Its delta is refused before any round opens and it sends in
        # full (logged); every replica ends on what it sent.
        # (This one's copy for the coordinator is sent first: the other's rendezvous port,
        # picked free, must not be taken meanwhile by the copy group's gloo listeners.)
        await asyncio.to_thread(publisher.flush)
        other = WeightPublisher.connect(app_name=delta_platform(2).app_name, token=SYNC_TOKEN)
        try:
            theirs = await asyncio.to_thread(other.publish, v1)
        finally:
            other.close()
        assert theirs == version + 1 and other.last_choice.mode == "full"
        v4 = sparse_change(v2, 0.01, seed=7)
        await refused_then_full(publisher, v4, theirs)

        # From that full send on, deltas again.
        v5 = sparse_change(v4, 0.01, seed=8)
        await asyncio.to_thread(publisher.publish, v5)
        assert publisher.last_choice.mode == "delta" and publisher.last_outcome.digest == combined(v5)

        # Over HTTP, as a trainer outside the Ray cluster attaches (through the ingress): its
        # first publish is full (it holds no base), then v2 (v1 with 1% changed) goes as a
        # delta, and both replicas serve what the fresh engine loaded with v2 serves.
        await asyncio.to_thread(publisher.flush)
        over_http = WeightPublisher.http(base_url, api_key=API_KEY, token=SYNC_TOKEN)
        try:
            await asyncio.to_thread(over_http.publish, v1)
            assert over_http.last_choice.mode == "full" and "no committed base" in over_http.last_choice.rule, over_http.last_choice
            version = await asyncio.to_thread(over_http.publish, v2)
            choice = over_http.last_choice
            assert choice.mode == "delta" and choice.bytes_sent == choice.delta_bytes < choice.full_bytes / 10, choice
            outcome = over_http.last_outcome
            assert outcome.committed and outcome.digest == want and set(outcome.replica_digests.values()) == {want}, outcome
            await assert_every_replica_serves(handle_client, reference, replicas=2, version=version)

            # Another publisher commits meanwhile: the coordinator refuses this one's delta
            # over HTTP with the same typed DeltaBaseError, and it sends in full instead.
            await asyncio.to_thread(over_http.flush)
            theirs = await asyncio.to_thread(publisher.publish, v4)
            assert theirs == version + 1
            await asyncio.to_thread(publisher.flush)
            await refused_then_full(over_http, sparse_change(v2, 0.01, seed=9), theirs)
        finally:
            over_http.close()
    finally:
        publisher.close()
