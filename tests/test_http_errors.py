"""The HTTP client's error mapping: every answer of the serving path becomes a typed error
(retryable where retrying can help), without a live ingress."""

from __future__ import annotations

import httpx
import pytest

from rollout.client.http import raise_for_error
from rollout.errors import EngineUnavailableError, InvalidRequestError, OverloadedError, RolloutError, StaleWeightsError


def answer(status: int, body: dict | str, headers: dict | None = None) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else None
    return httpx.Response(status, json=None if content else body, content=content, headers=headers)


@pytest.mark.parametrize(
    "status,body,headers,error",
    [
        (400, {"error": {"field": "requests[0].n", "message": "too many"}}, None, InvalidRequestError),
        (409, {"error": {"type": "stale_weights", "message": "version 3 did not arrive"}}, None, StaleWeightsError),
        (429, {"error": {"type": "overloaded", "message": "full"}}, {"retry-after": "2"}, OverloadedError),
        (503, {"error": {"message": "no replica"}}, None, EngineUnavailableError),
        # Serve's proxy when the ingress replica dies mid-request: plain text, 500.
        (500, "Internal Server Error", None, EngineUnavailableError),
        (418, {"error": {"message": "teapot"}}, None, RolloutError),
        # The ingress's own fault (its last-resort answer): the same call fails again, so not retryable.
        (500, {"error": {"type": "internal_error", "message": "internal error (KeyError)"}}, None, RolloutError),
    ],
)
def test_each_answer_maps_to_its_typed_error(status, body, headers, error):
    with pytest.raises(error) as exc:
        raise_for_error(answer(status, body, headers))
    if error is OverloadedError:
        assert exc.value.retry_after_s == 2.0
    internal = isinstance(body, dict) and body["error"].get("type") == "internal_error"
    if status == 418 or internal:
        assert not isinstance(exc.value, EngineUnavailableError)


def last_resort_app():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from rollout.http.last_resort import LastResort

    app = FastAPI()
    app.add_middleware(LastResort)

    @app.get("/bug")
    async def bug():
        return {}["missing"]

    @app.get("/stream")
    async def stream():
        async def parts():
            yield b"{}\n"
            raise RuntimeError("broke mid-stream")

        return StreamingResponse(parts(), media_type="application/x-ndjson")

    return app


def test_an_unhandled_exception_is_a_500_in_the_error_body_every_answer_uses_logged_once(caplog):
    from fastapi.testclient import TestClient

    from rollout.api import ErrorResponse

    with TestClient(last_resort_app(), raise_server_exceptions=True) as client, caplog.at_level("ERROR"):
        r = client.get("/bug")  # raise_server_exceptions: it would raise here had the exception left the app
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = ErrorResponse.model_validate(r.json()).error
    assert err.type == "internal_error" and "KeyError" in err.message and "missing" not in err.message, "the type, not the internals"
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "GET /bug" in tracebacks[0].getMessage()
    with pytest.raises(RolloutError) as exc:
        raise_for_error(r)
    assert not isinstance(exc.value, EngineUnavailableError)


def test_a_stream_that_breaks_after_it_started_is_not_turned_into_a_short_success():
    from fastapi.testclient import TestClient

    # The status and the first line are out: the connection must break, not end cleanly.
    with TestClient(last_resort_app(), raise_server_exceptions=True) as client:
        with pytest.raises(RuntimeError, match="broke mid-stream"):
            client.get("/stream")


# ---- the one table (rollout.wire_errors): the ingress answers from it, clients read it back

