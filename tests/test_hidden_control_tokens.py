"""Control tokens a model writes mid-reply show no text, except the format's markup and reasoning tags.

Found with Claude Code on Qwen2.5-Coder-1.5B: the answer came back as "<|im_start|>" (the model opened a new
turn instead of ending its own); llama-server shows no text for such a token and keeps only a format's
"preserved tokens" (its markup), which the parsers read.
"""

from api.chat_protocol import ChatProtocol
from api.tool_calls import ReasoningTags, get_format
from engine.sampling import SamplingParams
from engine.tokenizer import IncrementalDecoder, Tokenizer
from scheduler.output import OutputProcessor
from scheduler.request import Request
from scheduler.step import StepResult
from tests.support.tokenizer_fields import GPT2_MERGES, byte_chars

MARKUP = ["<tool_call>", "</tool_call>", "<|channel|>", "<|message|>", "<think>", "</think>"]


def _tokenizer() -> Tokenizer:
    """ChatML's control tokens, then every format's markup as control tokens too, the bytes, the merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *MARKUP] + byte_chars() + [a + b for a, b in GPT2_MERGES]
    controls = 3 + len(MARKUP)
    return Tokenizer.from_gguf_fields({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * controls + [1] * (len(tokens) - controls),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in GPT2_MERGES],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2,
    })


def _protocol(tokenizer: Tokenizer, format_name: str, reasoning: ReasoningTags | None) -> ChatProtocol:
    specials = {tokenizer.id_to_token(i): i for i in sorted(tokenizer.special_ids)}
    return ChatProtocol(get_format(format_name), reasoning, None, tokenizer, specials)


def _hidden_texts(protocol: ChatProtocol, tokenizer: Tokenizer) -> set[str]:
    return {tokenizer.id_to_token(i) for i in protocol.hidden_token_ids}


def test_hermes_keeps_its_markup_and_the_reasoning_tags_and_hides_the_other_control_tokens():
    tokenizer = _tokenizer()
    hidden = _hidden_texts(_protocol(tokenizer, "hermes", ReasoningTags()), tokenizer)
    assert hidden == {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|channel|>", "<|message|>"}


def test_harmony_keeps_its_channel_markup_without_reasoning_tags():
    tokenizer = _tokenizer()
    hidden = _hidden_texts(_protocol(tokenizer, "harmony", None), tokenizer)
    assert hidden == {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
                      "</think>"}


def test_generic_format_hides_every_control_token():
    tokenizer = _tokenizer()
    assert _hidden_texts(_protocol(tokenizer, "generic", None), tokenizer) == {
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", *MARKUP}


def test_incremental_decoder_leaves_out_hidden_ids_and_keeps_the_rest():
    tokenizer = _tokenizer()
    start, call = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<tool_call>")
    ids = [*tokenizer.encode("the"), start, call, *tokenizer.encode("he")]
    shown = IncrementalDecoder(tokenizer, hidden_ids=frozenset({start}))
    assert "".join(shown.push(i) for i in ids) == "the<tool_call>he"
    plain = IncrementalDecoder(tokenizer)  # no hidden ids: every control token as its text
    assert "".join(plain.push(i) for i in ids) == "the<|im_start|><tool_call>he"


def test_a_reply_streams_no_text_for_a_hidden_control_token_and_goes_on():
    tokenizer = _tokenizer()
    protocol = _protocol(tokenizer, "hermes", ReasoningTags())
    output = OutputProcessor(tokenizer, hidden_token_ids=protocol.hidden_token_ids)
    request = Request("r", [1, 2], SamplingParams(max_tokens=16))
    reply = [*tokenizer.encode("the"), tokenizer.token_to_id("<|im_start|>"), *tokenizer.encode("he")]
    for token in reply:
        assert output.accept_token(request, StepResult(request, token)) is None
    output.finish(request, "stop")
    deltas = []
    while not request.outbox.empty():
        deltas.append(request.outbox.get_nowait())
    assert "".join(d.text for d in deltas) == "thehe"
    assert request.output_ids == reply  # the token is still the reply's: the cache keeps what the model wrote
