"""Prefix-cache salts by weight version (rollout.sync.salt), without an engine: the salts
vLLM's own block hashing tells apart, what each path hands vLLM, and when an update still
flushes the cache. The end-to-end check is in tests/test_weight_sync_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from rollout.config import SyncConfig
from rollout.sync.salt import CacheSalts


def block_hashes(prompt: list[int], salt):
    """vLLM's own block hashes of a request, as its scheduler's prefix cache keys them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request("r", prompt, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=get_request_block_hasher(16, sha256))
    return request.block_hashes


def test_vllm_reuses_a_block_only_under_the_same_version_and_callers_salt():
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    salts = CacheSalts(salting=True)
    prompt = list(range(3, 67))  # four whole blocks of 16
    v1, v2 = salts.salt(1), salts.salt(2)
    assert block_hashes(prompt, v1) == block_hashes(prompt, salts.salt(1)), "one version: one cache"
    old, new = block_hashes(prompt, v1), block_hashes(prompt, v2)
    assert len(old) == 4 and not set(old) & set(new), "no block of version 1 is a block of version 2 (hashes chain from the salted first)"
    # A caller's salt (vLLM's OpenAI `cache_salt`) keeps callers apart within a version.
    alice, bob = salts.salt(2, "alice"), salts.salt(2, "bob")
    assert len({v2, alice, bob, salts.salt(1, "alice")}) == 4
    assert not set(block_hashes(prompt, alice)) & set(block_hashes(prompt, bob))
    for salt in (v1, alice, salts.salt(10**12, "x" * 128 + "@/\\")):
        validate_cache_salt(salt)  # what vLLM's OpenAI server accepts: <= 128 characters, none of '@/\' or NUL


def test_a_request_handed_over_during_a_pause_gets_that_pauses_own_salt():
    salts = CacheSalts(salting=True)
    before = salts.salt(4)
    assert salts.pause() is False, "nothing in flight"
    during = salts.salt(4)
    assert during != before, "it starts under whatever version the update leaves: it must not reuse version 4's blocks"
    salts.pause()  # a round inside a trainer's hold
    salts.resume()
    assert salts.salt(4) != before, "still held"
    salts.resume()
    assert salts.salt(4) == before and salts.salt(5) != before
    salts.pause()
    salts.resume()
    assert salts.salt(5) == "rollout-v5", "after the update: the version's own salt"


def test_an_update_says_whether_requests_handed_over_before_it_are_unfinished():
    salts = CacheSalts(salting=True)
    with salts.request(1) as salt:
        assert salt == "rollout-v1" and salts.active == 1
        assert salts.pause() is True
        salts.resume()
    assert salts.active == 0 and salts.pause() is False
    with pytest.raises(RuntimeError), salts.request(1):
        raise RuntimeError("the request failed")
    assert salts.active == 0


def test_with_flush_or_without_weight_sync_requests_keep_the_callers_salt():
    flush = CacheSalts(salting=False)
    assert flush.salt(3) is None and flush.salt(3, "mine") == "mine"
    assert SyncConfig().prefix_cache == "salt"
    with pytest.raises(ValueError, match="prefix_cache"):
        SyncConfig(prefix_cache="keep")


# ---- what the replica hands vLLM ------------------------------------------------------


class PromptEngine:
    """Records the prompts vLLM would be handed (and how many requests held a salt then)."""

    errored = False

    def __init__(self, salts=None):
        self.prompts = []
        self.salts = salts
        self.closed = 0

    async def generate(self, prompt, params, request_id=None):
        self.prompts.append((prompt, self.salts.active if self.salts else None))
        try:
            completion = SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None, text="x", weight_versions=None)
            yield SimpleNamespace(outputs=[completion])
            await asyncio.sleep(0)
        finally:
            self.closed += 1

    def shutdown(self):
        pass


def salted_replica(model_dir, prefix_cache="salt", version=3, sync=True):
    from rollout.sync.agent import SyncAgent
    from tests.test_replica_parts import replica

    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir), sync=SyncConfig(prefix_cache=prefix_cache)) if sync else None
    if agent is not None:
        agent.version = version
    engine = PromptEngine(agent.salts if agent else None)
    return replica(engine, agent, sync={"prefix_cache": prefix_cache}), engine, agent


