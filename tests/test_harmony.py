"""gpt-oss's harmony format: channels to reasoning / content / tool calls under every split of the output,
detection from the template, the grammars for forced calls, and <|end|> not ending generation."""
from __future__ import annotations

import llguidance
import pytest

from api.tool_calls import create_output_parser, detect_format, get_format
from api.tool_calls.harmony import HarmonyParser
from engine.tokenizer import Tokenizer
from tests.support.tiny_moe_gguf import HARMONY_TEMPLATE, HARMONY_TOKENS, write_tiny_moe_gguf
from tests.support.tool_streams import SPLITS, TOOLS, byte_tokens, feed, joined

ARGS = '{"city": "Paris", "days": 2}'
CASES = [  # (name, model output after "<|start|>assistant", content, reasoning, [(name, arguments)])
    ("analysis_then_final",
     "<|channel|>analysis<|message|>User asks the time. Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
     "It is noon.<|return|>", "It is noon.", "User asks the time. Easy.", []),
    ("analysis_then_call",
     "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>", "", "Need the weather.",
     [("get_weather", ARGS)]),
    ("recipient_before_channel",
     f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>", "", "",
     [("get_weather", ARGS)]),
    ("recipient_right_after_the_prompts_role",
     f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>", "", "", [("get_weather", ARGS)]),
    ("preamble_then_call",
     "<|channel|>commentary<|message|>Checking the forecast now.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>", "Checking the forecast now.", "",
     [("get_weather", ARGS)]),
    ("final_only_without_terminator", "<|channel|>final<|message|>Hello <there> |x|", "Hello <there> |x|", "", []),
    ("no_harmony_markup", "Just text, with <b>tags</b>.", "Just text, with <b>tags</b>.", "", []),
    ("body_without_end_before_next_start",
     "<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>done", "done", "think", []),
    ("cut_inside_a_header", "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|chan",
     "<|start|>assistant<|chan", "hm", []),
]


@pytest.mark.parametrize("name,text,content,reasoning,calls", CASES, ids=[c[0] for c in CASES])
def test_channels_map_to_content_reasoning_and_tool_calls_under_every_split(name, text, content, reasoning, calls):
    for split in SPLITS:
        parser = get_format("harmony").create_parser(TOOLS)
        got_content, got_reasoning, got_calls = joined(feed(parser, split(text)))
        assert (got_content, got_reasoning) == (content, reasoning), split
        assert [(c["name"], c["arguments"]) for c in got_calls] == calls
        assert parser.num_tool_calls == len(calls)


def test_arguments_and_reasoning_stream_before_their_message_ends():
    parser = HarmonyParser()
    first = parser.feed("<|channel|>analysis<|message|>Let me ")
    assert first.reasoning == "Let me " and not first.content
    second = parser.feed("see<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>"
                         'json<|message|>{"query": "he')
    assert second.reasoning == "see"
    assert [(c.index, c.name, c.arguments) for c in second.tool_calls] == [(0, "search", '{"query": "he')]
    third = parser.feed('llo"}<|ca')
    assert [(c.id, c.name, c.arguments) for c in third.tool_calls] == [(None, None, 'llo"}')]
    last = parser.finish()  # the held "<|ca" never became a terminator: it was text after all, not lost
    assert [(c.index, c.arguments) for c in last.tool_calls] == [(0, "<|ca")]


def test_the_template_picks_harmony_and_its_parser_runs_without_tools_or_a_reasoning_splitter():
    assert detect_format(HARMONY_TEMPLATE).name == "harmony"
    assert detect_format("{% for m in messages %}<|start|>{{ m.role }}<|channel|>{% endfor %}").name == "harmony"
    parser = create_output_parser(get_format("harmony"), None, reasoning=None, starts_in_reasoning=False)
    assert isinstance(parser, HarmonyParser)


def test_end_is_not_end_of_generation_when_return_and_call_exist(tmp_path):
    write_tiny_moe_gguf(tmp_path / "h.gguf", "gpt-oss", harmony=True)
    from engine.gguf_file import GGUFFile

    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(tmp_path / "h.gguf").fields)
    eog = {tokenizer.id_to_token(i) for i in tokenizer.eos_ids}
    assert {"<|return|>", "<|call|>"} <= eog and "<|end|>" not in eog


class _HarmonyByteTokenizer:
    """One token per byte plus harmony's control tokens, so grammars are checked on special-token ids."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [t.encode() for t in HARMONY_TOKENS]
        self.eos_token_id, self.bos_token_id = 256 + HARMONY_TOKENS.index("<|return|>"), None
        self.special_token_ids = list(range(256, 256 + len(HARMONY_TOKENS)))

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


SPECIALS = {token: 256 + i for i, token in enumerate(HARMONY_TOKENS)}
TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_HarmonyByteTokenizer()))


def _accepts(grammar: str, text: str) -> bool:
    compiled = llguidance.grammar_from("lark", grammar)
    assert llguidance.LLMatcher.validate_grammar(compiled, TOKENIZER) == ""
    matcher = llguidance.LLMatcher(TOKENIZER, compiled, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(byte_tokens(text, SPECIALS)) and matcher.is_accepting()


CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"


def test_required_grammar_takes_optional_analysis_then_one_call_of_a_known_function():
    grammar = get_format("harmony").grammar(TOOLS, required=True, forced_name=None, allow_parallel=False,
                                            special_token_ids=SPECIALS)
    assert _accepts(grammar, CALL)
    assert _accepts(grammar, "<|channel|>analysis<|message|>Weather, so call it.<|end|><|start|>assistant" + CALL)
    assert not _accepts(grammar, CALL.replace("get_weather", "get_wether"))
    assert not _accepts(grammar, CALL.replace(ARGS, '{"city": 3}'))  # the schema says city is a string
    forced = get_format("harmony").grammar(TOOLS, required=True, forced_name="search", allow_parallel=False,
                                           special_token_ids=SPECIALS)
    assert not _accepts(forced, CALL)


def test_lazy_grammar_continues_the_trigger_with_a_call():
    fmt = get_format("harmony")
    grammar = fmt.grammar(TOOLS, required=False, forced_name=None, allow_parallel=False, special_token_ids=SPECIALS)
    assert fmt.lazy_trigger in CALL
    assert _accepts(grammar, CALL[CALL.index(fmt.lazy_trigger) + len(fmt.lazy_trigger):])


def test_gpt_oss_pre_tokenizer_splits_as_o200k(tmp_path):
    """tokenizer.ggml.pre = gpt-4o (every gpt-oss GGUF): llama.cpp's o200k split, words with their case runs."""
    from engine.gguf_file import GGUFFile

    write_tiny_moe_gguf(tmp_path / "h.gguf", "gpt-oss", harmony=True)
    fields = dict(GGUFFile(tmp_path / "h.gguf").fields, **{"tokenizer.ggml.pre": "gpt-4o"})
    tokenizer = Tokenizer(fields)
    pieces = [p for p, _ in tokenizer._hf.pre_tokenizer.pre_tokenize_str("Hello World's HTTPServer 12345")]
    assert pieces == ["Hello", "\u0120World's", "\u0120HTTPServer", "\u0120", "123", "45"]
    text = "Hi <|channel|>final<|message|>x"
    assert tokenizer.decode(tokenizer.encode(text, add_special=False)) == text
