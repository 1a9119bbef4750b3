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
    ],
)
def test_each_answer_maps_to_its_typed_error(status, body, headers, error):
    with pytest.raises(error) as exc:
        raise_for_error(answer(status, body, headers))
    if error is OverloadedError:
        assert exc.value.retry_after_s == 2.0
    if status == 418:
        assert not isinstance(exc.value, EngineUnavailableError)
