"""Tool calling in the frontend: tools and tool_choice checked and turned into a grammar (tools.py), the Hermes
format rendered into prompts and parsed back out of text (hermes.py), and the OpenAI message and stream deltas
(tool_calls.py). The grammars are walked the way the null engine walks them: random tokens among those allowed."""

import json
import random

import jsonschema
import llguidance
import msgspec
import numpy as np
import pytest
from tokenizers import Tokenizer

from dpserve_frontend.errors import BadRequest
from dpserve_frontend.hermes import CallDelta, HermesParser, render_messages
from dpserve_frontend.protocol import ChatCompletionRequest, message_dicts
from dpserve_frontend.structured import Constraint, JsonOptions
from dpserve_frontend.tokenizer import ModelTokenizer
from dpserve_frontend.tool_calls import ToolCallStream, finish_reason, tool_message
from dpserve_frontend.tools import ToolChoice, plan_tools

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: takes {}
CALL_WEATHER = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":2}}</tool_call>'
CALL_TIME = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def plan(**fields):
    return plan_tools(chat(**fields), None)


@pytest.fixture(scope="module")
def random_output(model_info, lltok):
    """random_output(grammar, seed, max_tokens): the text of a seeded random walk through the grammar's allowed
    tokens, and whether it ended (the grammar complete or EOS drawn) before max_tokens."""
    tokenizer = Tokenizer.from_str(model_info.tokenizer_json)
    eos = set(model_info.eos_token_ids)

    def walk(grammar: str, seed: int, max_tokens: int = 120) -> tuple[str, bool]:
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        rng = random.Random(seed)
        tokens = []
        for _ in range(max_tokens):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: model_info.vocab_size])
            token = int(allowed[int(rng.random() * len(allowed))])
            if token in eos:
                return tokenizer.decode(tokens), True
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
            if matcher.is_stopped():
                return tokenizer.decode(tokens), True
        return tokenizer.decode(tokens), False

    return walk


PLAN_ERRORS = [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": NAMED_TIME}, "tool_choice.function.name", "not one of the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "two tools"),
    ({"tools": [{**TIME, "type": "custom"}]}, "tools[0].type", "'function'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "x", "function": {"name": "get_weather"}}}, "tool_choice.type",
     "'function'"),
]


@pytest.mark.parametrize("fields,param,text", PLAN_ERRORS, ids=[r[1] for r in PLAN_ERRORS])
def test_tool_choices_the_tools_do_not_allow_are_400s(fields, param, text):
    with pytest.raises(BadRequest) as caught:
        plan(**fields)
    assert caught.value.param == param and text in caught.value.message


def test_a_constraint_of_the_request_excludes_required_and_named_tool_choices():
    constraint = Constraint("", "response_format")
    for choice in ("required", NAMED_TIME):
        with pytest.raises(BadRequest, match="cannot be combined with response_format") as caught:
            plan_tools(chat(tools=[TIME], tool_choice=choice), constraint)
        assert caught.value.param == "tool_choice"
    auto = plan_tools(chat(tools=[TIME]), constraint)  # the tools are in the prompt; the request's grammar holds
    assert auto.choice == ToolChoice.AUTO and not auto.is_parsed and auto.template_tools()


def test_plans_follow_tool_choice():
    assert plan() is None and plan(tools=[], tool_choice="none") is None
    none = plan(tools=[WEATHER], tool_choice="none")
    assert none.template_tools() is None and not none.is_parsed
    auto = plan(tools=[WEATHER, TIME])
    assert auto.choice == ToolChoice.AUTO and auto.is_parallel and auto.is_parsed
    assert [t["function"]["name"] for t in auto.template_tools()] == ["get_weather", "get_time"]
    assert auto.template_tools()[1]["function"]["parameters"] == {"type": "object", "properties": {},
                                                                  "additionalProperties": False}
    named = plan(tools=[WEATHER, TIME], tool_choice=NAMED_TIME, parallel_tool_calls=True)
    assert named.choice == ToolChoice.NAMED and named.allowed == [1] and len(named.template_tools()) == 2
    assert not plan(tools=[TIME], parallel_tool_calls=False).is_parallel


