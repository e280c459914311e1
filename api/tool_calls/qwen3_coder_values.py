"""Qwen3-Coder parameter values: typing the plain-text values by the tool's schema, and their grammar rules.

The model writes every value as text; the tool's JSON schema says what it means. integer, number and
boolean are parsed, object and array parsed as JSON (or as a Python literal, which models also write),
string kept as text; a parameter the schema does not describe is tried as JSON, else kept as a string.
A value that does not parse as its type is kept as the string the model wrote, never dropped.
"""
from __future__ import annotations

import ast
import json
from typing import Any, Mapping

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import parameters_schema

_SCALAR_GRAMMAR_TYPES = ("integer", "number", "boolean", "object", "array")


def property_types(schema: Mapping | None, key: str) -> set[str] | None:
    """The JSON types the schema allows for property ``key``; None when it does not say."""
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    prop = properties.get(key) if isinstance(properties, Mapping) else None
    if not isinstance(prop, Mapping):
        return None
    declared = prop.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list) and all(isinstance(item, str) for item in declared):
        return set(declared) or None
    types: set[str] = set()
    for alternative in prop.get("anyOf") or prop.get("oneOf") or []:
        if not isinstance(alternative, Mapping) or not isinstance(alternative.get("type"), str):
            return None  # an alternative without a plain type: the schema does not pin the value down
        types.add(alternative["type"])
    return types or None


def is_plain_string(types: set[str] | None) -> bool:
    """True when the value can only be a string, so it may be streamed as it arrives."""
    return types == {"string"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json_loads(text: str) -> Any:
    """``json.loads`` without Python's NaN/Infinity extension: the result must dump back to valid JSON."""
    return json.loads(text, parse_constant=_reject_constant)


def _parse_number(text: str, integer_only: bool) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None  # NaN and infinities have no JSON form
    if integer_only:
        return int(value) if value.is_integer() else None  # "3.0" for an integer is 3
    return value


def _parse_structured(text: str, wanted: type) -> Any:
    for parse in (strict_json_loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            continue
        if isinstance(value, wanted):
            return value
    return None


def convert_value(text: str, types: set[str] | None) -> Any:
    """The JSON value of a parameter written as ``text``, given the types its schema allows."""
    stripped = text.strip()
    if types is None:
        try:
            return strict_json_loads(stripped)
        except ValueError:
            return text
    if "null" in types and stripped.lower() in ("null", "none"):
        return None
    if "integer" in types or "number" in types:
        number = _parse_number(stripped, integer_only="number" not in types)
        if number is not None:
            return number
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    for name, wanted in (("object", dict), ("array", list)):
        if name in types:
            value = _parse_structured(stripped, wanted)
            if value is not None:
                return value
    return text


def _value_rule(types: set[str] | None, prop_schema: Any) -> str:
    """The grammar of one parameter's value, up to and including ``</parameter>``."""
    typed = types is not None and len(types) == 1 and next(iter(types)) in _SCALAR_GRAMMAR_TYPES
    # sub-schemas with references cannot be compiled on their own: fall back to free text
    if typed and isinstance(prop_schema, Mapping) and "$ref" not in json.dumps(prop_schema):
        return f'WS? %json {g.schema_json(g.closed_schema(prop_schema))} WS? "</parameter>"'
    return "parameter_text"


def function_block_rules(functions: list[dict]) -> list[str]:
    """Rules for ``function_block``: ``<function=NAME>`` then any of that function's parameters, then ``</function>``.

    Which parameters are required is not enforced (that would need every order of them); each value is free
    text, or JSON of the declared type for integer/number/boolean/object/array parameters.
    """
    rules = [
        "function_block: " + " | ".join(f"fn_{number}" for number in range(len(functions))),
        # lazy: the shortest text that ends with the closing tag, so the value cannot swallow it
        r"parameter_text[lazy]: /(.|\n)*<\/parameter>/",
    ]
    for number, function in enumerate(functions):
        schema = parameters_schema(function)
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        params = []
        for key_number, key in enumerate(properties):
            rule = f"p_{number}_{key_number}"
            params.append(rule)
            value = _value_rule(property_types(schema, key), properties[key])
            rules.append(f"{rule}: {g.literal(f'<parameter={key}>')} {value} WS?")
        if not params:  # no declared properties: any parameter name, free text
            params.append(f"p_{number}_any")
            rules.append(f'p_{number}_any: "<parameter=" /[^>\\n]+/ ">" parameter_text WS?')
        body = f"({' | '.join(params)})* "
        rules.append(f"fn_{number}: {g.literal('<function=' + function['name'] + '>')} WS? {body}\"</function>\"")
    return rules
