"""The ingress's last-resort error answer: an exception no handler knows becomes a 500 in
the error body every other answer uses, and its traceback is logged once.

Every failure the platform expects has a handler and a 4xx or 503 (``rollout.http.ingress``);
what reaches this is a bug. Starlette's own fallback answers plain text (which the schema
does not document and clients cannot parse as an error) and re-raises, so the server logs
the traceback again; this middleware answers and stops there.

Pure ASGI, outside every other middleware, so a fault in one of them is caught too.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

from rollout import wire_errors as wire

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]



def internal_error_body(exc: BaseException) -> bytes:
    # The exception's text can hold internals (paths, other requests' data): the log has it,
    # the caller gets its type only.
    message = f"internal error ({type(exc).__name__}); the ingress's log has the traceback"
    return json.dumps(wire.body(wire.INTERNAL, message)).encode()


class LastResort:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                # Part of the answer (a stream) is out: it cannot become an error body. The
                # server aborts the connection, so the caller sees a broken stream rather than
                # a short one, and logs the traceback itself.
                raise
            logger.exception("%s %s failed with an unhandled %s; answering 500", scope.get("method"), scope.get("path"), type(exc).__name__)
            body = internal_error_body(exc)
            await send({"type": "http.response.start", "status": wire.INTERNAL.status, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
