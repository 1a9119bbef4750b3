"""The weight-sync routes' published schema says what their validation enforces: every
body (and query) the schema calls valid passes the route's own checks, except for what
depends on the platform's state (the served model's parameters, the committed version,
a round in progress) or what JSON Schema cannot say (equal list lengths), and what it
calls invalid is refused. No platform: the schema comes from the ingress's app, the
checks are the routes' models and the coordinator's static rules."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from pydantic import ValidationError
from schemathesis.generation.modes import GenerationMode

from rollout.errors import InvalidRequestError


@pytest.fixture(scope="module")
def schema():
    from rollout.http.ingress import app

    return schemathesis.openapi.from_dict(app.openapi())


def examples(operation, mode: GenerationMode, check, n: int = 150) -> None:
    @given(case=operation.as_strategy(mode))
    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def run(case):
        check(case)

    run()


def test_every_begin_round_body_the_schema_allows_passes_the_static_checks(schema):
    from rollout.sync.remote import BeginRoundBody

    def check(case):
        body = BeginRoundBody.model_validate(case.body)
        request = body.request()
        # The coordinator's checks that need no state (begin_round).
        assert request.checkpoint is None or os.path.isabs(request.checkpoint)

    examples(schema["/v1/sync/rounds"]["POST"], GenerationMode.POSITIVE, check)


def test_every_begin_round_body_the_schema_refuses_is_refused(schema):
    from rollout.sync.remote import BeginRoundBody

    def check(case):
        with pytest.raises(ValidationError):
            BeginRoundBody.model_validate(case.body)

    examples(schema["/v1/sync/rounds"]["POST"], GenerationMode.NEGATIVE, check)


@pytest.mark.parametrize(
    "transfer_info, field",
    [
        ({"backend": "gloo_delta", "delta_base_version": 0, "delta_base_digest": "0" * 64, "delta_counts": [-2]}, "transfer_info.delta_counts[0]"),
        ({"backend": "gloo_delta", "delta_base_version": 0, "delta_base_digest": "0" * 63, "delta_counts": [1]}, "transfer_info.delta_base_digest"),
        ({"backend": "sparse_nccl", "num_updates_list": [2**31]}, "transfer_info.num_updates_list[0]"),
        ({"backend": "sparse_nccl", "num_updates_list": [-1, -2], "base_version": 3}, "transfer_info.num_updates_list[1]"),
        ({"backend": "sparse_nccl", "num_updates_list": [1], "extra": 1}, "transfer_info.extra"),
        ({"backend": "ipc", "ipc_handles_pickled": "gASV"}, "transfer_info.backend"),
        ({"num_updates_list": [1]}, "transfer_info.backend"),
    ],
)
def test_a_delta_offer_the_schema_refuses_is_refused_naming_the_field_it_came_in(transfer_info, field):
    # Not the union's tag (pydantic's location says transfer_info.gloo_delta.delta_counts[0]).
    from rollout.sync.remote import BeginRoundBody

    body = {"params": [{"name": "w", "dtype": "float32", "shape": [2]}], "master_address": "127.0.0.1", "master_port": 1, "transfer_info": transfer_info}
    with pytest.raises(ValidationError) as e:
        BeginRoundBody.model_validate(body)
    assert e.value.errors()[0]["ctx"]["error"].field == field


def test_every_update_info_the_schema_allows_is_accepted_when_its_lists_line_up(schema):
    from rollout.http.rl_routes import UpdateInfo
    from rollout.sync.sessions import _with_announced, parse_update_info

    announced = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}

    def check(case):
        info = case.body["update_info"]
        if len({len(info.get(k, [])) for k in ("names", "dtype_names", "shapes")}) != 1:
            # What JSON Schema cannot say: refused, naming the field (a list left empty
            # beside others that are not: that one, as required).
            with pytest.raises(ValidationError, match=r"update_info(: names, dtype_names and shapes must have the same length|\.\w+: required, a non-empty list)"):
                UpdateInfo.model_validate(info)
            return
        # All three empty: the session's last announced parameters (vLLM 0.33's trainer engine).
        parse_update_info(_with_announced(UpdateInfo.model_validate(info).model_dump(mode="json"), announced))

    examples(schema["/update_weights"]["POST"], GenerationMode.POSITIVE, check)


def test_every_update_info_the_schema_refuses_is_refused(schema):
    from rollout.http.rl_routes import UpdateInfo

    def check(case):
        body = case.body
        assume(isinstance(body, dict) and set(body) == {"update_info"})  # (a body without it FastAPI refuses itself)
        with pytest.raises((ValidationError, InvalidRequestError)):
            UpdateInfo.model_validate(body["update_info"])

    examples(schema["/update_weights"]["POST"], GenerationMode.NEGATIVE, check)


def test_pickled_handles_are_refused_by_the_schema_and_by_the_model(schema):
    from rollout.http.rl_routes import UpdateInfo

    names = schema.raw_schema["components"]["schemas"]["UpdateInfo"]["propertyNames"]
    assert names["not"]["anyOf"][0]["pattern"]
    with pytest.raises(ValidationError, match="update_info.ipc_handles_pickled: pickled data is not accepted"):
        UpdateInfo.model_validate({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "ipc_handles_pickled": "gASV"})


def test_reset_prefix_cache_offers_only_what_it_does(schema):
    def check(case):
        assert all(v in ("false", False) for v in (case.query or {}).values()), case.query

    examples(schema["/reset_prefix_cache"]["POST"], GenerationMode.POSITIVE, check, n=20)
