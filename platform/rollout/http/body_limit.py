"""Refuse request bodies above ``http.max_body_bytes`` with 413, before they are parsed.

Pure ASGI, so a body sent without ``Content-Length`` (chunked) is counted as it arrives
and refused once it passes the limit, without ever being held whole in memory.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Optional

from rollout import wire_errors as wire

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _limit(scope: Scope) -> Optional[int]:
    # The ingress replica sets it on the app's state at start-up (config: http.max_body_bytes).
    app = scope.get("app")
    return getattr(getattr(app, "state", None), "max_body_bytes", None)


async def _refuse(send: Send, limit: int) -> None:
    body = json.dumps(wire.body(wire.TOO_LARGE, f"body: request body larger than http.max_body_bytes = {limit} bytes", "body")).encode()
    await send({"type": "http.response.start", "status": wire.TOO_LARGE.status, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = _limit(scope) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, limit)
            return
        received = 0
        refused = False

        async def counted() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    await _refuse(send, limit)
                    # The route sees the client gone and stops; nothing of it is answered.
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, guarded)
