"""schemathesis against the ingress's published OpenAPI schema, with the API key: every
generated request, valid or not, gets an answer the schema documents (status, content
type, body) and never a 5xx; every request the schema calls invalid is refused.

The token API (episodes included) and the health route get both kinds. The weight-sync and vLLM RL routes
change the served weights, so they get what cannot change them: bodies and parameters the
schema calls invalid on every one, and valid calls on the read-only ones; after that, the
platform must be exactly where it was (their valid calls have tests of their own)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import API_KEY, SYNC_TOKEN

pytestmark = pytest.mark.e2e

ROUTES = r"^/(v1/rollouts(/stream)?|v1/episodes(/.*)?|healthz)$"
RL_ROUTES = ("pause", "resume", "is_paused", "reset_prefix_cache", "get_world_size", "init_weight_transfer_engine", "shutdown_weight_transfer_engine",
             "start_weight_update", "update_weights", "finish_weight_update", "weight_info", "update_weight_version", "collective_rpc", "weight_checker",
             "v1/load_lora_adapter", "v1/unload_lora_adapter")
SYNC_ROUTES = rf"^/(v1/sync/.+|{'|'.join(RL_ROUTES)})$"
# Valid calls to these change nothing (the last two are refused for everyone).
READ_ONLY = {"/v1/sync/status", "/is_paused", "/get_world_size", "/weight_info", "/collective_rpc", "/weight_checker"}
HEADERS = {"Authorization": f"Bearer {API_KEY}", "X-Rollout-Sync-Token": SYNC_TOKEN}
EXAMPLES = 12  # per operation and mode (the suite runs in 25 minutes; `make soak` and a longer fuzz go further)


def test_every_answer_is_one_the_schema_documents(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json").include(path_regex=ROUTES)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == {"/v1/rollouts", "/v1/rollouts/stream", "/v1/episodes", "/v1/episodes/{episode_id}/turns", "/v1/episodes/{episode_id}", "/healthz"}
    # Positive: bodies the schema calls valid. Negative: bodies it calls invalid, which must
    # be refused with a documented 4xx (schemathesis's negative_data_rejection).
    # (GET /healthz takes no input: nothing to make invalid.)
    runs = [(op, GenerationMode.POSITIVE) for op in operations] + [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST"]
    fuzz(runs)


def test_sync_routes_refuse_every_invalid_call_as_documented_and_change_nothing(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json").include(path_regex=SYNC_ROUTES)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path.lstrip("/") for op in operations} >= set(RL_ROUTES) | {"v1/sync/rounds", "v1/sync/status"}
    before = state(base_url)
    has_input = [op for op in operations if op.body or op.query or op.path_parameters]
    fuzz([(op, GenerationMode.POSITIVE) for op in operations if op.path in READ_ONLY] + [(op, GenerationMode.NEGATIVE) for op in has_input])
    assert state(base_url) == before, "an invalid call changed the platform"


def state(base_url: str) -> dict:
    """What a sync call could change: the committed version, the replicas' versions, the pause, the adapters."""
    with httpx.Client(base_url=base_url, headers=HEADERS, timeout=30) as c:
        status = c.get("/v1/sync/status").json()
        return {
            "committed": status["committed_version"],
            "replicas": sorted(r["version"] for r in status["replicas"].values()),
            "paused": c.get("/is_paused").json()["is_paused"],
            "served": c.get("/weight_info").json()["weight_version"],
            "adapters": status["adapters"],
        }


def fuzz(runs) -> None:
    for operation, mode in runs:

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
        def answers_as_documented(case):
            # Not checked: that every schema-valid body is accepted. Limits of the served
            # model (context length, vocabulary, limits.max_n) are checked against the live
            # engine and answered with a 400 naming the field, which the schema documents.
            case.call_and_validate(headers=HEADERS, timeout=120, excluded_checks=[positive_data_acceptance])

        answers_as_documented()
