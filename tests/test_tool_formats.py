"""Tool-call formats: streaming parsers against recorded-style outputs, format detection, the generic prompt,
and the llguidance grammars for forced calls (compiled, and matched with a byte-level tokenizer)."""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from api.tool_calls import FORMATS, create_output_parser, detect_format, get_format
from api.tool_calls.base import PlainContentParser
from tests.support.tool_streams import SPLITS, TOOLS, byte_tokens, feed, joined, split_chars

DATA = Path(__file__).parent / "data" / "tool_outputs"
FORMAT_NAMES = ["hermes", "qwen3_coder", "llama3_json", "mistral", "generic"]
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>", "[TOOL_CALLS]", "[ARGS]",
          "<|python_tag|>", '"tool_calls"', '"response"')


def _cases():
    for name in FORMAT_NAMES:
        for case in json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))["cases"]:
            yield pytest.param(name, case, id=f"{name}-{case['name']}")


@pytest.mark.parametrize("format_name,case", list(_cases()))
def test_parser_on_recorded_outputs(format_name: str, case: dict) -> None:
    results = []
    for split in SPLITS:
        parser = get_format(format_name).create_parser(TOOLS)
        content, reasoning, calls = joined(feed(parser, split(case["text"])))
        assert parser.num_tool_calls == len(calls)
        results.append((content, reasoning, [(call["name"], call["arguments"]) for call in calls]))
    assert all(result == results[0] for result in results), "every split must give the whole-fed result"
    content, reasoning, calls = results[0]
    assert content == case["content"]
    assert reasoning == ""
    if case["calls"]:
        assert not any(marker in content for marker in MARKUP), content
    assert [name for name, _ in calls] == [call["name"] for call in case["calls"]]
    for (name, arguments), expected in zip(calls, case["calls"]):
        if expected["raw"] is not None:
            assert arguments == expected["raw"]  # JSON formats pass the model's own text on unchanged
        if not case.get("truncated"):
            assert json.loads(arguments) == expected["arguments"]


def test_arguments_stream_before_the_call_ends() -> None:
    parser = get_format("hermes").create_parser(TOOLS)
    first = parser.feed('Hi <tool_call>\n{"name": "search", "arguments": {"query": "hel')
    assert first.content == "Hi "
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "search", '{"query": "hel')]
    second = parser.feed('lo"}}\n</tool_call>')
    assert [(c.index, c.id, c.name, c.arguments) for c in second.tool_calls] == [(0, None, None, 'lo"}')]
    assert parser.finish().is_empty


def test_possible_marker_is_held_then_released() -> None:
    parser = get_format("hermes").create_parser(TOOLS)
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("s are useful").content == "<tools are useful"
    mistral = get_format("mistral").create_parser(TOOLS)
    assert mistral.feed("a [TOOL_").content == "a "
    assert mistral.finish().content == "[TOOL_"


def test_qwen3_coder_streams_string_values() -> None:
    parser = get_format("qwen3_coder").create_parser(TOOLS)
    delta = parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline")
    assert [(c.name, c.arguments) for c in delta.tool_calls] == [("write_file", '{"content": "line one\\nline')]


def test_get_format_and_unknown_name() -> None:
    assert sorted(FORMATS) == sorted(FORMAT_NAMES + ["harmony", "generic_json"])  # harmony: tests/test_harmony.py
    for name in FORMAT_NAMES:
        fmt = get_format(name)
        assert fmt.name == name and fmt.renders_in_template == (name != "generic")
        assert (fmt.lazy_trigger is None) == (name == "generic")
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral.*qwen3_coder"):
        get_format("chatml")


@pytest.mark.parametrize("template,expected", [
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "generic"),
    ("{% if tools %}<tool_call>\n<function=example>\n<parameter=x>{% endif %}<tool_call>", "qwen3_coder"),
    ('{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{"name": ...}</tool_call>{% endif %}', "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>{% if tools %}{{ tools }}{% endif %}<|eot_id|>", "llama3_json"),
    ("{% if tools %}{{ tools }}{% endif %}<|python_tag|>", "llama3_json"),
    ("{% if tools %}You may call {{ tools | tojson }}{% endif %}", "hermes"),  # renders tools, unknown markup
])
def test_detect_format(template: str, expected: str) -> None:
    assert detect_format(template).name == expected