def test_the_grammars_hold_the_output_to_each_tool_choice(accepts):
    def grammar(**fields) -> str:
        return plan(tools=[WEATHER, TIME], **fields).constraint(JsonOptions()).grammar

    two = f"{CALL_WEATHER}\n{CALL_TIME}\n"
    auto, required = grammar(), grammar(tool_choice="required")
    assert accepts(auto, "Just text, with <tool> and </tool_call> in it")
    assert accepts(auto, f"Let me look. {CALL_WEATHER}") and accepts(auto, two)
    assert not accepts(auto, f"{CALL_WEATHER} and then text")
    assert not accepts(auto, '<tool_call>{"name":"get_news","arguments":{}}</tool_call>')
    assert not accepts(auto, '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","days":2}}</tool_call>')
    assert not accepts(auto, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # compact
    assert not accepts(auto, CALL_TIME + "\n\n\n\n\n")  # the whitespace after a call is bounded
    assert accepts(required, two) and not accepts(required, "text") and not accepts(required, f"a {CALL_TIME}")
    single = grammar(tool_choice="required", parallel_tool_calls=False)
    assert accepts(single, CALL_TIME) and not accepts(single, two)
    assert accepts(grammar(parallel_tool_calls=False), f"ok {CALL_TIME}")
    assert not accepts(grammar(parallel_tool_calls=False), two)
    named = grammar(tool_choice=NAMED_TIME)
    assert accepts(named, CALL_TIME) and not accepts(named, CALL_WEATHER) and not accepts(named, two)


def test_random_walks_through_the_tool_grammars_parse_into_valid_calls(random_output):
    """Whatever the grammar lets a model write parses into calls of the allowed tools with arguments their
    schemas accept, whole or streamed in random pieces alike. (A random walk rarely draws EOS among the allowed
    tokens: with parallel calls it goes on calling until max_tokens, so only the calls it finished count.)"""
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object",
                                                                            "additionalProperties": False}}
    for fields, names in [({"tool_choice": "required"}, {"get_weather", "get_time"}),
                          ({"tool_choice": "required", "parallel_tool_calls": False}, {"get_weather", "get_time"}),
                          ({"tool_choice": NAMED_TIME}, {"get_time"}),
                          ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                           {"get_weather"})]:
        tool_plan = plan(tools=[WEATHER, TIME], **fields)
        grammar = tool_plan.constraint(JsonOptions()).grammar
        for seed in range(6):
            text, is_done = random_output(grammar, seed)
            assert is_done or tool_plan.is_parallel, text
            message, finish = tool_message(text, tool_plan.choice, "stop" if is_done else "length")
            if "tool_calls" not in message:  # cut off in a call: the text, not half a call (a stream sent it)
                assert not is_done and finish == "length" and message["content"] == text
                continue
            assert streamed(text, tool_plan.choice, random.Random(seed)) == message_parts(message)
            assert message["content"] is None, text
            expected = "length" if not is_done else "stop" if tool_plan.choice == ToolChoice.NAMED else "tool_calls"
            assert finish == expected
            for call in message["tool_calls"]:
                assert call["function"]["name"] in names
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_auto_lets_text_through_without_tags(random_output):
    tool_plan = plan(tools=[WEATHER])
    text, _ = random_output(tool_plan.constraint(JsonOptions()).grammar, seed=3, max_tokens=40)
    message, finish = tool_message(text, ToolChoice.AUTO, "length")
    assert "tool_calls" not in message and finish == "length"
    assert message["content"] == text.strip()


def message_parts(message: dict) -> tuple[str, list[tuple[str, str]]]:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message["content"] or "", calls


