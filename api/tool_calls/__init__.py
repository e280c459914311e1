"""Tool calls and reasoning in model output: streaming parsers and the grammars that force calls.

Per reply, the API layer builds a parser with ``create_output_parser`` and feeds it each decoded piece of
output; the ``ParsedDelta``s it returns hold content, reasoning and OpenAI-shaped tool-call fragments.
Markup never reaches content: text that may begin a marker is held back until it is decided.

Grammars (``ToolFormat.grammar``) are llguidance Lark text:
- ``required=True``: the whole reply is one call (several with ``allow_parallel``), from the first token;
- ``required=False``: the lazy grammar of tool_choice "auto": it describes the text right after the
  format's ``lazy_trigger`` (for generic, which has no trigger, the whole reply: a call or a response).
``forced_name`` restricts the calls to one function; arguments follow each tool's JSON schema.

Formats: hermes, qwen3_coder, llama3_json, mistral, generic (see each module).

Use, per request::

    fmt = get_format(name) if name else detect_format(template_source)
    parser = create_output_parser(fmt, tools, reasoning=detect_reasoning(template_source),
                                  starts_in_reasoning=prompt_opens_reasoning(prompt_text, tags))
    for piece in decoded_pieces:
        delta = parser.feed(piece)      # ParsedDelta: content, reasoning, tool_calls fragments
    delta = parser.finish()             # whatever was held back (a cut-off call, a half marker)
"""
from api.tool_calls.base import (
    OutputParser,
    ParsedDelta,
    PlainContentParser,
    ToolCallDelta,
    ToolFormat,
    function_specs,
    new_call_id,
)
from api.tool_calls.reasoning import ReasoningSplitter, ReasoningTags, detect_reasoning, prompt_opens_reasoning
from api.tool_calls.registry import FORMATS, create_output_parser, detect_format, get_format

__all__ = [
    "FORMATS",
    "OutputParser",
    "ParsedDelta",
    "PlainContentParser",
    "ReasoningSplitter",
    "ReasoningTags",
    "ToolCallDelta",
    "ToolFormat",
    "create_output_parser",
    "detect_format",
    "detect_reasoning",
    "function_specs",
    "get_format",
    "new_call_id",
    "prompt_opens_reasoning",
]