def platform_errors():
    from rollout.contracts.sync_protocol import CoordinatorUnreachableError, DeltaBaseError, FleetAsleepError, NoCommittedCopyError, SleepUnavailableError, SyncError
    from rollout.errors import AdapterNotFoundError, AuthenticationError, EpisodeLostError, ForbiddenError, NotServingError, ReplicaLostError

    # (raised by a route, status, error.type, what a client raises back)
    return [
        (InvalidRequestError("requests[0].n", "too many"), 400, "invalid_request_error", InvalidRequestError),
        (AuthenticationError("wrong API key"), 401, "authentication_error", AuthenticationError),
        (ForbiddenError("/collective_rpc is not served here"), 403, "forbidden", ForbiddenError),
        (EpisodeLostError("episode r1.x is not on this replica"), 404, "episode_lost", EpisodeLostError),
        (AdapterNotFoundError("The lora adapter 'math' cannot be found."), 404, "adapter_not_found", AdapterNotFoundError),
        # WeightPublisher.unload_adapter's: it names the field that held the name.
        (AdapterNotFoundError("'math' is not a published LoRA adapter (published: none)", field="name"), 404, "adapter_not_found", AdapterNotFoundError),
        (StaleWeightsError("version 3 did not arrive"), 409, "stale_weights", StaleWeightsError),
        (SyncError("round-1 aborted"), 409, "sync_error", SyncError),
        (NoCommittedCopyError("nothing holds version 2"), 409, "sync_error", SyncError),
        (CoordinatorUnreachableError("no answer"), 409, "sync_error", SyncError),
        # Its own type: a publisher over HTTP falls back to a full send on it, as over Serve.
        (DeltaBaseError("the delta applies onto version 2, the committed version is 3"), 409, "delta_base_error", DeltaBaseError),
        # The replicas sleep, and sleep mode is off: their own types, read back as such.
        (FleetAsleepError("a publish refused: the replicas are asleep at level 2 (kv_cache, weights asleep)"), 409, "fleet_asleep", FleetAsleepError),
        (SleepUnavailableError("sleep mode is not available on this platform: its replicas run on CPU"), 409, "sleep_unavailable", SleepUnavailableError),
        (OverloadedError("overloaded: full", 1.2), 429, "overloaded", OverloadedError),
        (EngineUnavailableError("no replica"), 503, "engine_unavailable", EngineUnavailableError),
        (ReplicaLostError("died", {0: [1]}), 503, "engine_unavailable", EngineUnavailableError),
        (NotServingError("holds no weights"), 503, "engine_unavailable", EngineUnavailableError),
    ]


@pytest.mark.parametrize("raised,status,kind,read_back", platform_errors(), ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None)
def test_the_ingress_answers_each_error_from_the_table_and_the_client_reads_the_same_type_back(raised, status, kind, read_back):
    import asyncio
    import json

    from rollout.http.ingress import app

    # The handler Starlette would pick: the one registered for the most specific class.
    handler = next(app.exception_handlers[cls] for cls in type(raised).__mro__ if cls in app.exception_handlers)
    response = asyncio.run(handler(None, raised))
    body = json.loads(response.body)
    assert response.status_code == status and body["error"]["type"] == kind and body["error"]["message"] == str(raised)
    assert body["error"].get("field") == getattr(raised, "field", None)
    with pytest.raises(read_back) as exc:
        raise_for_error(httpx.Response(status, content=response.body, headers=dict(response.headers)))
    assert str(exc.value) == str(raised) and getattr(exc.value, "field", None) == getattr(raised, "field", None)
    if isinstance(raised, OverloadedError):
        assert response.headers["retry-after"] == "2" and exc.value.retry_after_s == 2.0
    if isinstance(raised, InvalidRequestError):
        assert (exc.value.field, exc.value.message) == (raised.field, raised.message)


def test_every_error_the_schema_documents_is_described_by_the_table():
    from rollout import wire_errors
    from rollout.http.ingress import app

    described = {(row.status, row.description) for row in wire_errors.TABLE}
    documented = [
        (path, verb, int(status), answer["description"])
        for path, operations in app.openapi()["paths"].items()
        for verb, operation in operations.items()
        for status, answer in operation["responses"].items()
        if status.isdigit() and int(status) >= 400
    ]
    assert documented, "the schema documents errors"
    assert [d for d in documented if (d[2], d[3]) not in described] == []
    assert ("/v1/stats", "get", 401, wire_errors.UNAUTHENTICATED.description) in documented


def test_retryable_rows_are_the_engine_unavailable_family_and_an_unknown_409_stays_untyped():
    from rollout import wire_errors

    assert {row.type for row in wire_errors.TABLE if row.retryable} == {"stale_weights", "overloaded", "engine_unavailable"}
    assert all(issubclass(row.error, EngineUnavailableError) == row.retryable for row in wire_errors.TABLE)
    assert wire_errors.retryable(OverloadedError("full")) and not wire_errors.retryable(InvalidRequestError("x", "y"))
    # A 409 of a kind this client does not know is neither a sync error nor stale weights.
    with pytest.raises(RolloutError, match="HTTP 409: new kind") as exc:
        raise_for_error(answer(409, {"error": {"type": "something_new", "message": "new kind"}}))
    assert type(exc.value) is RolloutError
    with pytest.raises(ValueError, match="two documented answers with status 409"):
        wire_errors.responses(wire_errors.STALE_WEIGHTS, wire_errors.SYNC_FAILED)


def test_the_error_bodys_type_field_names_every_type_of_the_table():
    # api.py cannot import the table (the table imports api's ErrorResponse): its
    # description of `error.type` is written out, and this keeps it whole.
    from rollout import wire_errors as wire
    from rollout.api import ErrorDetail

    described = ErrorDetail.model_fields["type"].description
    missing = sorted({row.type for row in wire.TABLE} - {word.strip(",.()") for word in described.split()})
    assert not missing, f"ErrorDetail.type's description does not name {missing}"
