"""The tools a request offers and the tool choice it makes, normalised once for every dialect.

Clients send more than plain function tools: Codex sends ``custom`` freeform tools (one text input, often
with a Lark grammar) and built-in tools such as ``web_search``; some send the Responses API's flat shape
(``{"type": "function", "name": ...}``) on chat completions. Agents stop working when a server refuses
these, so: a function tool is used as it is, a custom tool becomes a function with one string argument
``input`` (the call's ``input`` is that string), and a tool without any schema we could render is left
out with one log line naming it, never a 400.

The normalised list is what the chat template (or the generic system prompt) renders, so it must be a
pure function of the request: same tools in, byte-identical tools out, turn after turn.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from api.errors import bad_request

log = logging.getLogger("strata.api")

CUSTOM_INPUT_ARGUMENT = "input"  # the one argument of a custom (freeform) tool rendered as a function
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpecs:
    """A request's usable tools (OpenAI chat shape), its choice and the names of the custom ones.

    mode: "none" | "auto" | "required"; forced_name is set when the choice names one function
    (mode is then "required"); allow_parallel is parallel_tool_calls, None when the request did not say
    (then the format's `parallel_by_default` applies).
    """

    tools: list[dict[str, Any]]
    mode: str = "auto"
    forced_name: str | None = None
    allow_parallel: bool | None = None
    custom_names: frozenset[str] = frozenset()

    @property
    def calls_possible(self) -> bool:
        return bool(self.tools) and self.mode != "none"


def _function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if isinstance(parameters, dict) else dict(_EMPTY_PARAMETERS)
    return {"type": "function", "function": function}


def _custom_as_function(tool: dict[str, Any]) -> dict[str, Any]:
    description = tool.get("description") or ""
    fmt = tool.get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("definition"):
        # The grammar stays with the client; the model is told what the input must follow.
        description = (description + f"\nThe input must follow this {fmt.get('syntax', 'grammar')} grammar:\n"
                       + str(fmt["definition"])).strip()
    parameters = {"type": "object", "properties": {CUSTOM_INPUT_ARGUMENT: {"type": "string"}},
                  "required": [CUSTOM_INPUT_ARGUMENT]}
    return _function_tool(tool["name"], description, parameters)


def normalise_tool(index: int, tool: Any) -> tuple[dict[str, Any] | None, bool]:
    """(the tool as a chat-shape function tool or None to leave out, whether it was a custom tool)."""
    if not isinstance(tool, dict):
        raise bad_request(f"tools[{index}] must be an object", param=f"tools.{index}")
    kind = tool.get("type", "function")
    if kind == "function":
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool  # chat or flat shape
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{index}] needs a function name", param=f"tools.{index}.function.name")
        return _function_tool(name, function.get("description"), function.get("parameters")), False
    if kind == "custom" and isinstance(tool.get("name"), str) and tool["name"]:
        return _custom_as_function(tool), True
    log.info("tool %d of type %r has no function schema to render; it is left out of the prompt", index, kind,
             extra={"fields": {"tool_type": kind, "tool_index": index}})
    return None, False


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        return value, None
    function = value.get("function") if isinstance(value.get("function"), dict) else value
    name = function.get("name")
    if value.get("type") not in ("function", "custom", None) or not isinstance(name, str):
        if value.get("type") in ("auto", "none", "required"):  # {"type": "auto"} (Anthropic-style object)
            return value["type"], None
        raise bad_request("tool_choice object must name a function: {'type': 'function', 'function': {'name': ...}}",
                          param="tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools: {', '.join(names) or '(none)'}",
                          param="tool_choice")
    return "required", name


def normalise_tools(tools: list[Any] | None, tool_choice: Any = None,
                    parallel_tool_calls: bool | None = None) -> ToolSpecs:
    """Normalise a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; raises APIError 400 for a
    choice that cannot be honoured (a named function that is not offered, ``required`` with no tools)."""
    usable, custom = [], set()
    for index, tool in enumerate(tools or []):
        spec, is_custom = normalise_tool(index, tool)
        if spec is not None:
            usable.append(spec)
            if is_custom:
                custom.add(spec["function"]["name"])
    names = [t["function"]["name"] for t in usable]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"two tools are named {duplicate!r}; tool names must be unique", param="tools")
    mode, forced = _choice(tool_choice, names)
    if mode == "required" and not usable:
        raise bad_request("tool_choice requires a tool call but the request offers no usable tools",
                          param="tool_choice")
    return ToolSpecs(usable, mode, forced, parallel_tool_calls, frozenset(custom))
