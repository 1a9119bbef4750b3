"""rollout.kube against stand-ins for the Kubernetes API (no API server can run here)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout.config import load_config
from rollout.errors import AuthenticationError
from rollout.kube import render_rayservice_status, review_token


class FakeAuthApi:
    def __init__(self, tokens: dict[str, str]):
        self.tokens = tokens
        self.reviews = []

    def create_token_review(self, body):
        self.reviews.append(body)
        user = self.tokens.get(body.spec.token)
        return SimpleNamespace(status=SimpleNamespace(authenticated=user is not None, user=SimpleNamespace(username=user), error=None if user else "invalid"))


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
    monkeypatch.setattr("rollout.kube.review_token", lambda token, audiences=None, api_=None: review_token(token, api=api))
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
