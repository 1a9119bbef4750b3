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
