"""The Hermes tool-call format (--tool-call-parser hermes), the ChatML family's: a call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's text.

Two halves. `render_messages` writes tools into a conversation for a chat template that knows no tools (SmolLM2's
never reads `tools`): a system-prompt block describing them, earlier calls as those tags, tool results as a user
turn of `<tool_response>` blocks. `HermesParser` reads calls back out of the text as it grows. The tags are plain
text (SmolLM2 has no special tokens for them: `<tool_call>` is five tokens), so text that may be the start of a
tag is held back until the next piece decides it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_TOOLS_PROMPT = """# Tools

You may call one or more functions to answer the user. The functions you can call are described by their JSON \
signatures within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with its name and arguments as a JSON object within <tool_call></tool_call> tags:
<tool_call>{{"name": <function-name>, "arguments": <arguments-json-object>}}</tool_call>"""


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` (as protocol.message_dicts gives them) for a template without tools: the tools' block appended
    to the system prompt (or a system message of its own), an assistant's `tool_calls` as `<tool_call>` tags after
    its content, and each run of tool results as one user turn (a template that alternates roles can render it)."""
    out: list[dict[str, Any]] = []
    if tools:
        block = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if messages[0]["role"] == "system":
            out.append({**messages[0], "content": f"{messages[0]['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    is_tool_run = False  # the last message out is a user turn of tool results
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if is_tool_run:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response})
            is_tool_run = True
            continue
        is_tool_run = False
        if message.get("tool_calls"):
            calls = [CALL_OPEN + _call_json(call["function"]) + CALL_CLOSE for call in message["tool_calls"]]
            text = "\n".join([message["content"], *calls] if message["content"] else calls)
            message = {"role": message["role"], "content": text}
        out.append(message)
    return out


def _call_json(function: dict[str, Any]) -> str:
    """A call as the tool grammar makes the model write it (compact, name first)."""
    return json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False,
                      separators=(",", ":"))


@dataclasses.dataclass
class CallDelta:
    """A piece of the call `index`: its first one names it (and has no arguments), the others carry arguments."""

    index: int
    arguments: str = ""
    name: str | None = None


class _State(enum.Enum):
    TEXT = "text"  # content, or whitespace between calls
    HEAD = "head"  # after <tool_call>, before the arguments
    ARGUMENTS = "arguments"
    TAIL = "tail"  # after the arguments: `}` then </tool_call>
    BROKEN = "broken"  # not the Hermes format: nothing more is read


# `{"name": "NAME", "arguments": ` (names are [a-zA-Z0-9_-]: no escapes)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_MAX_HEAD_CHARS = 256  # longer without a match: not a call's head
_WHITESPACE = " \t\r\n"


class HermesParser:
    """Content and tool calls out of a text that arrives in pieces (`feed`, then `finish`), as a list of events in
    order: `str` content and `CallDelta`s. Fed all at once or piece by piece, the events join to the same content
    and the same arguments, so a streamed response and a whole one agree.

    Content is the text outside calls, stripped: leading whitespace and whitespace before a call or at the end are
    dropped, so whitespace is held back until text follows it. A call's arguments are its JSON value's text as the
    model wrote it; where the value ends is found by following its strings and brackets, so a `</tool_call>` inside
    a string does not end it. `is_complete` is false while (or if the text ended while) a call is open, or after
    text that breaks the format.
    """

    def __init__(self):
        self._state = _State.TEXT
        self._pending = ""  # text read but not decided yet
        self._has_content = False
        self._value = _ValueEnd()
        self.num_calls = 0  # calls started

    @property
    def is_complete(self) -> bool:
        return self._state == _State.TEXT

    def feed(self, text: str) -> list[str | CallDelta]:
        events: list[str | CallDelta] = []
        self._pending += text
        step = {_State.TEXT: self._text, _State.HEAD: self._head, _State.ARGUMENTS: self._arguments,
                _State.TAIL: self._tail, _State.BROKEN: self._broken}  # fmt: skip
        while self._pending and step[self._state](events):
            pass
        return events

    def finish(self) -> list[str | CallDelta]:
        """The text ended: content held back is released (a partial tag that never completed is content)."""
        events: list[str | CallDelta] = []
        if self._state == _State.TEXT:
            self._content(self._pending.rstrip(), events)
            self._pending = ""
        return events

    # Each step reads from `_pending` and says whether to go on (False: it needs more text).

    def _text(self, events: list) -> bool:
        pending = self._pending
        start = pending.find(CALL_OPEN)
        if start >= 0:
            self._content(pending[:start].rstrip(), events)
            self._pending = pending[start + len(CALL_OPEN):]
            self._state = _State.HEAD
            return True
        safe = pending[: len(pending) - _partial_tag_len(pending)]
        decided = safe.rstrip()  # whitespace waits: a call may follow it
        self._content(decided, events)
        self._pending = pending[len(decided):]
        return False

    def _content(self, text: str, events: list) -> None:
        if not self._has_content:
            text = text.lstrip()
        if text:
            self._has_content = True
            events.append(text)

    def _head(self, events: list) -> bool:
        match = _HEAD.match(self._pending)
        if match is None:
            if len(self._pending) > _MAX_HEAD_CHARS:
                self._state = _State.BROKEN
                return True
            return False
        events.append(CallDelta(self.num_calls, name=match.group(1)))
        self.num_calls += 1
        self._pending = self._pending[match.end():]
        self._value = _ValueEnd()
        self._state = _State.ARGUMENTS
        return True

    def _arguments(self, events: list) -> bool:
        if not self._value.has_started:
            self._pending = self._pending.lstrip(_WHITESPACE)
        end = self._value.end(self._pending)
        text = self._pending if end < 0 else self._pending[:end]
        if text:
            events.append(CallDelta(self.num_calls - 1, text))
        self._pending = "" if end < 0 else self._pending[end:]
        if end >= 0:
            self._state = _State.TAIL
        return end >= 0

    def _tail(self, events: list) -> bool:
        rest = self._pending.lstrip(_WHITESPACE)
        if not rest:
            return False
        after = rest[1:].lstrip(_WHITESPACE)
        if rest[0] == "}" and after.startswith(CALL_CLOSE):
            self._pending = after[len(CALL_CLOSE):]
            self._state = _State.TEXT
            return True
        if rest[0] == "}" and CALL_CLOSE.startswith(after):
            return False
        self._state = _State.BROKEN
        return True

    def _broken(self, events: list) -> bool:
        self._pending = ""
        return False


def _partial_tag_len(text: str) -> int:
    """The length of the longest end of `text` that is the start of CALL_OPEN."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class _ValueEnd:
    """Where one JSON value ends, in text that arrives in pieces. It follows strings (and their escapes) and
    brackets only: the grammar made the value well-formed."""

    def __init__(self):
        self.has_started = False
        self._kind = ""  # "container", "string" or "scalar", from the value's first character
        self._depth = 0
        self._in_string = False
        self._is_escaped = False

    def end(self, text: str) -> int:
        """The index in `text` just past the value's end, or -1 when the value goes on past `text`."""
        for i, ch in enumerate(text):
            if not self.has_started:
                self.has_started = True
                self._kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
                self._depth = int(ch in "{[")
                self._in_string = ch == '"'
            elif self._kind == "scalar":
                if ch in ",}]" or ch in _WHITESPACE:
                    return i
            elif self._in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif ch == "\\":
                    self._is_escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._kind == "string":
                        return i + 1
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1
