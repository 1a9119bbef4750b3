"""The ingress's FastAPI app, shared by the modules that add routes to it."""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from rollout.http.body_limit import BodyLimit

app = FastAPI(title="Rollout Platform", version="1")
app.add_middleware(BodyLimit)


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
                        "description": "Invalid request: `error.field` names the field.",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                    }
        components = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]
