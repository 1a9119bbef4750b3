"""schemathesis against the ingress's published OpenAPI schema, with the API key: every
generated request, valid or not, gets an answer the schema documents (status, content
type, body) and never a 5xx; every request the schema calls invalid is refused. The token API and the health route; the weight-sync and
vLLM RL routes change the served weights and have tests of their own."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import API_KEY

pytestmark = pytest.mark.e2e

ROUTES = r"^/(v1/rollouts(/stream)?|healthz)$"
EXAMPLES = 12  # per operation and mode (the suite runs in 25 minutes; `make soak` and a longer fuzz go further)


def test_every_answer_is_one_the_schema_documents(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json").include(path_regex=ROUTES)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == {"/v1/rollouts", "/v1/rollouts/stream", "/healthz"}
    # Positive: bodies the schema calls valid. Negative: bodies it calls invalid, which must
    # be refused with a documented 4xx (schemathesis's negative_data_rejection).
    # (GET /healthz takes no input: nothing to make invalid.)
    runs = [(op, GenerationMode.POSITIVE) for op in operations] + [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST"]
    for operation, mode in runs:

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
        def answers_as_documented(case):
            # Not checked: that every schema-valid body is accepted. Limits of the served
            # model (context length, vocabulary, limits.max_n) are checked against the live
            # engine and answered with a 400 naming the field, which the schema documents.
            case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120, excluded_checks=[positive_data_acceptance])

        answers_as_documented()
