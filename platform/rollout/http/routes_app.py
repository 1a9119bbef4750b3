"""The ingress's FastAPI app, shared by the modules that add routes to it."""

from typing import Any, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.openapi.utils import get_openapi

from rollout import wire_errors as wire
from rollout.errors import AuthenticationError, InvalidRequestError
from rollout.http.body_limit import BodyLimit
from rollout.http.last_resort import LastResort
from rollout.sync.auth import AccessPolicy, Operation, Presented


async def refuse_undocumented_query(request: Request) -> None:
    """A query parameter a documented route does not take is refused, naming it: a trainer's
    misspelt ``clear_cach=false`` must not pause with the default instead. (The OpenAI
    routes, served by vLLM's own layer and kept out of the schema, ignore extras as it does.)

    ``async`` though it never awaits, as every dependency of a route is: FastAPI runs a
    plain ``def`` one in its thread pool, a thread hop on every request (measured: with the
    key check below, a tenth of the ingress's CPU at 256 requests in flight, issue 41)."""
    route = request.scope.get("route")
    if route is None or not getattr(route, "include_in_schema", False) or not request.query_params:
        return
    known = {p.alias for p in get_flat_dependant(route.dependant).query_params}
    for name in request.query_params:
        if name not in known:
            raise InvalidRequestError(name, f"unknown query parameter; {request.url.path} takes {', '.join(sorted(known)) or 'none'}")


def admit(operation: Operation, request: Request) -> Optional[str]:
    """The one credential check of every route (rollout.sync.auth decides): raises
    ``AuthenticationError``, or returns the credential to hand the coordinator."""
    # The ingress replica installs its policy on app.state at start-up.
    policy: Optional[AccessPolicy] = getattr(request.app.state, "auth", None)
    if policy is None:
        raise AuthenticationError("the ingress is not initialised")
    return policy.admit(operation, Presented.of(request.headers))


app = FastAPI(title="Rollout Platform", version="1", dependencies=[Depends(refuse_undocumented_query)])
app.add_middleware(BodyLimit)
app.add_middleware(LastResort)  # added last: outermost, so it also catches a fault of BodyLimit

# The error answers the schema documents (every one has an ErrorResponse body), from the
# one table the exception handlers answer from.
REQUEST_ERRORS = wire.responses(wire.INVALID, wire.UNAUTHENTICATED, wire.STALE_WEIGHTS, wire.TOO_LARGE, wire.OVERLOADED, wire.UNAVAILABLE)
EPISODE_ERRORS = {**REQUEST_ERRORS, **wire.responses(wire.EPISODE_LOST)}
SYNC_ERRORS = wire.responses(wire.INVALID, wire.UNAUTHENTICATED, wire.SYNC_FAILED, wire.TOO_LARGE, wire.OVERLOADED, wire.UNAVAILABLE)
STATS_ERRORS = wire.responses(wire.INVALID, wire.UNAUTHENTICATED, wire.OVERLOADED, wire.UNAVAILABLE)
HEALTH_ERRORS = wire.responses(wire.UNAVAILABLE)
REFUSED_ERRORS = wire.responses(wire.FORBIDDEN)


# An episode's id, from the answer that started or turned it, is what its later calls name:
# OpenAPI links say so, so a client generator (and a stateful fuzzer) can follow an episode
# from its start through its turns to its end.
EPISODE_ID = {"episode_id": "$response.body#/episode_id"}
EPISODE_LINKS = {
    ("/v1/episodes", "post"): {"TakeTurn": ("/v1/episodes/{episode_id}/turns", "post"), "Get": ("/v1/episodes/{episode_id}", "get"), "End": ("/v1/episodes/{episode_id}", "delete")},
    ("/v1/episodes/{episode_id}/turns", "post"): {"TakeNextTurn": ("/v1/episodes/{episode_id}/turns", "post"), "Get": ("/v1/episodes/{episode_id}", "get"), "End": ("/v1/episodes/{episode_id}", "delete")},
}


def _link_episode_lifecycle(schema: dict[str, Any]) -> None:
    paths = schema.get("paths", {})
    for (path, method), links in EPISODE_LINKS.items():
        ok = paths.get(path, {}).get(method, {}).get("responses", {}).get("200")
        if ok is None:
            continue
        ok["links"] = {
            name: {"operationId": paths[target][verb]["operationId"], "parameters": dict(EPISODE_ID)}
            for name, (target, verb) in links.items()
            if verb in paths.get(target, {})
        }


def _openapi() -> dict[str, Any]:
    """FastAPI's schema, made to say what the routes answer: schema violations get 400 (not
    FastAPI's default 422) with an ``ErrorResponse`` naming the field, and error bodies are
    JSON on every route."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                for status, response in responses.items():
                    # Errors are JSON even on a route whose success is a stream (FastAPI
                    # gives every answer the route's media type).
                    content = response.get("content", {})
                    if status.isdigit() and int(status) >= 400 and "application/json" not in content and content:
                        response["content"] = {"application/json": next(iter(content.values()))}
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {
                        "description": wire.INVALID.description,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                    }
        _link_episode_lifecycle(schema)
        components = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]
