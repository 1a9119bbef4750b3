"""vLLM's own OpenAI server (the app behind ``vllm serve``), bound to a replica's engine.

Each replica builds vLLM's FastAPI app with ``build_app`` and ``init_app_state`` against
its own ``AsyncLLM`` (as Ray Serve LLM does) and answers the OpenAI routes through it,
in-process over ASGI: every field, parser, error and stream format is vLLM's. The ingress
forwards the HTTP request (:class:`ForwardedRequest`) to the replica the router picks.

The app's arguments are ``vllm serve``'s: :func:`serve_argv` builds the command line
(engine arguments from the model config, the OpenAI options by their vLLM names), so a
reference ``vllm serve`` started with the same line behaves the same.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, ContextManager, Optional

from rollout.config import ModelConfig, OpenAIConfig


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


class SaltedEngine:
    """The replica's ``AsyncLLM`` as vLLM's OpenAI app is given it: the engine itself,
    except that each request its ``generate`` adds carries the replica's prefix-cache salt
    (:mod:`rollout.sync.salt`), a caller's ``cache_salt`` folded in rather than replaced.

    The salt is taken as the app's request reaches the engine, not when the HTTP request
    reaches the replica: the app renders it meanwhile, and an update may begin then.
    """

    def __init__(self, engine: Any, salted: Callable[[Optional[str]], ContextManager[Optional[str]]]):
        self._engine = engine
        self._salted = salted  # SyncGate.salted

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if not isinstance(prompt, dict):
            # A streaming input (realtime audio) has no salt of its own to carry: as it is.
            async with contextlib.aclosing(self._engine.generate(prompt, *args, **kwargs)) as outputs:
                async for out in outputs:
                    yield out
            return
        # The app hands vLLM rendered inputs, which it adds without an await: the salt
        # is taken in the step that adds the request.
        with self._salted(prompt.get("cache_salt")) as salt:
            if salt is not None:
                prompt = {**prompt, "cache_salt": salt}
            # Closed with this generator: closing vLLM's aborts the request in the engine.
            async with contextlib.aclosing(self._engine.generate(prompt, *args, **kwargs)) as outputs:
                async for out in outputs:
                    yield out


# vLLM engine flags that default to on: turning them off takes ``--no-<flag>``.
DEFAULT_ON = {"enable_prefix_caching"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def serve_argv(model: ModelConfig, openai: OpenAIConfig, engine_kwargs: dict[str, Any]) -> list[str]:
    """``vllm serve``'s arguments for this model (without the leading ``serve``)."""
    argv = [engine_kwargs["model"]]
    for key, value in engine_kwargs.items():
        if key == "model" or value is None:
            continue
        if isinstance(value, bool):
            # Flags off by default in vLLM are left out when off; prefix caching is on by default.
            if value or key in DEFAULT_ON:
                argv.append(_flag(key) if value else _flag(f"no_{key}"))
        else:
            argv += [_flag(key), str(value)]
    for key, value in openai.model_dump().items():
        if value is None or value is False:
            continue
        argv += [_flag(key)] if value is True else [_flag(key), str(value)]
    return argv


def parse_serve_args(argv: list[str]):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rollout.vllm_compat import serve_arg_parsing

    make_arg_parser, validate_parsed_serve_args = serve_arg_parsing()
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(["--model", *argv[:1], *argv[1:]]) if argv else parser.parse_args([])
    validate_parsed_serve_args(args)
    return args


async def build_openai_app(engine, argv: list[str]):
    """vLLM's OpenAI app over ``engine`` (its lifespan is not run: the engine is ours)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    args = parse_serve_args(argv)
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    return app


async def call_asgi(app, request: ForwardedRequest) -> AsyncIterator[Any]:
    """Run ``request`` through ``app``: first ``{"status", "headers"}``, then body chunks.

    Closing the iterator (the client went away) tells the app the client disconnected,
    which makes vLLM abort the request in the engine.
    """
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()


async def forward(app, request: ForwardedRequest, version_label: Callable[[], str], replica_id: str) -> AsyncIterator[Any]:
    """``request`` through ``app`` as a replica answers it: ``{"status", "headers"}``, then
    the body's chunks.

    ``X-Rollout-Weight-Version`` names the version ``version_label()`` gives when the
    response starts; a non-streaming response that spans a weight update says
    ``<first>-<last>`` (it is held whole, so its headers can still say so).
    ``X-Rollout-Replica`` names the replica.
    """
    first = version_label()
    # Closed as soon as this is: the app learns at once that the client left.
    async with contextlib.aclosing(call_asgi(app, request)) as parts:
        start = await parts.__anext__()
        streaming = any(k.lower() == "content-type" and "event-stream" in v for k, v in start["headers"])
        if streaming:
            yield _with_version(start, first, replica_id)
            async for chunk in parts:
                yield chunk
            return
        body = [chunk async for chunk in parts]
    last = version_label()
    yield _with_version(start, first if first == last else f"{first}-{last}", replica_id)
    yield b"".join(body)


def _with_version(start: dict, version: str, replica_id: str) -> dict:
    # Left to the ingress, which streams the body on and frames it itself.
    headers = [(k, v) for k, v in start["headers"] if k.lower() != "content-length"]
    return {"status": start["status"], "headers": headers + [("x-rollout-weight-version", version), ("x-rollout-replica", replica_id)]}


def requested_model(body: bytes) -> Optional[str]:
    """The ``model`` a request's JSON body names (the served model or a LoRA adapter's
    name), or None: no body, not JSON, or no such field (vLLM answers those itself)."""
    import json

    try:
        payload = json.loads(body) if body else None
    except ValueError:
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else None


def routing_hint(path: str, body: bytes, session_id: Optional[str]) -> tuple[dict, bool]:
    """What the affinity router keys on (the session header, else the prompt's prefix), and
    whether the answer streams (the body asks ``"stream": true``): parsed once, here."""
    import json

    hint: dict[str, Any] = {"session_id": session_id}
    try:
        payload = json.loads(body) if body else {}
    except ValueError:
        return hint, False
    if not isinstance(payload, dict):
        return hint, False
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        hint["prompt_token_ids"] = prompt
    elif isinstance(prompt, str):
        hint["prompt"] = prompt
    elif isinstance(payload.get("messages"), list):
        hint["messages"] = payload["messages"]
    elif isinstance(payload.get("token_ids"), list):
        hint["prompt_token_ids"] = payload["token_ids"]
    # vLLM's app decides how it answers; a body it refuses (stream not a bool) gets its
    # error either way, and an error is never a stream.
    return hint, payload.get("stream") is True