async def test_every_request_reaches_vllm_with_the_salt_of_the_version_it_starts_under(model_dir):
    from tests.test_replica_parts import request

    r, engine, agent = salted_replica(model_dir)
    await r.generate([request()])
    [chunk async for chunk in r.generate_stream(request())]
    assert [(p["prompt_token_ids"], p["cache_salt"], active) for p, active in engine.prompts] == [([1, 2], "rollout-v3", 1)] * 2
    assert agent.salts.active == 0, "finished requests are no longer counted"
    agent.salts.pause()
    await r.generate([request()])
    assert engine.prompts[-1][0]["cache_salt"] == f"rollout-v3-p{agent.salts._pauses}"


@pytest.mark.parametrize("prefix_cache,sync", [("flush", True), ("salt", False)])
async def test_with_flush_or_without_weight_sync_no_salt_is_added(model_dir, prefix_cache, sync):
    from tests.test_replica_parts import request

    r, engine, _ = salted_replica(model_dir, prefix_cache, sync=sync)
    await r.generate([request()])
    assert "cache_salt" not in engine.prompts[0][0]


async def test_the_openai_apps_requests_carry_the_salt_with_the_callers_folded_in_and_closing_aborts(model_dir):
    from rollout.engine.openai_app import SaltedEngine

    r, engine, agent = salted_replica(model_dir)
    salted = SaltedEngine(engine, r.gate.salted)
    assert salted.errored is False, "everything else is the engine's own"
    outs = [o async for o in salted.generate({"type": "token", "prompt_token_ids": [1]}, None, "a")]
    assert len(outs) == 1 and engine.prompts[-1] == ({"type": "token", "prompt_token_ids": [1], "cache_salt": "rollout-v3"}, 1)
    [o async for o in salted.generate({"type": "token", "prompt_token_ids": [1], "cache_salt": "tenant-a"}, None, "b")]
    assert engine.prompts[-1][0]["cache_salt"] == agent.salts.salt(3, "tenant-a") != agent.salts.salt(3, "tenant-b")
    gen = salted.generate({"type": "token", "prompt_token_ids": [1]}, None, "c")
    await gen.__anext__()
    closed = engine.closed
    await gen.aclose()
    assert engine.closed == closed + 1 and agent.salts.active == 0, "closing it closes vLLM's generator (which aborts the request)"


# ---- when an update flushes -----------------------------------------------------------


async def first_pause(model_dir, prefix_cache: str, pause_mode: str = "keep", in_flight: bool = False):
    """The pause of a replica's catch-up round (a reload of a committed checkpoint) as the
    engine was asked for it: ``(mode, clear_cache)``. Catch-up pauses in ``keep``; the
    caller makes reload rounds pause in ``pause_mode``, as publish rounds do."""
    from rollout.sync.agent import SyncAgent
    from tests.inprocess import InProcess, RecordingEngine
    from tests.test_sync_agent import committed_from_a_checkpoint

    sync = {"timeout_s": 5, "require_token": False, "prefix_cache": prefix_cache}
    coordinator = await committed_from_a_checkpoint(model_dir, sync)
    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="b", ranks=1, model_path=str(model_dir), sync=SyncConfig(**sync))
    with contextlib.ExitStack() as requests:
        if in_flight:
            requests.enter_context(agent.salts.request(0))
        await agent.start()
    agent.stop()
    assert agent.version == 1 and engine.calls[0][0] == "pause_generation"
    return engine.calls[0][1:]


@pytest.mark.parametrize(
    "prefix_cache,pause_mode,in_flight,flushed",
    [
        ("salt", "keep", False, False),  # nothing carried across: salts alone keep old KV unused
        ("salt", "keep", True, True),  # `keep` carries a request: its KV is computed again on the new weights
        ("salt", "wait", True, False),  # it finishes before the update
        ("salt", "abort", True, False),  # it ends
        ("flush", "keep", False, True),
        ("flush", "wait", False, True),
    ],
)
async def test_an_update_flushes_only_where_salts_cannot_keep_old_kv_from_serving(model_dir, monkeypatch, prefix_cache, pause_mode, in_flight, flushed):
    from rollout.contracts.sync_protocol import ReloadRound

    monkeypatch.setattr(ReloadRound, "pause_mode", property(lambda self: pause_mode))
    assert await first_pause(model_dir, prefix_cache, pause_mode, in_flight) == (pause_mode, flushed)
