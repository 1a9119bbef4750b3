"""CI's soak: `rollout soak`'s load, back-to-back publishes and a fault every 20 seconds for
two minutes, on the session's platform (set to the soak's deployment settings, which Serve
applies in place; the scaling tests after it replace the app). Its report's checks are the
acceptance: nothing hung or lost, every failure a typed retryable error, no uncommitted
version served, each fault recovered from within its bound, memory growth bounded.
`make soak` runs the same for ten minutes on a platform of its own."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.app import deploy
from rollout.soak import FAULTS, SOAK_DEPLOYMENT, SoakRun, full_strength, soak
from tests.conftest import API_KEY, SYNC_TOKEN, wait_until

pytestmark = pytest.mark.e2e

DURATION_S = 120
FAULT_PERIOD_S = 20  # six faults: each kind once


async def test_a_two_minute_soak_passes_every_check(platform, model_dir):
    cfg = platform.model_copy(update={"deployment": platform.deployment.model_copy(update=SOAK_DEPLOYMENT)})
    await asyncio.to_thread(deploy, cfg)
    await wait_until(lambda: asyncio.to_thread(full_strength, cfg.app_name, cfg.deployment.replicas), timeout_s=300, interval_s=1)
    report = await soak(SoakRun(cfg, model_dir, API_KEY, SYNC_TOKEN, duration_s=DURATION_S, fault_period_s=FAULT_PERIOD_S))
    summary = json.dumps({k: report[k] for k in ("checks", "calls", "untyped_failures", "publishes", "faults", "uncommitted_versions_seen", "memory_by_role")}, indent=1)
    print(summary)
    assert report["passed"], summary
    assert report["hung"] == report["lost"] == 0 and not report["uncommitted_versions_seen"]
    assert [f["fault"] for f in report["faults"]] == list(FAULTS), "each kind of fault once"
    assert report["calls"]["overfill"].get("OverloadedError (429)", 0) > 0, "the overfill was refused in part"
