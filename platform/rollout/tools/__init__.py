"""Tools an episode's model may call, run off the engine's event loop.

A tool is a Python function: its signature gives the JSON schema the chat template and
the tool-call parser see, its docstring the description. The platform has two built in
(:mod:`rollout.tools.builtins`: ``python``, sandboxed, and ``calculator``); operators
register more under ``tools.functions`` (``name: module:function``), imported when a
replica starts so a bad path fails the start. An episode names the tools it offers
(``EpisodeStart.tools``); a request never names an import path.

Calls are parsed out of the model's text with vLLM's parser for the model's format
(:mod:`rollout.tools.calling`, ``openai.tool_call_parser``) and run on a pool of Ray actors
(:mod:`rollout.tools.pool`); their output goes back into the episode as tool-role tokens.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pydantic import ConfigDict, ValidationError, create_model

from rollout.errors import InvalidRequestError
from rollout.rewards import import_function

BUILTIN_PATHS = {
    "python": "rollout.tools.builtins:python",
    "calculator": "rollout.tools.calculator:calculator",
}


@functools.lru_cache(maxsize=None)
def arguments_model(fn: Callable[..., Any]):
    """A pydantic model of ``fn``'s parameters: validates a call's arguments and gives the
    JSON schema. Parameters without an annotation take any JSON value. Built once per
    function: a worker validates every call with it."""
    fields = {}
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = Any if p.annotation is inspect.Parameter.empty else p.annotation
        fields[name] = (annotation, ... if p.default is inspect.Parameter.empty else p.default)
    return create_model(f"{fn.__name__}_arguments", __config__=ConfigDict(extra="forbid"), **fields)


@dataclass(frozen=True)
class Tool:
    name: str
    path: str  # module:function, imported by the tool workers
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments

    @classmethod
    def load(cls, name: str, path: str) -> "Tool":
        """Raises ValueError naming ``tools.functions.<name>`` when it cannot be a tool."""
        try:
            fn = import_function(path)
            schema = arguments_model(fn).model_json_schema()
        except (ValueError, TypeError) as e:  # no importable function, no readable signature, no schema
            raise ValueError(f"tools.functions.{name}: {path}: {e}") from None
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        return cls(name, path, inspect.getdoc(fn) or "", schema)

    def openai(self) -> dict[str, Any]:
        """As the OpenAI ``tools`` entry chat templates and vLLM's parsers take. Strict: the
        signature is the whole truth about the arguments, so a forced call (``required`` or
        named) is constrained to their schema, not to any JSON."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters, "strict": True}}


def call_tool(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """``fn(**arguments)`` after checking them against its signature; a ValueError names
    the argument that is wrong."""
    try:
        checked = arguments_model(fn).model_validate(arguments)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"argument {'.'.join(map(str, err['loc'])) or '(all)'}: {err['msg']}") from None
    return fn(**{k: getattr(checked, k) for k in checked.model_fields})


class ToolRegistry:
    """The tools of one platform: the built-ins and ``tools.functions``."""

    def __init__(self, functions: dict[str, str], python: bool = True):
        builtins = {k: v for k, v in BUILTIN_PATHS.items() if python or k != "python"}  # tools.python.enabled
        self.tools = {name: Tool.load(name, path) for name, path in {**builtins, **functions}.items()}

    def offered(self, names: Sequence[str]) -> list[Tool]:
        """The tools an episode names; InvalidRequestError names ``tools[i]`` when unknown."""
        out = []
        for i, name in enumerate(names):
            if name not in self.tools:
                raise InvalidRequestError(f"tools[{i}]", f"unknown tool {name!r}; this platform has {', '.join(sorted(self.tools))} (register more under tools.functions)")
            out.append(self.tools[name])
        return out