def streamed(text: str, choice: ToolChoice, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client joins them from the deltas of `text` sent in random pieces."""
    stream = ToolCallStream(choice)
    deltas = []
    start = 0
    while start < len(text):
        end = start + rng.randint(1, 6)
        deltas += stream.deltas(text[start:end], is_finished=end >= len(text))
        start = end
    content, calls = "", []
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"})
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["id"].startswith("call_") and call["type"] == "function"
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls.append([call["function"]["name"], ""])
            else:
                assert set(call) == {"index", "function"}
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(c) for c in calls]


PARSED = [
    # (text, content, calls, is_complete)
    ("Hello there.", "Hello there.", [], True),
    ("  Hi  \n", "Hi", [], True),
    (f"Let me check.\n{CALL_WEATHER}", "Let me check.", [("get_weather", '{"city":"Paris","days":2}')], True),
    (f"{CALL_TIME}\n{CALL_WEATHER}\n", "", [("get_time", "{}"), ("get_weather", '{"city":"Paris","days":2}')],
     True),
    ('<tool_call>{"name":"f","arguments":{"s":"</tool_call>}{\\"","n":[1,{"a":2}]}}</tool_call>', "",
     [("f", '{"s":"</tool_call>}{\\"","n":[1,{"a":2}]}')], True),
    ('<tool_call> { "name" : "f" , "arguments" : 5 } </tool_call>', "", [("f", "5")], True),
    ('<tool_call>{"name":"f","arguments":"x"}</tool_call>', "", [("f", '"x"')], True),
    ("ends with <tool", "ends with <tool", [], True),  # never became a tag: content
    ("a <toolbox> b", "a <toolbox> b", [], True),
    ('<tool_call>{"name":"f","arguments":{"a":', "", [("f", '{"a":')], False),  # cut off mid-call
    ("<tool_call>not json at all" + "x" * 300, "", [], False),
    ('<tool_call>{"name":"f","arguments":{}} junk', "", [("f", "{}")], False),
]


@pytest.mark.parametrize("text,content,calls,is_complete", PARSED, ids=range(len(PARSED)))
def test_the_parser_reads_the_same_whole_or_in_any_pieces(text, content, calls, is_complete):
    for size in (len(text) or 1, 1, 2, 3, 7):
        parser = HermesParser()
        events = []
        for i in range(0, len(text), size):
            events += parser.feed(text[i : i + size])
        events += parser.finish()
        got_content = "".join(e for e in events if isinstance(e, str))
        got_calls: list[list[str]] = []
        for event in (e for e in events if isinstance(e, CallDelta)):
            if event.name is not None:
                got_calls.append([event.name, ""])
            got_calls[event.index][1] += event.arguments
        assert (got_content, [tuple(c) for c in got_calls], parser.is_complete) == (content, calls, is_complete)


def test_partial_tags_and_trailing_whitespace_wait_for_the_next_piece():
    parser = HermesParser()
    assert parser.feed("Sure, ") == ["Sure,"]
    assert parser.feed("<tool") == []
    assert parser.feed("_call>") == []  # a tag: the space before it is dropped
    assert parser.feed('{"name":"get_time",') == []
    assert parser.feed('"arguments":{') == [CallDelta(0, name="get_time"), CallDelta(0, "{")]
    assert parser.feed("}}</tool_") == [CallDelta(0, "}")]
    assert not parser.is_complete
    assert parser.feed("call>") == [] and parser.is_complete


def test_whole_messages_and_finish_reasons():
    message, finish = tool_message(f"Checking. {CALL_TIME}", ToolChoice.AUTO, "stop")
    assert finish == "tool_calls" and message["content"] == "Checking." and message["refusal"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    message, finish = tool_message(CALL_TIME, ToolChoice.NAMED, "stop")
    assert finish == "stop" and message["content"] is None and len(message["tool_calls"]) == 1
    cut = '<tool_call>{"name":"get_weather","arguments":{"ci'
    message, finish = tool_message(cut, ToolChoice.REQUIRED, "length")  # no half call: the text as content
    assert finish == "length" and message["content"] == cut and "tool_calls" not in message
    message, finish = tool_message("No call needed.", ToolChoice.AUTO, "stop")
    assert finish == "stop" and message["content"] == "No call needed." and "tool_calls" not in message
    parser = HermesParser()
    parser.feed(CALL_TIME)
    assert finish_reason(ToolChoice.REQUIRED, "length", parser) == "length"  # not "tool_calls"


def test_streamed_calls_start_with_index_id_type_and_name():
    stream = ToolCallStream(ToolChoice.AUTO)
    deltas = stream.deltas(f"Hi {CALL_TIME}{CALL_TIME}", is_finished=True)
    assert deltas[0] == {"content": "Hi"}
    first = deltas[1]["tool_calls"][0]
    assert set(first) == {"index", "id", "type", "function"} and first["function"] == {"name": "get_time",
                                                                                        "arguments": ""}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert deltas[3]["tool_calls"][0]["index"] == 1 and deltas[3]["tool_calls"][0]["id"] != first["id"]
    assert stream.finish_reason("stop") == "tool_calls"


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]  # fmt: skip


def history() -> list[dict]:
    return message_dicts(chat(messages=HISTORY).messages)


def test_a_template_without_tools_gets_the_hermes_rendering(model_info):
    tok = ModelTokenizer(model_info)
    assert not tok.template_reads_tools  # SmolLM2's
    tools = plan(tools=[WEATHER]).template_tools()
    text, _ = tok.encode_chat(history(), True, False, False, None, tools)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and json.dumps(tools[0], ensure_ascii=False) in system
    assert "<tool_call>" in system
    assert ('<|im_start|>assistant\n<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>\n'
            '<tool_call>{"name":"get_time","arguments":{}}</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n20 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    plain, _ = tok.encode_chat(history()[:1], True, False, False, None, None)
    assert "# Tools" not in plain and "SmolLM" in plain  # no tools: the template's own system prompt


def test_a_system_prompt_keeps_its_text_before_the_tools():
    messages = render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                               plan(tools=[TIME]).template_tools())
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and messages[1]["role"] == "user"


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_they_are(model_info):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
                "{{ m.tool_call_id or '' }}{% endfor %}")
    tok = ModelTokenizer(msgspec.structs.replace(model_info, chat_template=template))
    assert tok.template_reads_tools
    text, _ = tok.encode_chat(history(), False, False, False, None, plan(tools=[WEATHER, TIME]).template_tools())
    assert text == ('[get_weather][get_time]<user><assistant>get_weather{"city": "Paris"}get_time{}'
                    "<tool>call_1<tool>call_2")


def test_tool_call_arguments_in_the_history_must_be_json():
    with pytest.raises(BadRequest) as caught:
        message_dicts(chat(messages=[{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]).messages)
    assert caught.value.param == "messages[0].tool_calls[0].function.arguments"