def test_create_output_parser_without_tools_is_plain() -> None:
    for fmt, tools in ((None, TOOLS), (get_format("hermes"), None), (get_format("hermes"), [TOOLS[-1]])):
        parser = create_output_parser(fmt, tools, reasoning=None, starts_in_reasoning=False)
        assert isinstance(parser, PlainContentParser)
        assert parser.feed("<tool_call>x").content == "<tool_call>x"


def test_generic_system_prompt_is_deterministic() -> None:
    fmt = get_format("generic")
    assert all(get_format(name).system_prompt(TOOLS) is None for name in FORMAT_NAMES[:-1])
    text = fmt.system_prompt(TOOLS)
    assert fmt.system_prompt(json.loads(json.dumps(TOOLS))) == text  # same tools, same bytes
    assert '{"tool_calls": [{"name": "<tool name>"' in text and "plain text (not JSON)" in text
    assert "- get_weather: Current weather for a city." in text and '"enum": ["celsius", "fahrenheit"]' in text
    assert "apply_patch" not in text  # not a function tool


# ---- grammars -------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<eos>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]


class _ByteTokenizer:
    """One token per byte, plus a few special tokens: any text can be fed byte by byte."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [token.encode() for token in SPECIAL_TOKENS]
        self.eos_token_id, self.bos_token_id = 256, None
        self.special_token_ids = list(range(256, 256 + len(SPECIAL_TOKENS)))

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
SPECIAL_IDS = {token: 256 + number for number, token in enumerate(SPECIAL_TOKENS)}


def _accepts(grammar: str, text: str, specials: dict[str, int] | None = None) -> bool:
    compiled = llguidance.grammar_from("lark", grammar)
    assert llguidance.LLMatcher.validate_grammar(compiled, TOKENIZER) == ""
    matcher = llguidance.LLMatcher(TOKENIZER, compiled, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(byte_tokens(text, specials or {})) and matcher.is_accepting()


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
QWEN3_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
GOOD = {  # format -> (required reply with two calls, lazy text after the trigger with one call)
    "hermes": (HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo"), HERMES_CALL[len("<tool_call>"):]),
    "qwen3_coder": (QWEN3_CALL + "\n" + QWEN3_CALL, QWEN3_CALL[len("<tool_call>"):]),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "list_files", "parameters": {}}',
                    ': "get_weather", "parameters": {"city": "Paris"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"}, '
                '{"name": "search", "arguments": {"query": "x"}}]',
                'get_weather[ARGS]{"city": "Paris"}'),
    "generic": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "write_file", "arguments": {"path": "a", "content": "b"}}]}',
                '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'),
}
GENERIC_RESPONSE = '{"response": "Hello \\"there\\" \\u00e9"}'


def _grammar(name: str, **options) -> str:
    settings = {"required": True, "forced_name": None, "allow_parallel": True} | options
    return get_format(name).grammar(TOOLS, **settings)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_grammar_accepts_calls_and_rejects_unknown_functions(name: str) -> None:
    required_text, lazy_text = GOOD[name]
    assert _accepts(_grammar(name), required_text)
    assert _accepts(_grammar(name, required=False), lazy_text)
    assert not _accepts(_grammar(name), required_text.replace("get_weather", "get_wether"))
    assert not _accepts(_grammar(name, required=False), lazy_text.replace("get_weather", "delete_all"))
    first_call_only = _grammar(name, forced_name="get_weather", allow_parallel=False)
    assert not _accepts(first_call_only, required_text)  # two calls, the second not get_weather


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_grammar_constrains_arguments_by_schema(name: str) -> None:
    required_text, _ = GOOD[name]
    single = _grammar(name, forced_name="get_weather", allow_parallel=False)
    first = {"hermes": HERMES_CALL, "qwen3_coder": QWEN3_CALL,
             "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
             "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
             "generic": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'}[name]
    assert _accepts(single, first)
    if name == "qwen3_coder":
        assert not _accepts(single, first.replace("\n3\n", "\nthree\n"))  # days is an integer
    else:
        assert not _accepts(single, first.replace('"city": "Paris"', '"city": 7'))
    with pytest.raises(ValueError, match="not among the tools"):
        _grammar(name, forced_name="apply_patch")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "generic"])
def test_arguments_are_closed_to_the_declared_properties(name: str) -> None:
    """A key the schema does not declare (a small model copying `"type": "string"` into the call) cannot be
    sampled; an object the schema leaves free ("filters": {"type": "object"}) still takes any key."""
    single = _grammar(name, forced_name="get_weather", allow_parallel=False)
    first = {"hermes": HERMES_CALL,
             "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
             "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
             "generic": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'}[name]
    assert _accepts(single, first)
    assert not _accepts(single, first.replace('"city": "Paris"', '"city": "Paris", "type": "string"'))
    search = _grammar(name, forced_name="search", allow_parallel=False)
    free = first.replace("get_weather", "search").replace(', "days": 2', "")
    free = free.replace('"city": "Paris"', '"query": "x", "filters": {"any": 1}')
    assert _accepts(search, free)


def test_closed_schema_leaves_open_and_combined_objects_alone() -> None:
    from api.tool_calls.grammar_parts import closed_schema
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "c": {"type": "object"},
                                               "d": {"type": "array", "items": {"properties": {"e": {}}}},
                                               "f": {"anyOf": [{"properties": {"g": {}}}, {"type": "null"}]}},
              "$defs": {"h": {"properties": {"i": {}}, "additionalProperties": True}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["c"]  # no properties listed: any object
    assert closed["properties"]["d"]["items"]["additionalProperties"] is False
    assert closed["properties"]["f"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["h"]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in schema  # the client's schema is not changed
    both = {"properties": {"x": {}}, "allOf": [{"properties": {"y": {}}}]}
    assert "additionalProperties" not in closed_schema(both)  # closing would exclude allOf's keys


def test_generic_auto_grammar_allows_calls_or_a_plain_text_answer() -> None:
    lazy = _grammar("generic", required=False)
    answer = "Hello \"there\" \u00e9, {not json} here.\nSecond line."
    assert _accepts(lazy, GOOD["generic"][0]) and _accepts(lazy, answer) and _accepts(lazy, "\n" + answer)
    assert not _accepts(lazy, GENERIC_RESPONSE)  # a "{" begins the tool-call object, nothing else
    assert not _accepts(_grammar("generic"), answer)  # required: no plain answer


def test_grammar_uses_special_token_ids() -> None:
    ids = {token: SPECIAL_IDS[token] for token in ("[TOOL_CALLS]", "[ARGS]")}
    grammar = get_format("mistral").grammar(TOOLS, required=True, forced_name=None, allow_parallel=True,
                                            special_token_ids=ids)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]list_files[ARGS]{}'
    assert _accepts(grammar, text, ids)
    assert not _accepts(grammar, text)  # spelled out as text, the special tokens do not match


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_tools_auto_with_a_response_format_accepts_a_call_or_the_formatted_answer(name: str) -> None:
    from api.chat_turn import _either
    from engine.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    either = _either(_grammar(name), json_schema_grammar(schema))
    assert _accepts(either, GOOD[name][0])
    assert _accepts(either, '{"city": "Rome"}')
    assert not _accepts(either, '{"town": "Rome"}')
    assert not _accepts(either, "Rome is a city.")


def test_generic_json_replies_are_a_call_or_a_response_object() -> None:
    """generic_json (llama.cpp's generic format): the direct answer is {"response": ...}, never bare text, and
    the history renders a plain answer back as that object, so next turn's prompt repeats the reply's bytes."""
    from api.generic_tools import rewrite_history
    fmt = get_format("generic_json")
    lazy = fmt.grammar(TOOLS, required=False, forced_name=None, allow_parallel=True)
    response = '{"response": "Hello \\"there\\" é"}'
    assert _accepts(lazy, GOOD["generic"][0]) and _accepts(lazy, response)
    assert not _accepts(lazy, "Hello there.") and not _accepts(lazy, '{"answer": "x"}')
    none_choice = fmt.answer_only_grammar()
    assert _accepts(none_choice, response) and not _accepts(none_choice, GOOD["generic"][0])
    deltas = feed(fmt.create_parser(TOOLS), split_chars(response))
    assert joined(deltas)[0] == 'Hello "there" é'
    # the end-of-turn token may end the answer inside its string (a small model must be able to stop)
    assert _accepts(lazy, '{"response": "Hello \\"there') and not _accepts(lazy, '{"response": "a"b')
    assert joined(feed(fmt.create_parser(TOOLS), split_chars('{"response": "Hello \\"there')))[0] == 'Hello "there'
    assert '{"response": "<your answer>"}' in fmt.system_prompt(TOOLS)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 'Hello "there" é'}]
    rendered = rewrite_history(history, "tools", json_answers=True)
    assert rendered[2]["content"] == response
    assert rewrite_history(history, "tools")[2]["content"] == 'Hello "there" é'  # plain generic: as written
