"""Tool calls, the response's side: a choice's text read by the Hermes parser (hermes.py) and answered as OpenAI's
`message.tool_calls`, or streamed as `delta.tool_calls`.

finish_reason follows OpenAI: "tool_calls" when the model called (tool_choice auto or required), "stop" for a
named tool_choice, and never "tool_calls" without a call. A call the output left unfinished (max_tokens, a stop
string) is no call: the whole response answers the text as content, keeping its finish_reason; a stream has
sent the call's first pieces by then, and its finish_reason says the same.
"""

from __future__ import annotations

import uuid
from typing import Any

from dpserve_frontend.hermes import CallDelta, HermesParser
from dpserve_frontend.tools import ToolChoice


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(choice: ToolChoice, finish: str | None, parser: HermesParser) -> str | None:
    """The choice's finish_reason once the model's output is read for calls."""
    if finish == "stop" and parser.num_calls and parser.is_complete and choice != ToolChoice.NAMED:
        return "tool_calls"
    return finish


def tool_message(text: str, choice: ToolChoice, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message and finish_reason."""
    parser = HermesParser()
    events = parser.feed(text) + parser.finish()
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if not parser.is_complete:
        return message, finish
    content = "".join(e for e in events if isinstance(e, str))
    calls: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, str):
            continue
        if event.name is not None:
            function = {"name": event.name, "arguments": ""}
            calls.append({"id": new_call_id(), "type": "function", "function": function})
        calls[event.index]["function"]["arguments"] += event.arguments
    message["content"] = content if content or not calls else None
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason(choice, finish, parser)


class ToolCallStream:
    """One choice's streamed deltas: its text as it arrives, parsed into content and tool-call deltas."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.parser = HermesParser()

    def deltas(self, text: str, is_finished: bool) -> list[dict[str, Any]]:
        """The delta objects for the next piece of text: `{"content": ...}`, a call's first delta (index, id,
        type, name, empty arguments) and its arguments' pieces, in order."""
        events = self.parser.feed(text) if text else []
        if is_finished:
            events += self.parser.finish()
        return [self._delta(event) for event in events]

    def _delta(self, event: str | CallDelta) -> dict[str, Any]:
        if isinstance(event, str):
            return {"content": event}
        if event.name is not None:
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": new_call_id(), "type": "function", "function": function}
        else:
            call = {"index": event.index, "function": {"arguments": event.arguments}}
        return {"tool_calls": [call]}

    def finish_reason(self, finish: str | None) -> str | None:
        return finish_reason(self.choice, finish, self.parser)
