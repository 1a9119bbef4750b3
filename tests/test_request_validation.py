"""Request validation, fuzzed with hypothesis: whatever a caller sends, validation either
accepts it or names the field at fault, and it accepts exactly what the published JSON
schema (the ingress's OpenAPI) calls valid, so the schema tells generated clients the truth."""

from __future__ import annotations

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollout.api import RolloutRequest
from rollout.errors import from_validation_error

FIELDS = ["prompt_token_ids", "prompt", "messages", "sampling", "n", "request_id", "session_id", "min_weight_version", "unknown_field"]
SAMPLING = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs", "ignore_eos", "unknown_field"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**64), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5))
anything = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(SAMPLING + ["role", "content"]), inner, max_size=4)), max_leaves=10
)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]), "content": st.text(max_size=4)})
# Mostly near-valid values per field (so the interesting boundaries are hit), anything else too.
by_field = {
    "prompt_token_ids": st.one_of(anything, st.lists(st.integers(-2, 10**6), max_size=4)),
    "prompt": st.one_of(anything, st.text(max_size=6)),
    "messages": st.one_of(anything, st.lists(message, max_size=3)),
    "sampling": st.one_of(anything, st.dictionaries(st.sampled_from(SAMPLING), scalars, max_size=4)),
    "n": st.one_of(anything, st.integers(-1, 100)),
}
requests = st.fixed_dictionaries({}, optional={f: by_field.get(f, anything) for f in FIELDS})
SCHEMA = jsonschema.Draft202012Validator(RolloutRequest.model_json_schema())


def test_the_schema_uses_only_json_schema_keywords_for_bounds():
    # pydantic writes "ge"/"le" (which JSON Schema ignores) for bounds it cannot place.
    def keys(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    assert not {"ge", "le", "gt", "lt"} & set(keys(RolloutRequest.model_json_schema()))


@settings(max_examples=400, suppress_health_check=list(HealthCheck), deadline=None, derandomize=True)
@given(requests)
def test_validation_accepts_exactly_what_the_schema_calls_valid_and_otherwise_names_the_field(body):
    try:
        RolloutRequest.model_validate(body)
        accepted = True
    except ValidationError as e:
        accepted = False
        error = from_validation_error(e, "requests[0]")
        assert error.field.startswith("requests[0]") and error.message
    assert accepted == SCHEMA.is_valid(body), f"validation {'accepts' if accepted else 'refuses'} what the schema {'refuses' if accepted else 'accepts'}: {body}"
