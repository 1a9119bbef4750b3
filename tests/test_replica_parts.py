"""The replica's parts as it composes them, over a fake engine: every path counts its
requests in and out of flight however it ends, and with weight sync off the gate serves
version 0 (rollout.engine.replica, .admission, .sync_gate)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout.api import RolloutRequest
from rollout.config import load_config
# vLLM imported up front, as a real replica has it from its engine's start: the adapter
# imports it at a request's first use, which would count against the 5 s bounds below.
import rollout.engine.convert  # noqa: F401
from rollout.engine.adapter import EngineAdapter
from rollout.engine.openai_app import ForwardedRequest
from rollout.engine.replica import RolloutEngine
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.sync_gate import NoSync, SyncGate, SyncState
from rollout.engine.validation import ModelLimits
from rollout.errors import EngineUnavailableError, InvalidRequestError, NotServingError
from rollout.rewards import RewardScorer


class StepEngine:
    """Yields one token per step, each step once ``steps`` lets it; records aborts."""

    errored = False
    dead_error = None

    def __init__(self, fail: bool = False):
        self.steps = asyncio.Semaphore(0)
        self.fail = fail
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id):
        try:
            for i in range(3):
                await asyncio.wait_for(self.steps.acquire(), 5)
                if self.fail:
                    raise RuntimeError("engine step failed")
                completion = SimpleNamespace(
                    index=0, token_ids=[7], logprobs=None, finish_reason="length" if i == 2 else None, stop_reason=None, text="x", weight_versions=None
                )
                yield SimpleNamespace(outputs=[completion])
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)  # what vLLM's generate does on either: abort the request
            raise

    async def check_health(self):
        return None

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self):
        pass


def replica(engine=None, agent=None, **config) -> RolloutEngine:
    r = object.__new__(RolloutEngine)  # the parts only: no vLLM engine behind them
    cfg = load_config({"model": {"path": "/models/x"}, **config}, environ={})
    adapter = EngineAdapter(engine or StepEngine(), None, ModelLimits(vocab_size=100, max_model_len=64, max_n=4), SchedulerSnapshot())
    r._assemble(cfg, "r", adapter, SyncGate.over(agent, cfg.sync, "r"), RewardScorer.from_config(cfg.rewards))
    return r


def request(**fields) -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=[1, 2], sampling={"max_tokens": 3}, **fields)


async def until(condition, timeout_s: float = 5) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_batch_is_in_flight_while_it_runs_and_not_after_it_ends_or_fails_or_is_cancelled():
    engine = StepEngine()
    r = replica(engine)
    inflight = r.admission.inflight
    call = asyncio.create_task(r.generate([request(), request()]))
    await until(lambda: inflight.count == 2)
    for _ in range(6):
        engine.steps.release()
    results = await asyncio.wait_for(call, 5)
    assert [len(res.samples[0].token_ids) for res in results] == [1, 1] and results[0].committed_version == 0
    assert inflight.count == 0

    cancelled = asyncio.create_task(r.generate([request()]))
    await until(lambda: inflight.count == 1)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert inflight.count == 0 and len(engine.aborted) == 1

    failing = StepEngine(fail=True)
    r = replica(failing)
    call = asyncio.create_task(r.generate([request()]))
    await until(lambda: r.admission.inflight.count == 1)
    failing.steps.release()
    with pytest.raises(RuntimeError, match="engine step failed"):
        await asyncio.wait_for(call, 5)
    assert r.admission.inflight.count == 0


async def test_a_stream_left_early_leaves_flight_and_aborts_its_request_in_the_engine():
    engine = StepEngine()
    r = replica(engine)
    stream = r.generate_stream(request())
    engine.steps.release()
    first = await asyncio.wait_for(stream.__anext__(), 5)
    assert first.prompt_token_ids == [1, 2] and r.admission.inflight.count == 1
    await stream.aclose()
    assert r.admission.inflight.count == 0 and len(engine.aborted) == 1, "closing the stream closes the engine's at once"


async def test_an_openai_route_is_in_flight_until_its_body_is_sent_and_names_the_version():
    r = replica()
    seen_in_flight = []

    async def app(scope, receive, send):
        seen_in_flight.append(r.admission.inflight.count)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    r.openai_app = app
    parts = [p async for p in r.openai_http({}, ForwardedRequest("GET", "/v1/models", "", (), b""))]
    start, body = parts
    assert seen_in_flight == [1] and r.admission.inflight.count == 0
    assert start["status"] == 200 and body == b"{}"
    headers = dict(start["headers"])
    assert headers["x-rollout-weight-version"] == "default" and headers["x-rollout-replica"] == "r" and "content-length" not in headers


async def test_an_openai_request_that_does_not_stream_is_one_answer_of_the_same_parts():
    """The ingress sends a request whose body does not ask to stream as one Serve call
    (openai_http_unary): the same start and body as the stream of parts, the body whole."""
    from rollout.engine.openai_app import routing_hint

    r = replica()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        for piece in (b'{"a"', b": 1}"):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    r.openai_app = app
    request = ForwardedRequest("POST", "/v1/completions", "", (), b'{"prompt": [1, 2]}')
    start, body = await r.openai_http_unary({}, request)
    streamed = [p async for p in r.openai_http({}, request)]
    assert start == streamed[0] and body == b'{"a": 1}' == b"".join(streamed[1:])
    assert r.admission.inflight.count == 0
    # What the ingress decides it by: the body's own "stream", parsed with the routing hint.
    assert routing_hint("/v1/completions", b'{"prompt": [1, 2], "stream": true}', "s") == ({"session_id": "s", "prompt_token_ids": [1, 2]}, True)
    for body in (b'{"prompt": "x"}', b'{"prompt": "x", "stream": false}', b"not json", b"", b"[1]"):
        assert routing_hint("/v1/completions", body, None)[1] is False, body


async def test_an_openai_request_naming_an_adapter_committed_but_not_loaded_here_is_refused_retryably_before_the_app():
    from rollout.sync.adapters import ServedAdapters

    agent = NoSync()
    agent.adapters = ServedAdapters(None, "r")
    agent.adapters.unavailable["math"] = 2  # learned back by a restarted coordinator, no copy to load
    r = replica(agent=agent)
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    r.openai_app = app

    def call(body: bytes):
        return r.openai_http({}, ForwardedRequest("POST", "/v1/completions", "", (), body))

    with pytest.raises(NotServingError, match="'math' version 2 is committed but not loaded here") as e:
        await call(b'{"model": "math", "prompt": "x"}').__anext__()
    assert e.value.replica_id == "r" and reached == [] and r.admission.inflight.count == 0
    # Any other model (the base model, a name vLLM answers its own 404 for) and a body
    # that is not JSON reach vLLM's app as they are.
    for body in (b'{"model": "other", "prompt": "x"}', b"not json", b'{"model": 3}'):
        assert (await call(body).__anext__())["status"] == 404
    assert len(reached) == 3


async def test_without_weight_sync_a_replica_serves_version_0_and_refuses_a_newer_one_at_once():
    r = replica(sync={"max_staleness": 1})
    assert (r.gate.held, r.gate.version, r.gate.known_committed) == (False, 0, 0)
    await asyncio.wait_for(r.gate.admit([(request(), [1, 2]), (request(min_weight_version=0), [1, 2])]), 1)
    with pytest.raises(InvalidRequestError, match="weight sync is disabled; version 0 is all this platform serves") as e:
        await asyncio.wait_for(r.gate.admit([(request(), [1, 2]), (request(min_weight_version=1), [1, 2])], offset=2), 1)
    assert e.value.field == "requests[3].min_weight_version"


async def test_a_broken_replica_fails_its_probe_and_one_awaiting_a_publish_only_refuses_requests():
    broken, awaiting = NoSync(), NoSync()
    broken.broken = "weight-sync loop ended"
    awaiting.awaiting_publish = "waiting for the next publish"
    r = replica(agent=broken)
    with pytest.raises(EngineUnavailableError, match="weight-sync loop ended"):
        await r.generate([request()])
    with pytest.raises(EngineUnavailableError, match="weight-sync loop ended"):
        await r.check_health()
    r = replica(agent=awaiting)
    with pytest.raises(NotServingError, match="next publish"):
        await r.generate([request()])
    await r.check_health()
    assert r.admission.inflight.count == 0


def test_the_sync_agent_has_everything_the_gate_reads(model_dir):
    from rollout.sync.agent import SyncAgent

    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir))
    assert isinstance(agent, SyncState) and isinstance(NoSync(), SyncState)
