"""Tool calls recovered from the JSON shapes models write outside their markup (api/tool_calls/recovery.py,
recovered_call.py): calls in every spelling and any streaming split, ordinary JSON answers left as content."""
import json

import pytest

from api.tool_calls import create_output_parser, get_format
from api.tool_calls.recovered_call import answered_calls, call_from_object, recovery_trigger, restatement_stops
from engine.sampling import allowed_tokens

READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}
TOOLS = [READ, WRITE]
FUNCTIONS = {"read_file": READ["function"], "write_file": WRITE["function"]}
CALL = '{"name": "read_file", "arguments": {"path": "note.txt"}}'


def parse(text: str, split: int | None = None, tools=TOOLS, answered=frozenset()):
    """(content, [(name, arguments)], recovered shapes) of ``text`` fed in pieces of ``split`` characters,
    checking on the way that content only ever grows as a prefix of the final content."""
    shapes = []
    parser = create_output_parser(get_format("hermes"), tools, reasoning=None, starts_in_reasoning=False,
                                  recover_calls=True, on_recovered=shapes.append, answered_calls=answered)
    pieces = [text] if split is None else [text[i:i + split] for i in range(0, len(text), split)]
    content, calls = "", {}
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, [call.name, ""])
            entry[1] += call.arguments
    assert parser.num_tool_calls == len(calls)
    return content, [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))], shapes


@pytest.mark.parametrize("split", [None, 1, 2, 3, 7])
@pytest.mark.parametrize("text,shape", [
    (CALL, "bare"),
    ("\n  " + CALL + "\n", "bare"),
    ("```json\n" + CALL + "\n```", "fenced"),
    ("```json\n{\n  \"name\": \"read_file\",\n  \"arguments\": {\n    \"path\": \"note.txt\"\n  }\n}\n```\n", "fenced"),
    ("```\n" + CALL + "\n```", "fenced"),
    ('{ "name" : "read_file", "parameters": { "path": "note.txt" } }', "bare"),
    ('{"name": "read_file", "arguments": "{\\"path\\": \\"note.txt\\"}"}', "bare"),
    ('{"type": "function", "function": {"name": "read_file", "arguments": {"path": "note.txt"}}}',
     "bare function-wrapper"),
    ('```json\n{"function": {"name": "read_file", "arguments": {"path": "note.txt"}}}\n```',
     "fenced function-wrapper"),
    ('{"type": "function", "name": "read_file", "arguments": {"path": "note.txt"}}', "bare"),
])
def test_a_call_alone_is_recovered_in_any_split(text, shape, split):
    content, calls, shapes = parse(text, split)
    assert (content, calls, shapes) == ("", [("read_file", {"path": "note.txt"})], [shape])


@pytest.mark.parametrize("split", [None, 1, 4])
def test_text_before_and_after_a_fenced_call_stays_content(split):
    text = "I will read the file first.\n\n```json\n" + CALL + "\n```\n\nThen I answer."
    content, calls, _ = parse(text, split)
    assert calls == [("read_file", {"path": "note.txt"})]
    assert content == "I will read the file first.\n\n\nThen I answer."  # the blank line before the block went with it


@pytest.mark.parametrize("split", [None, 1])
def test_two_calls_in_one_block_and_a_hermes_call_are_numbered_in_one_sequence(split):
    second = '{"name": "write_file", "arguments": {"path": "out.txt", "content": "42"}}'
    text = ("```json\n" + CALL + "\n" + second + "\n```\n<tool_call>\n" + CALL + "\n</tool_call>")
    content, calls, shapes = parse(text, split)
    assert content == ""
    assert calls == [("read_file", {"path": "note.txt"}), ("write_file", {"path": "out.txt", "content": "42"}),
                     ("read_file", {"path": "note.txt"})]
    assert shapes == ["fenced", "fenced"]


def test_a_block_whose_closing_fence_never_came_is_still_a_call():
    assert parse("```json\n" + CALL + "\n")[1] == [("read_file", {"path": "note.txt"})]


