"""Tool calling, the request's side: `tools` and `tool_choice` checked, and the grammar that holds the output to
Hermes tool calls (hermes.py), so that a small model's calls name a real tool and carry arguments its schema
accepts.

What each tool_choice asks of the output (the grammar, in llguidance's Lark):

- "none": no tools in the prompt, no constraint.
- "auto" (the default with tools): free text with no `<tool_call>` in it, or text and then one or more calls
  with only whitespace between and after them. The lexer does not backtrack, so the text before the first call
  is one lexeme: any text ending in the first `<tool_call>`.
- "required": one or more calls and nothing else.
- a named function: exactly one `<tool_call>` block calling it. The same tags as the others, so one parser reads
  every tool_choice's output, and the text the model writes is what its prompt asked for.

parallel_tool_calls false allows one call at most. A call is written as the parser reads it: compact, name
first: `{"name":"NAME","arguments":ARGS}`, ARGS held to the function's parameters (a function without any takes
`{}`). The whitespace after a call is bounded: a model that keeps writing newlines must end or call again.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from llguidance import LLMatcher

from dpserve_frontend.errors import BadRequest
from dpserve_frontend.hermes import CALL_CLOSE, CALL_OPEN
from dpserve_frontend.protocol import ChatCompletionRequest, Tool
from dpserve_frontend.structured import Constraint, JsonOptions, json_schema_grammar

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

_AUTO_LEXEMES = r"""
TEXT: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/
PRE: /(.|\n)*<tool_call>/ & ~/(.|\n)*<tool_call>(.|\n)+/
"""
_WHITESPACE = r"WS: /[ \t\r\n]{1,4}/"


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools do: which go in the prompt, which the output may call, and how."""

    choice: ToolChoice
    tools: list[Tool]  # in the prompt
    allowed: list[int]  # indexes into `tools` of those the output may call
    is_parallel: bool
    is_parsed: bool  # the output is read for calls (not under the request's own constraint)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the prompt: none for tool_choice "none"."""
        return None if self.choice == ToolChoice.NONE else template_tools(self.tools)

    def constraint(self, options: JsonOptions) -> Constraint:
        """The grammar of this tool_choice's output (not for NONE). Its parts are the callable functions'
        parameters, compiled one by one when the whole fails: the error names the tool."""
        parts = tuple(json_schema_grammar(_parameters(self.tools[i]), f"tools[{i}].function.parameters", options)
                      for i in self.allowed)  # fmt: skip
        block = f'{_literal(CALL_OPEN)} call {_literal(CALL_CLOSE)}'
        more = f"(WS {block})*" if self.is_parallel else ""
        if self.choice == ToolChoice.AUTO:
            start = f"start: TEXT | PRE call {_literal(CALL_CLOSE)} {more} WS?"
        else:
            start = f"start: {block} {more} WS?"
        calls, rules = [], []
        for n, i in enumerate(self.allowed):
            name = self.tools[i].function.name
            schema = {**_parameters(self.tools[i]), "x-guidance": options.compile_options()}
            head = _literal('{"name":' + json.dumps(name) + ',"arguments":')
            calls.append(f'{head} args{n} "}}"')
            rules.append(f"args{n}: %json {_json_text(schema)}")
        lines = [start, "call: " + " | ".join(calls), *rules, _WHITESPACE]
        if self.choice == ToolChoice.AUTO:
            lines.append(_AUTO_LEXEMES)
        return Constraint(LLMatcher.grammar_from_lark("\n".join(lines)), "tools", parts)


def plan_tools(req: ChatCompletionRequest, constraint: Constraint | None) -> ToolPlan | None:
    """The request's ToolPlan (None: it has no tools); BadRequest for a tool_choice its tools do not allow, or one
    that contradicts the request's own constraint (`constraint`: response_format and the like)."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise BadRequest("tool_choice needs tools: give the functions the model may call in 'tools'",
                             param="tool_choice")
        return None
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise BadRequest(f"tools[{i}].type must be 'function', got {tool.type!r}", param=f"tools[{i}].type")
        if tool.function.name in names:
            raise BadRequest(f"tools[{i}]: two tools are named {tool.function.name!r}",
                             param=f"tools[{i}].function.name")
        names[tool.function.name] = i
    if isinstance(choice, str):
        mode, allowed = ToolChoice(choice), list(range(len(tools)))
    else:
        if choice.type != "function":
            raise BadRequest(f"tool_choice.type must be 'function', got {choice.type!r}", param="tool_choice.type")
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not one of the tools: "
                             f"{', '.join(names)}", param="tool_choice.function.name")
        mode, allowed = ToolChoice.NAMED, [names[choice.function.name]]
    if constraint is not None and mode in (ToolChoice.REQUIRED, ToolChoice.NAMED):
        what = "a named tool_choice" if mode == ToolChoice.NAMED else "tool_choice 'required'"
        raise BadRequest(f"{what} cannot be combined with {constraint.param}: each constrains the output",
                         param="tool_choice")
    return ToolPlan(mode, tools, allowed, req.parallel_tool_calls is not False,
                    is_parsed=constraint is None and mode != ToolChoice.NONE)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as chat templates take them (Hugging Face's `tools=`): OpenAI's tool objects, with the parameters
    the grammar holds the arguments to."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.function.name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        function["parameters"] = _parameters(tool)
        out.append({"type": "function", "function": function})
    return out


def _json_text(value: Any) -> str:
    """JSON on one line, for a Lark rule's `%json`."""
    return json.dumps(value, separators=(",", ":"))


def _literal(text: str) -> str:
    """A Lark string literal: JSON's escapes are Lark's."""
    return json.dumps(text)
