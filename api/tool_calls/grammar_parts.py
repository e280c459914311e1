"""Building blocks of the llguidance Lark grammars for forced tool calls.

Each function becomes its own alternative whose name is a fixed literal and whose arguments are
constrained by the tool's JSON schema (``%json {...}``), so a call to an unknown function cannot be sampled.
Schemas are compiled leniently: keywords llguidance does not implement are ignored instead of failing the
whole request. A call object and its arguments are written in one canonical layout, the one ``json.dumps``
and the templates' ``tojson`` give (``{"name": "f", "arguments": {"k": 1}}``): the reply is then
byte-identical to the same call re-rendered from the history next turn, so the conversation cache reuses the
reply's tokens instead of diverging inside it. Optional whitespace (``WS?``) remains only around markers.
"""
from __future__ import annotations

import json
from typing import Mapping

from api.tool_calls.base import function_specs, parameters_schema

# Bounded: an unbounded run lets a weak model loop on whitespace inside a forced call until max_tokens.
WHITESPACE_TERMINAL = r"WS: /[ \t\r\n]{1,16}/"


def literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def json_text_literal(value: object) -> str:
    """A Lark literal matching the JSON encoding of ``value`` (e.g. the quoted function name)."""
    return literal(json.dumps(value, ensure_ascii=False))


def marker(text: str, special_token_ids: Mapping[str, int] | None) -> str:
    """A marker as the grammar must match it: ``<[id]>`` if the tokenizer has it as a special token, else text."""
    if special_token_ids and text in special_token_ids:
        return f"<[{int(special_token_ids[text])}]>"
    return literal(text)


# llguidance's JSON options: lenient (unknown keywords ignored), and json.dumps' separators with no free
# whitespace, so constrained JSON is canonical.
CANONICAL_JSON_OPTIONS = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ",
                          "key_separator": ": "}


def schema_json(schema: Mapping) -> str:
    """The schema as one line of JSON for ``%json``: lenient, and in json.dumps' canonical layout."""
    schema = dict(schema)
    schema.setdefault("x-guidance", dict(CANONICAL_JSON_OPTIONS))
    return json.dumps(schema, ensure_ascii=False)


def arguments_schema(function: Mapping) -> dict:
    """The schema a call's arguments are generated under: the tool's parameters with every object that lists
    ``properties`` and says nothing of ``additionalProperties`` closed to those properties.

    JSON Schema leaves such objects open, and small models then copy the schema into the call
    (``{"path": "a.txt", "type": "string"}``, seen with SmolLM2), which strict clients reject. llama.cpp's
    schema-to-grammar converter closes them too; a tool that wants extra keys says ``additionalProperties``.
    """
    return closed_schema(parameters_schema(function))


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: closing each branch would exclude the others'
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed_schema(schema: object) -> object:
    """`schema` with its objects closed as `arguments_schema` describes (a copy; the input is not changed)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    if isinstance(out.get("items"), Mapping):
        out["items"] = closed_schema(out["items"])
    if (isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out
            and "patternProperties" not in out and "allOf" not in out):
        out["additionalProperties"] = False
    return out


def selected_functions(tools: list[dict], forced_name: str | None) -> list[dict]:
    """The functions the grammar may call: all of them, or only ``forced_name``. ValueError if none remain."""
    functions = function_specs(tools)
    if forced_name is not None:
        functions = [function for function in functions if function["name"] == forced_name]
        if not functions:
            raise ValueError(f"tool_choice names the function {forced_name!r}, which is not among the tools")
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function tool")
    return functions


def json_call_rules(tools: list[dict], forced_name: str | None, *, arguments_key: str,
                    extra_members: str = "") -> list[str]:
    """Rules for ``call_object``: ``{"name": "<one of the tools>", "<arguments_key>": <its schema>}``.

    Also defines ``call_rest``: the same object without its opening ``{"name"`` (the text after Llama 3's
    lazy trigger). ``extra_members`` is Lark text appended after the arguments member (e.g. Mistral's id).
    """
    rules = []
    alternatives = []
    for number, function in enumerate(selected_functions(tools, forced_name)):
        alternatives.append(f"fn_{number}")
        rules.append(
            f"fn_{number}: \": \" {json_text_literal(function['name'])} \", \" "
            f"{json_text_literal(arguments_key)} \": \" args_{number} {extra_members}\"}}\""
        )
        rules.append(f"args_{number}: %json {schema_json(arguments_schema(function))}")
    rules.insert(0, "call_rest: " + " | ".join(alternatives))
    rules.insert(0, f"call_object: \"{{\" {json_text_literal('name')} call_rest")
    return rules


def assemble(start: str, rules: list[str], *terminals: str) -> str:
    """The grammar text: the start rule, the other rules, then the terminals (whitespace always)."""
    return "\n".join([start, *rules, WHITESPACE_TERMINAL, *terminals]) + "\n"