@pytest.mark.parametrize("split", [None, 1, 5])
@pytest.mark.parametrize("text", [
    '{"name": "Alice", "age": 30}',  # a JSON answer the user asked for: names no declared tool
    '```json\n{"name": "Paris", "country": "France"}\n```',
    '{"name": "read_file", "description": "reads a file"}',  # a declared name, but not a call's members
    '{"name": "read_file", "arguments": {"path": 7}}',  # arguments that fail the tool's schema
    '{"name": "read_file", "arguments": {}}',  # a required argument missing
    '{"name": "write_file", "arguments": {"path": "a"}, "extra": 1}',
    'Call it like this: {"name": "read_file", "arguments": {"path": "note.txt"}}',  # mid-line
    '```python\nx = 1\n' + CALL + '\n```',  # inside a block of another language
    '[' + CALL + ']',
    '{"name": "read_file", "arguments": {"path": "note.txt"}',  # cut off before it closed
    '```json\n[1, 2, 3]\n```\n',
    '{"type": "object", "name": "read_file", "arguments": {"path": "x"}}',
    '```',
    '{',
])
def test_json_that_is_not_a_call_stays_content_exactly(text, split):
    content, calls, shapes = parse(text, split)
    assert (content, calls, shapes) == (text, [], [])


def test_a_json_answer_streams_out_before_it_ends():
    """An object that fails a call's shape is released at once, not held to its end."""
    parser = create_output_parser(get_format("hermes"), TOOLS, reasoning=None, starts_in_reasoning=False,
                                  recover_calls=True)
    assert parser.feed('{"city": "Paris", "population"').content == '{"city": "Paris", "population"'
    assert parser.feed('{"name": "x"').content == '{"name": "x"'  # mid-line now: plain text
    held = create_output_parser(get_format("hermes"), TOOLS, reasoning=None, starts_in_reasoning=False,
                                recover_calls=True)
    assert held.feed('```json\n{"name": "read_file", "arguments": {"pa').content == ""


def test_without_recovery_the_call_is_content():
    parser = create_output_parser(get_format("hermes"), TOOLS, reasoning=None, starts_in_reasoning=False)
    assert parser.feed(CALL).content + parser.finish().content == CALL


def test_call_from_object_normalises_every_spelling():
    for value in ({"name": "read_file", "parameters": {"path": "a"}},
                  {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}):
        call = call_from_object(value, FUNCTIONS)
        assert (call.name, call.arguments) == ("read_file", {"path": "a"})
    for value in ({"name": "read_file", "arguments": {"path": "a"}, "parameters": {"path": "a"}},
                  {"function": {"name": "read_file", "arguments": {"path": "a"}}, "name": "read_file"},
                  {"name": "read_file", "arguments": "not json"}, ["read_file"]):
        assert call_from_object(value, FUNCTIONS) is None


@pytest.mark.parametrize("text,name,wrapped,fenced", [
    ('{"name": "read_file", "arguments": ', "read_file", False, False),
    ('Sure.\n```json\n{\n  "name": "write_file",\n  "arguments": ', "write_file", False, True),
    ('{"type": "function", "function": {"name": "read_file", "parameters":', "read_file", True, False),
    ('  { "name" : "read_file" , "arguments" :', "read_file", False, False),
])
def test_the_trigger_finds_a_call_opening_at_a_line_start(text, name, wrapped, fenced):
    match = recovery_trigger(TOOLS).first_match(text.encode())
    assert match is not None and match.end() == len(text.encode())
    assert (match["name"].decode(), bool(match["wrap"]), bool(match["fence"])) == (name, wrapped, fenced)


@pytest.mark.parametrize("text", [
    '{"name": "Alice", "arguments": ',  # no such tool
    'Use {"name": "read_file", "arguments": ',  # mid-line
    '{"name": "read_file", "description": ',
    '```python\n{"name": "read_file", "arguments": ',
])
def test_the_trigger_ignores_what_is_not_a_call_opening(text):
    assert recovery_trigger(TOOLS).first_match(text.encode()) is None


def test_the_trigger_grammar_closes_what_the_opening_began():
    trigger = recovery_trigger(TOOLS)
    plain = trigger.grammar_for(trigger.pattern.search(b'{"name": "read_file", "arguments": '))
    assert plain.startswith('start: WS? args WS? "}"\n') and '"path"' in plain and "TAIL" not in plain
    wrapped = trigger.grammar_for(trigger.pattern.search(b'```json\n{"function": {"name": "read_file", "arguments": '))
    assert wrapped.startswith('start: WS? args WS? "}" WS? "}" (WS? "```")?\n')


