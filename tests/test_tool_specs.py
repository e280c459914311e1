"""Tool definitions and tool choices normalised for the template, and the generic format's history rewrite."""
import json

import pytest

from api.errors import APIError
from api.generic_tools import rewrite_history
from api.schemas import ChatCompletionRequest, parse_body
from api.tool_specs import normalise_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_function_tools_pass_through_and_default_to_auto():
    specs = normalise_tools([WEATHER])
    assert specs.tools == [WEATHER] and specs.mode == "auto" and specs.forced_name is None and specs.calls_possible


def test_flat_function_shape_and_missing_parameters_are_accepted():
    specs = normalise_tools([{"type": "function", "name": "ls"}])
    assert specs.tools == [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object",
                                                                                         "properties": {}}}}]


def test_custom_tool_becomes_a_function_with_one_string_input():
    specs = normalise_tools([{"type": "custom", "name": "apply_patch", "description": "Apply a patch",
                              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}])
    function = specs.tools[0]["function"]
    assert function["name"] == "apply_patch" and "start: /.+/" in function["description"]
    assert function["parameters"]["required"] == ["input"]
    assert specs.custom_names == frozenset({"apply_patch"})


def test_tools_without_a_schema_are_left_out_with_a_log_line(caplog):
    with caplog.at_level("INFO", logger="strata.api"):
        specs = normalise_tools([{"type": "web_search"}, WEATHER])
    assert [t["function"]["name"] for t in specs.tools] == ["get_weather"]
    assert "web_search" in caplog.text


def test_named_tool_choice_forces_that_function():
    specs = normalise_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert (specs.mode, specs.forced_name, specs.allow_parallel) == ("required", "get_weather", False)


def test_tool_choice_naming_an_unknown_function_is_a_400():
    with pytest.raises(APIError) as info:
        normalise_tools([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert info.value.status == 400 and info.value.param == "tool_choice" and "get_weather" in info.value.message


def test_required_without_usable_tools_is_a_400():
    with pytest.raises(APIError):
        normalise_tools([{"type": "web_search"}], "required")


def test_none_keeps_the_tools_but_allows_no_calls():
    specs = normalise_tools([WEATHER], "none")
    assert specs.tools and not specs.calls_possible


def test_history_tool_call_arguments_reach_the_template_as_a_mapping():
    body = parse_body(ChatCompletionRequest, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]}).encode())
    messages = body.template_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_generic_history_rewrite_is_the_json_the_format_uses():
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
    ]
    out = rewrite_history(messages, "TOOLS")
    assert out[0] == {"role": "system", "content": "TOOLS"}
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                            {"name": "get_weather", "arguments": {"city": "Rome"}}]}
    assert out[3]["content"] == ("Result of get_weather:\nsunny\n\nResult of get_weather:\nrain\n\n"
                                 "Now answer my request with these results.")  # names found by call id
    assert out[4] == {"role": "assistant", "content": "Sunny in Paris, rain in Rome."}  # a plain answer stays
    assert rewrite_history(messages, "TOOLS") == out  # a pure function: the prefix renders the same every turn


def test_generic_system_prompt_joins_an_existing_system_message():
    out = rewrite_history([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], "TOOLS")
    assert out[0] == {"role": "system", "content": "Be brief.\n\nTOOLS"}
