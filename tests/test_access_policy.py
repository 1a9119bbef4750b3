"""Who may do what at the ingress (rollout.sync.auth.AccessPolicy): the one decision the
ingress's routes and vLLM's RL routes call, without a live ingress."""

from __future__ import annotations

import pytest

from rollout.errors import AuthenticationError
from rollout.sync.auth import SYNC_TOKEN_HEADER, AccessPolicy, Operation, Presented, SyncAuth

KEY, TOKEN = "api-key", "sync-token"


def policy(api_key=KEY, sync_required=True) -> AccessPolicy:
    return AccessPolicy(api_key, SyncAuth(required=sync_required, token_env="ROLLOUT_SYNC_TOKEN", token=TOKEN))


def presented(bearer=None, sync=None) -> Presented:
    headers = {}
    if bearer is not None:
        headers["authorization"] = f"Bearer {bearer}"
    if sync is not None:
        headers[SYNC_TOKEN_HEADER] = sync
    return Presented.of(headers)


def test_headers_are_read_as_a_bearer_and_a_sync_token():
    assert Presented.of({"authorization": "bearer  k  ", SYNC_TOKEN_HEADER: "t"}) == Presented("k", "t")
    assert Presented.of({"authorization": KEY}) == Presented(None, None), "no scheme: no bearer"
    assert Presented.of({"authorization": "Basic abc"}).bearer is None
    assert "k" not in repr(Presented("k", "t")), "credentials stay out of logs"


@pytest.mark.parametrize("operation", [Operation.SERVE, Operation.PUBLISH])
def test_the_api_routes_take_the_api_key(operation):
    with pytest.raises(AuthenticationError, match="missing API key"):
        policy().admit(operation, presented(sync=TOKEN))
    with pytest.raises(AuthenticationError, match="wrong API key"):
        policy().admit(operation, presented(bearer="nope", sync=TOKEN))
    assert policy(api_key=None).admit(operation, presented()) is None  # an open API (the ingress warns at start-up)


def test_publishing_hands_the_sync_token_to_the_coordinator_and_serving_hands_nothing():
    assert policy().admit(Operation.PUBLISH, presented(bearer=KEY, sync=TOKEN)) == TOKEN
    assert policy().admit(Operation.PUBLISH, presented(bearer=KEY)) is None  # the coordinator refuses it, if it needs one
    assert policy().admit(Operation.SERVE, presented(bearer=KEY, sync=TOKEN)) is None


def test_the_rl_routes_take_one_credential_the_sync_token_where_sync_needs_one():
    # A vLLM client sends its only header, Authorization: the sync token goes to the coordinator.
    assert policy().admit(Operation.DRIVE, presented(bearer=TOKEN)) == TOKEN
    assert policy().admit(Operation.DRIVE, presented(bearer=KEY, sync=TOKEN)) == TOKEN, "the sync header first"
    assert policy().admit(Operation.DRIVE, presented()) is None  # the coordinator says it is missing


def test_without_a_sync_token_the_rl_routes_take_the_api_key_and_hand_the_coordinator_nothing():
    open_sync = policy(sync_required=False)
    assert open_sync.admit(Operation.DRIVE, presented(bearer=KEY)) is None
    for wrong in (presented(), presented(bearer="nope"), presented(bearer=TOKEN)):
        with pytest.raises(AuthenticationError, match="missing or wrong API key"):
            open_sync.admit(Operation.DRIVE, wrong)
    assert policy(api_key=None, sync_required=False).admit(Operation.DRIVE, presented(bearer="anything")) is None