@pytest.fixture(scope="module")
def compiler(smollm2_path):
    from engine.grammar import GrammarCompiler
    from engine.tokenizer import Tokenizer

    return GrammarCompiler(Tokenizer.from_gguf_path(str(smollm2_path)))


def _accept_text(constraint, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special=False, parse_special=False):
        mask = constraint.mask()
        assert mask is None or (mask[token // 32] >> (token % 32)) & 1, f"token {token} refused in {text!r}"
        constraint.accept(token)


def test_a_new_recovered_call_is_constrained_to_its_schema_and_ends_the_reply(compiler):
    hermes = get_format("hermes").grammar(TOOLS, required=False, forced_name=None, allow_parallel=False)
    constraint = compiler.constraint(hermes, lazy_trigger="<tool_call>", triggers=(recovery_trigger(TOOLS),))
    _accept_text(constraint, compiler.tokenizer, '{"name": "read_file", "arguments":')
    assert constraint.fired_trigger == "recovered JSON call"
    _accept_text(constraint, compiler.tokenizer, ' {"path": "a.txt"}')
    assert not constraint.is_finished
    _accept_text(constraint, compiler.tokenizer, "}")
    assert constraint.is_finished and not constraint.error


def test_after_a_possible_restatement_the_reply_goes_on_but_not_into_another(compiler):
    hermes = get_format("hermes").grammar(TOOLS, required=False, forced_name=None, allow_parallel=False)
    trigger = recovery_trigger(TOOLS, answered_names=frozenset({"read_file"}))
    constraint = compiler.constraint(hermes, lazy_trigger="<tool_call>", triggers=(trigger,))
    _accept_text(constraint, compiler.tokenizer, 'Let me look.\n{"name": "read_file", "parameters":')
    assert constraint.is_active and constraint.fired_trigger == "recovered JSON call"
    _accept_text(constraint, compiler.tokenizer, ' {"path": "a.txt"}')
    tokenizer = compiler.tokenizer
    eos = tokenizer.eos_id
    assert not allowed_tokens(constraint.mask(), tokenizer.vocab_size)[eos]  # the object's own "}" is owed
    _accept_text(constraint, tokenizer, "}")
    allowed = allowed_tokens(constraint.mask(), tokenizer.vocab_size)
    assert allowed[eos] and allowed.sum() > 0.99 * tokenizer.vocab_size  # the call is whole: end, or go on
    _accept_text(constraint, tokenizer, '\n{"answer": 42} and some text')
    assert not constraint.is_finished and not constraint.error



def test_json_that_is_no_call_leaves_the_reply_free(compiler):
    hermes = get_format("hermes").grammar(TOOLS, required=False, forced_name=None, allow_parallel=False)
    constraint = compiler.constraint(hermes, lazy_trigger="<tool_call>", triggers=(recovery_trigger(TOOLS),))
    _accept_text(constraint, compiler.tokenizer, '{"name": "Alice", "arguments": {"x": [1, 2]}}\n'
                                                 '```python\n{"name": "read_file", "arguments": {}}\n')
    assert not constraint.is_active and constraint.mask() is None


ANSWERED = [{"role": "user", "content": "Read note.txt"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "note.txt"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "The launch code is 7481-ZETA."}]


def test_answered_calls_are_those_whose_results_end_the_prompt():
    assert answered_calls(ANSWERED) == {("read_file", '{"path": "note.txt"}')}
    assert restatement_stops(ANSWERED) == ('\n{"name": "read_file", "arguments": {"path": "note.txt"}}',)
    assert answered_calls(ANSWERED + [{"role": "user", "content": "and now?"}]) == frozenset()
    assert answered_calls(ANSWERED[:2]) == frozenset()  # the call is not answered yet


@pytest.mark.parametrize("split", [None, 1])
def test_restating_the_call_just_answered_is_content_and_the_answer_after_it_too(split):
    text = CALL + '\n{"launch_code": "7481-ZETA"}'
    content, calls, shapes = parse(text, split, answered=answered_calls(ANSWERED))
    assert (content, calls, shapes) == (text, [], [])
    other = '{"name": "read_file", "arguments": {"path": "other.txt"}}'  # a new call is still a call
    assert parse(other, split, answered=answered_calls(ANSWERED))[1] == [("read_file", {"path": "other.txt"})]
