"""rollout.kube against stand-ins for the Kubernetes API (no API server can run here)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout.config import load_config
from rollout.errors import AuthenticationError
from rollout.kube import render_rayservice_status, review_token


class FakeAuthApi:
    """An API server whose tokens are all issued for ``issued_for`` (as a projected token
    with that audience is); a review naming other audiences does not authenticate them."""

    def __init__(self, tokens: dict[str, str], issued_for: str = "rollout-platform"):
        self.tokens = tokens
        self.issued_for = issued_for
        self.reviews = []
        self.fail = False

    def create_token_review(self, body):
        self.reviews.append(body)
        if self.fail:
            raise ConnectionError("API server unreachable")
        user = self.tokens.get(body.spec.token)
        wanted = body.spec.audiences or [self.issued_for]
        ok = user is not None and self.issued_for in wanted
        status = SimpleNamespace(authenticated=ok, user=SimpleNamespace(username=user if ok else None), audiences=[self.issued_for] if ok else None, error=None if ok else "invalid")
        return SimpleNamespace(status=status)


def test_review_token_returns_the_authenticated_service_account():
    api = FakeAuthApi({"good": "system:serviceaccount:rl:trainer"})
    assert review_token("good", api=api) == "system:serviceaccount:rl:trainer"
    assert review_token("bad", api=api) is None
    assert api.reviews[0].spec.token == "good"


def _coordinator(monkeypatch, allowed, tokens, sync_token=None):
    from rollout.sync import coordinator as mod

    if sync_token:
        monkeypatch.setenv("ROLLOUT_SYNC_TOKEN", sync_token)
    else:
        monkeypatch.delenv("ROLLOUT_SYNC_TOKEN", raising=False)
    cfg = load_config({"model": {"path": "/m"}, "sync": {"allowed_service_accounts": allowed}, "metrics": {"enabled": False}}, environ={})
    api = FakeAuthApi(tokens)
    monkeypatch.setattr("rollout.kube.review_token", lambda token, audiences=None, api_=None: review_token(token, audiences, api=api))
    return mod.WeightSyncCoordinator(cfg.model_dump(mode="json"), "gloo")


def test_coordinator_accepts_an_allowed_service_account_token(monkeypatch):
    c = _coordinator(monkeypatch, ["system:serviceaccount:rl:trainer"], {"sa-token": "system:serviceaccount:rl:trainer", "other": "system:serviceaccount:rl:intruder"}, "shared")
    asyncio.run(c._authorize("sa-token"))
    asyncio.run(c._authorize("shared"))
    with pytest.raises(AuthenticationError, match="intruder"):
        asyncio.run(c._authorize("other"))
    with pytest.raises(AuthenticationError, match="unauthenticated"):
        asyncio.run(c._authorize("garbage"))
    with pytest.raises(AuthenticationError, match="missing"):
        asyncio.run(c._authorize(None))


def test_the_review_names_the_platforms_audience_and_a_token_for_another_audience_is_refused():
    api = FakeAuthApi({"sa-token": "system:serviceaccount:rl:trainer"}, issued_for="https://kubernetes.default.svc")
    assert review_token("sa-token", ["rollout-platform"], api=api) is None, "a token meant for the API server is not ours to accept"
    assert api.reviews[-1].spec.audiences == ["rollout-platform"]
    # An API server that says the token is valid but not for which audience: refused too.
    lax = SimpleNamespace(create_token_review=lambda body: SimpleNamespace(status=SimpleNamespace(authenticated=True, user=SimpleNamespace(username="system:serviceaccount:rl:trainer"), audiences=None)))
    assert review_token("sa-token", ["rollout-platform"], api=lax) is None
    ours = FakeAuthApi({"sa-token": "system:serviceaccount:rl:trainer"})
    assert review_token("sa-token", ["rollout-platform"], api=ours) == "system:serviceaccount:rl:trainer"


def test_the_coordinator_reviews_tokens_for_the_configured_audience(monkeypatch):
    monkeypatch.delenv("ROLLOUT_SYNC_TOKEN", raising=False)
    from rollout.sync import coordinator as mod

    cfg = load_config({"model": {"path": "/m"}, "sync": {"allowed_service_accounts": ["system:serviceaccount:rl:trainer"], "token_audience": "rl-weights"}, "metrics": {"enabled": False}}, environ={})
    c = mod.WeightSyncCoordinator(cfg.model_dump(mode="json"), "gloo")
    api = FakeAuthApi({"sa-token": "system:serviceaccount:rl:trainer"}, issued_for="rl-weights")
    c.auth.reviewer.api = api
    asyncio.run(c._authorize("sa-token"))
    assert api.reviews[-1].spec.audiences == ["rl-weights"]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reviews_are_cached_briefly_by_a_hash_of_the_token_failures_shorter_than_successes():
    from rollout.kube import TokenReviewer

    api, clock = FakeAuthApi({"good": "system:serviceaccount:rl:trainer"}), Clock()
    reviewer = TokenReviewer(["rollout-platform"], api=api, ok_ttl_s=60, fail_ttl_s=5, clock=clock)
    for _ in range(3):
        assert reviewer.review("good") == "system:serviceaccount:rl:trainer"
        assert reviewer.review("bad") is None
    assert len(api.reviews) == 2, "one review per token while cached"
    assert all(b"good" not in key and b"bad" not in key for key in reviewer._entries), "the cache keeps no token"
    clock.now += 6  # the refusal expired, the success not yet
    assert reviewer.review("bad") is None and reviewer.review("good") == "system:serviceaccount:rl:trainer"
    assert [r.spec.token for r in api.reviews] == ["good", "bad", "bad"]
    clock.now += 60  # a revoked token stops working once its entry expires
    del api.tokens["good"]
    assert reviewer.review("good") is None


def test_the_review_cache_is_bounded_and_does_not_cache_an_api_error():
    from rollout.kube import TokenReviewer

    api, clock = FakeAuthApi({}), Clock()
    reviewer = TokenReviewer(["rollout-platform"], api=api, max_entries=4, clock=clock)
    for i in range(10):
        reviewer.review(f"t{i}")
    assert len(reviewer) == 4
    reviewer.review("t9")
    assert len(api.reviews) == 10, "the newest stay cached"
    reviewer.review("t0")
    assert len(api.reviews) == 11, "the oldest went first"
    api.fail = True
    with pytest.raises(ConnectionError):
        reviewer.review("new")
    api.fail = False
    api.tokens["new"] = "system:serviceaccount:rl:trainer"
    assert reviewer.review("new") == "system:serviceaccount:rl:trainer", "an API error is not remembered as a refusal"


def test_rayservice_status_shows_apps_deployments_and_conditions():
    obj = {
        "metadata": {"namespace": "rl", "name": "rollout"},
        "status": {
            "serviceStatus": "Running",
            "activeServiceStatus": {
                "rayClusterName": "rollout-raycluster-abcde",
                "applicationStatuses": {"rollout": {"status": "RUNNING", "serveDeploymentStatuses": {"RolloutEngine": {"status": "HEALTHY"}}}},
            },
            "pendingServiceStatus": {"rayClusterName": "rollout-raycluster-fghij"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "NonZeroServeEndpoints", "message": "2 endpoints"}],
        },
    }
    text = render_rayservice_status(obj)
    for expected in ("rl/rollout", "Running", "rollout-raycluster-abcde", "RolloutEngine", "HEALTHY", "upgrade in progress", "Ready", "NonZeroServeEndpoints"):
        assert expected in text, expected
