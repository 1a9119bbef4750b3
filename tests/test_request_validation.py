"""Request validation, fuzzed with hypothesis: whatever a caller sends, validation either
accepts it or names the field at fault, and it accepts exactly what the published JSON
schema (the ingress's OpenAPI) calls valid, so the schema tells generated clients the truth."""

from __future__ import annotations

import jsonschema
import pytest
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


# ---- every integer a route hands the engine is bounded, and above the bound is a 400 -----

# Each route of the token API that takes sampling (or other integers the engine gets), with
# the smallest body it accepts.
ROUTES = {
    "/v1/rollouts": {"requests": [{"prompt": "x"}]},
    "/v1/rollouts/stream": {"prompt": "x"},
    "/v1/episodes": {"messages": [{"role": "user", "content": "x"}]},
    "/v1/episodes/r.e/turns": {},
}
# What schemathesis sent to an episode's turn (vLLM failed it with EngineGenerateError, a 500).
FUZZED_TOP_K = 133751737642897915904


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def integer_fields(schema: dict, node: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    """(path, schema) of every integer a body may hold, through objects, arrays (index 0)
    and the alternatives of optional fields."""
    node = _resolve(schema, node)
    if node.get("type") == "integer":
        return [(path, node)]
    out = []
    for alternative in node.get("anyOf", []) + node.get("oneOf", []):
        out += integer_fields(schema, alternative, path)
    for name, sub in node.get("properties", {}).items():
        out += integer_fields(schema, sub, path + (name,))
    if node.get("type") == "array" and "items" in node:
        out += integer_fields(schema, node["items"], path + (0,))
    return out


def _with(body: dict, path: tuple, value: object) -> dict:
    import copy

    from rollout.api import PROMPT_FORMS

    body = copy.deepcopy(body)
    node = body
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, dict) and part in PROMPT_FORMS:
            for other in PROMPT_FORMS:  # exactly one prompt form: this one
                node.pop(other, None)
        if isinstance(part, int):
            while len(node) <= part:
                node.append(None)
            if last:
                node[part] = value
            elif node[part] is None:
                node[part] = [] if isinstance(path[i + 1], int) else {}
        else:
            if last:
                node[part] = value
            else:
                node.setdefault(part, [] if isinstance(path[i + 1], int) else {})
        node = node[part]
    return body


def _field(path: tuple) -> str:
    from rollout.errors import loc_to_field

    return loc_to_field(path)


@pytest.fixture(scope="module")
def ingress():
    """The ingress's app in this process: its validation and error answers, no engine (a
    body that validates reaches a route with no replica behind it, which nothing here sends)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient
    from ray import serve

    from rollout.config import load_config
    from rollout.http.ingress import app
    from rollout.sync.auth import AccessPolicy, SyncAuth

    config = load_config({"model": {"path": "/models/x"}}, environ={})
    app.state.auth = AccessPolicy("key", SyncAuth.of(config.sync))
    app.state.max_body_bytes = 1 << 20
    patch = pytest.MonkeyPatch()
    # Serve hands each route its deployment instance; validation refuses before it is used.
    patch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=None))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            client.headers["Authorization"] = "Bearer key"
            yield client, app.openapi()
    finally:
        patch.undo()


def route_integers(schema: dict) -> list[tuple[str, tuple, dict]]:
    out = []
    for route in ROUTES:
        template = "/v1/episodes/{episode_id}/turns" if route.endswith("/turns") else route
        body = schema["paths"][template]["post"]["requestBody"]["content"]["application/json"]["schema"]
        out += [(route, path, node) for path, node in integer_fields(schema, body)]
    return out


def test_every_integer_a_sampling_route_takes_has_an_upper_bound_the_engine_accepts(ingress):
    from rollout.api import ENGINE_INT_MAX, MAX_VERSION

    _, schema = ingress
    fields = route_integers(schema)
    named = {(route, _field(path)) for route, path, _ in fields}
    # The walk reaches the fields the issue named (else it would pass by finding nothing).
    for route, field in [
        ("/v1/rollouts", "requests[0].sampling.top_k"),
        ("/v1/rollouts", "requests[0].n"),
        ("/v1/rollouts/stream", "sampling.max_tokens"),
        ("/v1/rollouts/stream", "prompt_token_ids[0]"),
        ("/v1/episodes/r.e/turns", "sampling.seed"),
        ("/v1/episodes/r.e/turns", "sampling.stop_token_ids[0]"),
        ("/v1/episodes", "max_tokens"),
    ]:
        assert (route, field) in named, f"{route} {field} not found in the schema: {sorted(named)}"
    unbounded = [(route, _field(path)) for route, path, node in fields if "maximum" not in node]
    assert not unbounded, f"integers with no upper bound in the schema: {unbounded}"
    # The seed is vLLM's 64-bit generator seed (FastAPI's OpenAPI model writes bounds as
    # floats: 2**63 - 1 reads as float(2**63 - 1)), and a version never reaches the engine;
    # every other integer is at most int32's.
    wider = {"seed": float(2**63 - 1), "min_weight_version": MAX_VERSION}
    too_large = [(route, _field(path), node["maximum"]) for route, path, node in fields if node["maximum"] > wider.get(path[-1], ENGINE_INT_MAX)]
    assert not too_large, too_large


def test_an_integer_above_its_bound_on_every_sampling_route_is_a_400_naming_the_field(ingress):
    client, schema = ingress
    for route, path, node in route_integers(schema):
        for value in (int(node["maximum"]) + 1, FUZZED_TOP_K):
            r = client.post(route, json=_with(ROUTES[route], path, value))
            assert r.status_code == 400, (route, path, value, r.status_code, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["field"] == _field(path), (route, path, error)
        # The bound itself is accepted by validation: the route then needs its replica,
        # which this app has none of (so any answer but a 400).
        if path[-1] not in ("max_turns", "max_tool_calls", "max_tokens") or route != "/v1/episodes":
            r = client.post(route, json=_with(ROUTES[route], path, int(node["maximum"]) if path[-1] != "seed" else 2**63 - 1))
            assert r.status_code != 400, (route, path, r.text)
