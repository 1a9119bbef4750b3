"""Overload: with every replica busy and the caller's queue full, a call is refused at
once, through HTTP (429 with Retry-After) and through the handle (OverloadedError), and
every call that was accepted is answered in full."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from rollout.api import RolloutRequest, SamplingConfig
from rollout.client import RolloutClient
from rollout.errors import OverloadedError
from tests.conftest import API_KEY

pytestmark = pytest.mark.e2e

TOKENS = 96


def request(i: int) -> dict:
    return {"prompt_token_ids": [5 + i, 6, 7], "sampling": {"max_tokens": TOKENS, "ignore_eos": True}}


@pytest.fixture(scope="module")
def tight_queue(platform):
    """The shared app with one call per replica and one waiting at each caller; restored after."""
    from rollout.app import deploy

    tight = platform.deployment.model_copy(update={"max_ongoing_requests": 1, "max_queued_requests": 1, "overload_retry_after_s": 2.0})
    deploy(platform.model_copy(update={"deployment": tight}))
    yield platform
    deploy(platform)


async def test_http_refuses_at_once_with_429_and_retry_after_and_answers_every_accepted_call(tight_queue, base_url):
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:

        async def call(i: int):
            t0 = time.monotonic()
            r = await c.post("/v1/rollouts", json={"requests": [request(i)]})
            return r, time.monotonic() - t0

        answers = await asyncio.gather(*(call(i) for i in range(6)))
    refused = [(r, s) for r, s in answers if r.status_code == 429]
    accepted = [r for r, _ in answers if r.status_code == 200]
    assert refused and accepted and len(refused) + len(accepted) == 6, [r.status_code for r, _ in answers]
    slowest_accepted = max(s for r, s in answers if r.status_code == 200)
    for r, seconds in refused:
        assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "overloaded", r.text
        assert seconds < slowest_accepted, "refused at once, not after waiting its turn"
    assert all(len(r.json()["results"][0]["samples"][0]["token_ids"]) == TOKENS for r in accepted), "accepted calls are answered in full"


async def test_the_handle_raises_a_typed_retryable_error(tight_queue):
    client = RolloutClient.connect(app_name=tight_queue.app_name, batch_size=1)
    try:
        reqs = [RolloutRequest(prompt_token_ids=[9 + i, 8], sampling=SamplingConfig(max_tokens=TOKENS, ignore_eos=True)) for i in range(6)]
        with pytest.raises(OverloadedError) as exc:
            await client.generate(reqs)
        assert exc.value.retry_after_s == 2.0 and "max_queued_requests" in str(exc.value)
        # Retrying after the advertised delay goes through: by then the burst's accepted calls
        # have finished or been cancelled (the refusal cancels its siblings, which takes a moment).
        await asyncio.sleep(exc.value.retry_after_s)
        (result,) = await client.generate(reqs[:1])
        assert len(result.samples[0].token_ids) == TOKENS
    finally:
        client.close()
