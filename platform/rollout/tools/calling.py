"""Tool calls in the model's own format, through vLLM's parsers.

``openai.tool_call_parser`` names the format (``hermes``, ``llama3_json``, ...), the same
parser the OpenAI routes use. For a turn, :meth:`ToolCalling.plan` builds what vLLM's
chat server would for the same ``tools`` and ``tool_choice``: the parser adjusts the
request, and for ``required`` or a named tool that is a structural tag (vLLM's own,
per format) that makes the model write a call in its native format. After the turn,
:meth:`ToolCalling.parse` reads the calls back out of the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from rollout.tools import Tool

ToolChoiceValue = Union[str, dict]  # "auto" | "none" | "required" | {"name": ...}


@dataclass
class TurnPlan:
    request: Any  # vLLM's ChatCompletionRequest, adjusted by the parser
    parser: Any
    structured_outputs: Any  # vLLM StructuredOutputsParams, or None
    # As the parser left the request: vLLM 0.33's request leaves it None where neither the
    # request nor the parser set it (rollout.vllm_compat.skip_special_tokens reads it).
    skip_special_tokens: Optional[bool]


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCalling:
    def __init__(self, tokenizer: Any, parser_name: str, reasoning_parser: Optional[str] = None):
        from vllm.parser.parser_manager import ParserManager

        self.tokenizer = tokenizer
        self.parser_name = parser_name
        self._parser_cls = ParserManager.get_parser(
            tool_parser_name=parser_name, reasoning_parser_name=reasoning_parser, enable_auto_tools=True, tokenizer=tokenizer
        )

    def plan(self, tools: Sequence[Tool], tool_choice: ToolChoiceValue) -> TurnPlan:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        choice = {"type": "function", "function": {"name": tool_choice["name"]}} if isinstance(tool_choice, dict) else tool_choice
        request = ChatCompletionRequest(model="episode", messages=[{"role": "user", "content": ""}], tools=[t.openai() for t in tools], tool_choice=choice)
        parser = self._parser_cls(self.tokenizer, request.tools)
        request = parser.adjust_request(request)
        return TurnPlan(request, parser, request.structured_outputs, request.skip_special_tokens)

    def parse(self, plan: TurnPlan, text: str, token_ids: Sequence[int]) -> list[ParsedCall]:
        if plan.request.tool_choice == "none":
            return []
        _, _, calls = plan.parser.parse(text, plan.request, enable_auto_tools=True, model_output_token_ids=list(token_ids))
        out = []
        for i, call in enumerate(calls or []):
            arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            out.append(ParsedCall(call.id or f"call_{i}", call.name, arguments))
        return out
