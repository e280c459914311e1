"""Tool calls models write outside their format's markup, as JSON objects: which objects are calls, and the lazy
grammar that constrains such a call's arguments once it has begun.

Tool-trained models often answer a tool request with the call as plain JSON instead of their template's markup
(Qwen2.5-Coder writes ```` ```json ```` fenced blocks nearly always; vLLM issue 32926). Such an object is a call
only when all of this holds, so that ordinary JSON answers stay content:

- it begins a line (the reply's first line, or after a newline), bare or as the first thing in a fenced block
  whose language is empty, ``json``, ``tool_call`` or ``tool_code``;
- its members are a call's and nothing else: ``name`` + ``arguments`` (or ``parameters``), optionally
  ``"type": "function"`` and ``id``, or the same inside ``"function": {...}`` (OpenAI's older spellings);
- ``name`` is one of the request's declared function tools;
- the arguments (an object, or a string holding one) validate against that tool's parameters schema;
- it is not the call the tool results at the end of the prompt just answered, name and arguments alike: small
  models (Qwen2.5-Coder-0.5B) restate that call before answering, and an agent would run it again and again.

Once a new call's object (and its fence) has closed, the reply ends, as after a ``</tool_call>``. A call to a
tool whose results end the prompt may be a restatement, followed by the answer: after it the reply goes on
freely, and the restated call written again on a later line is a stop sequence (``restatement_stops``): the
0.5B model otherwise restates it line after line to the output limit. Masking the restatement instead only
made it write a mangled one (``{"name}: read_file", ...``), line after line.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping

import jsonschema

import api.tool_calls.grammar_parts as g
from api.tool_calls.base import function_specs, parameters_schema
from engine.grammar_triggers import LazyTrigger

log = logging.getLogger("strata.api")

FENCE_LANGUAGES = frozenset({"", "json", "tool_call", "tool_code"})  # compared lower-cased
CALL_KEYS = frozenset({"name", "arguments", "parameters", "type", "function", "id"})
_WRAPPER_KEYS = frozenset({"type", "function", "id"})
_INNER_KEYS = frozenset({"name", "arguments", "parameters"})
TRIGGER_NAME = "recovered JSON call"
_FREE_TAIL = "TAIL: /(?s:.+)/"  # what follows a possibly restated call: anything, the end of the reply allowed


def call_key(name: str, arguments: Any) -> tuple[str, str]:
    """A call's identity: its name and its arguments in one canonical JSON text (a string is parsed first)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    return name, json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def restatement_stops(messages: list[dict]) -> tuple[str, ...]:
    """Stop sequences for a reply after tool results: each answered call as the template writes it (one JSON
    line, json.dumps' spacing), on a new line, i.e. restated a second time."""
    return tuple(sorted("\n" + json.dumps({"name": name, "arguments": json.loads(arguments)}, ensure_ascii=False)
                        for name, arguments in answered_calls(messages)))


def answered_calls(messages: list[dict]) -> frozenset[tuple[str, str]]:
    """The calls (``call_key``) of the assistant message whose tool results end ``messages``; empty when the
    prompt does not end with tool results."""
    end = len(messages)
    while end > 0 and messages[end - 1].get("role") == "tool":
        end -= 1
    if end == len(messages) or end == 0 or messages[end - 1].get("role") != "assistant":
        return frozenset()
    keys = set()
    for call in messages[end - 1].get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            keys.add(call_key(function["name"], function.get("arguments", {})))
    return frozenset(keys)


@dataclass(frozen=True)
class RecoveredCall:
    """A call read from a JSON object: the declared tool's name and its validated arguments."""

    name: str
    arguments: dict[str, Any]
    wrapped: bool  # written in the "function": {...} spelling


def call_from_object(value: Any, functions: Mapping[str, Mapping]) -> RecoveredCall | None:
    """The call ``value`` (a parsed JSON object) spells, or None when it is not one (see the module docstring)."""
    if not isinstance(value, dict) or not value.keys() <= CALL_KEYS:
        return None
    if "type" in value and value["type"] != "function":
        return None
    wrapped = "function" in value
    if wrapped:
        inner = value["function"]
        if not value.keys() <= _WRAPPER_KEYS or not isinstance(inner, dict) or not inner.keys() <= _INNER_KEYS:
            return None
        value = inner
    name = value.get("name")
    if not isinstance(name, str) or name not in functions or ("arguments" in value and "parameters" in value):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a string holding the JSON text
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict) or not arguments_valid(arguments, functions[name]):
        return None
    return RecoveredCall(name, arguments, wrapped)


def arguments_valid(arguments: dict, function: Mapping) -> bool:
    """Whether ``arguments`` validate against the function's parameters schema (a schema that is not valid
    JSON Schema cannot judge them: they pass, and that is logged)."""
    schema = parameters_schema(function)
    try:
        validator_class = jsonschema.validators.validator_for(schema)
        validator_class.check_schema(schema)
    except jsonschema.SchemaError as exc:
        log.debug("tool %s: its parameters are not a valid JSON schema (%s); arguments not checked",
                  function.get("name"), exc.message)
        return True
    return validator_class(schema).is_valid(arguments)


def recovery_trigger(tools: list[dict], answered_names: frozenset[str] = frozenset()) -> LazyTrigger:
    """The lazy trigger of a recovered call: a line that opens a call object naming a declared tool, up to its
    arguments member; the grammar after it is that tool's arguments schema and the object's close, then, for a
    tool in ``answered_names`` (whose results end the prompt), the tail a restatement's answer may take."""
    functions = {spec["name"]: spec for spec in function_specs(tools)}
    names = b"|".join(re.escape(json.dumps(name, ensure_ascii=False)[1:-1].encode()) for name in functions)
    pattern = re.compile(
        rb'^[ \t]*(?P<fence>```[ \t]*(?i:json|tool_call|tool_code)?[ \t]*\r?\n\s*)?'
        rb'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?(?P<wrap>"function"\s*:\s*\{\s*)?'
        rb'"name"\s*:\s*"(?P<name>' + names + rb')"\s*,\s*"(?:arguments|parameters)"\s*:[ \t\r\n]*',
        re.MULTILINE)

    def grammar_for(match: re.Match[bytes]) -> str:
        function = functions[json.loads(b'"' + match["name"] + b'"')]
        close = ' WS? "}"' * (2 if match["wrap"] else 1)
        fence = ' (WS? "```")?' if match["fence"] else ""
        rules = [f"args: %json {g.schema_json(g.arguments_schema(function))}"]
        if function["name"] in answered_names:
            return g.assemble(f"start: WS? args{close}{fence} TAIL?", rules, _FREE_TAIL)
        return g.assemble(f"start: WS? args{close}{fence}", rules)

    return LazyTrigger(pattern, grammar_for, TRIGGER_NAME, accepts=lambda window, match: not inside_foreign_fence(
        window[:match.start()]))


_FENCE_LINE = re.compile(rb"^[ \t]*```[ \t]*([^\n]*?)[ \t]*$", re.MULTILINE)


def inside_foreign_fence(text: bytes) -> bool:
    """Whether ``text`` ends inside a fenced block of a language no call is written in (```python ...)."""
    language: bytes | None = None  # None: outside any block
    for match in _FENCE_LINE.finditer(text):
        language = match[1].lower() if language is None else None
    return language is not None and language.decode(errors="replace") not in FENCE_LANGUAGES
