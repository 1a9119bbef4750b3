"""The typed coordinator client (rollout.sync.coordinator_client) against a fake Serve
handle: a unit test of that module (the e2e modules drive it against the real coordinator)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from rollout.contracts.sync_protocol import Control, CoordinatorUnreachableError, FleetQuery, SyncError
from rollout.errors import AuthenticationError
from rollout.sync.coordinator_client import BlockingCoordinatorHandle, CoordinatorHandle


def public_async_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in inspect.getmembers(cls, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }


def test_every_public_method_of_the_coordinator_has_a_typed_call_with_its_parameters():
    from rollout.sync.coordinator import WeightSyncCoordinator

    served = public_async_methods(WeightSyncCoordinator)
    typed = public_async_methods(CoordinatorHandle)
    assert set(typed) == set(served), "a coordinator method without a typed call, or a typed call of no method"
    for name, sig in served.items():
        # Same names, order and defaults: the typed call passes its arguments positionally.
        want = [(p.name, p.default) for p in sig.parameters.values()]
        got = [(p.name, p.default) for p in typed[name].parameters.values()]
        assert got == want, name


class Response:
    """What a DeploymentHandle's ``.remote()`` returns: awaitable, or ``result()`` blocking."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        if self.error is not None:
            raise self.error
        return self.value

    def result(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value


class FakeHandle:
    """Records each call by method name; answers what ``answers`` says."""

    def __init__(self, **answers):
        self.calls: list[tuple[str, tuple]] = []
        self.answers = answers

    def __getattr__(self, name):
        handle = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                assert not kwargs, "the typed calls pass arguments positionally"
                handle.calls.append((name, args))
                answer = handle.answers.get(name)
                return answer if isinstance(answer, Response) else Response(answer)

        return Method


def ray_wrapped(error: BaseException) -> BaseException:
    """The error as a Serve handle raises it: a RayTaskError that is also an instance of its cause."""
    from ray.exceptions import RayTaskError

    return RayTaskError("WeightSyncCoordinator.begin_round", "Traceback ...", error).as_instanceof_cause()


def test_calls_go_to_the_method_of_the_same_name_with_the_arguments_in_order():
    handle = FakeHandle(register=7, next_round=None, drive=True)
    client = CoordinatorHandle(handle)

    async def run():
        assert await client.register("r1", 2, 3, []) == 7
        assert await client.next_round("r1", 3) is None
        assert await client.drive("tok", FleetQuery.IS_PAUSED) is True
        await client.finish("tok", "round-1")

    asyncio.run(run())
    assert handle.calls == [
        ("register", ("r1", 2, 3, [])),
        ("next_round", ("r1", 3, Control(), True)),
        ("drive", ("tok", FleetQuery.IS_PAUSED)),
        ("finish", ("tok", "round-1", None)),
    ]


def test_the_coordinators_own_error_reaches_the_caller_unwrapped():
    wrapped = ray_wrapped(AuthenticationError("wrong sync token"))
    assert type(wrapped) is not AuthenticationError  # Ray's dual class, not ours
    client = CoordinatorHandle(FakeHandle(begin_round=Response(error=wrapped)))
    with pytest.raises(AuthenticationError, match="wrong sync token") as exc:
        asyncio.run(client.begin_round("tok", None))
    assert type(exc.value) is AuthenticationError


def test_blocking_calls_type_a_silent_coordinator_a_dead_one_and_pass_its_errors_through():
    from ray.exceptions import ActorDiedError

    class Silent(Response):
        def result(self, timeout_s=None):
            assert timeout_s == 0.5
            raise TimeoutError()

    with pytest.raises(CoordinatorUnreachableError, match="did not answer status within 0.5s"):
        BlockingCoordinatorHandle(FakeHandle(status=Silent())).status(timeout_s=0.5)
    with pytest.raises(SyncError, match="died during begin_round.*may have committed"):
        BlockingCoordinatorHandle(FakeHandle(begin_round=Response(error=ActorDiedError()))).begin_round("tok", None)
    with pytest.raises(SyncError, match="unknown round") as exc:
        BlockingCoordinatorHandle(FakeHandle(finish=Response(error=ray_wrapped(SyncError("unknown round round-9"))))).finish("tok", "round-9", None)
    assert type(exc.value) is SyncError
    handle = FakeHandle(status={"committed_version": 4})
    assert BlockingCoordinatorHandle(handle, timeout_s=3).status() == {"committed_version": 4}
    assert handle.calls == [("status", ())]
