"""Grammar-constrained decoding (engine/grammar.py): llguidance tokenizers from GGUF vocabularies, JSON schema
and lark constraints driven token by token, lazy (triggered) constraints, the background mask, the engine loop."""
import asyncio
import json
import threading

import numpy as np
import pytest

from engine.grammar import GrammarCompiler, GrammarError, TokenConstraint, json_object_grammar, json_schema_grammar
from engine.sampling import Sampler, SamplingParams, allowed_tokens
from engine.sequence import ModelRunner
from engine.tokenizer import Tokenizer
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from tests.support.tokenizer_fields import gpt2_fields, spm_fields

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"kind": {"const": "cat"}},
                                             "required": ["kind"], "additionalProperties": False}]},
    },
    "required": ["name", "age", "tags", "ok", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return Tokenizer.from_gguf_path(str(smollm2_path))


@pytest.fixture(scope="module")
def compiler(smol):
    return GrammarCompiler(smol)


@pytest.fixture(scope="module")
def qwen_like():
    """A byte-level BPE vocabulary with Qwen's layout of specials: CONTROL <|im_end|> (EOS), USER_DEFINED
    <tool_call> / </tool_call>, an UNUSED pad, and one multi-character token that can complete a trigger."""
    fields = gpt2_fields(pre="qwen2")
    extra = [("<tool_call>", 4), ("</tool_call>", 4), ("[PAD0]", 5), ('>{"', 1)]
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"] + [t for t, _ in extra]
    fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"] + [ty for _, ty in extra]
    fields["tokenizer.ggml.eos_token_id"] = 2
    return Tokenizer.from_gguf_fields(fields)


def _bias(tokenizer: Tokenizer) -> np.ndarray:
    """A random "model" that likes JSON punctuation, so random replies end well within the step limit."""
    bias = np.zeros(tokenizer.vocab_size, dtype=np.float32)
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_piece(i)
        if piece and all(c in b'"{}[],:0123456789' for c in piece):
            bias[i] = 4.0
    return bias


def _drive(constraint: TokenConstraint, tokenizer: Tokenizer, sampler: Sampler, rng, bias=None, steps=600):
    """Sample token by token as the engine does; returns (token ids, how it ended)."""
    ids = []
    for _ in range(steps):
        constraint.begin_mask()
        logits = rng.standard_normal(tokenizer.vocab_size).astype(np.float32) * 3
        if bias is not None:
            logits += bias
        token = sampler.sample(logits, constraint.mask())
        if token in tokenizer.eos_ids:
            return ids, "eos"
        ids.append(token)
        constraint.accept(token)
        if constraint.is_finished:
            return ids, "finished"
    return ids, "steps"


def _text(tokenizer, ids) -> str:
    return b"".join(tokenizer.token_piece(i) for i in ids).decode()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_json_schema_replies_from_random_logits_always_validate(smol, compiler, temperature):
    grammar, bias = json_schema_grammar(SCHEMA), _bias(smol)
    for seed in range(6):
        rng = np.random.default_rng(seed)
        ids, end = _drive(compiler.constraint(grammar), smol, Sampler(SamplingParams(temperature=temperature,
                                                                                       seed=seed)), rng, bias)
        assert end == "finished", _text(smol, ids)  # complete: the reply ends without an EOS step
        jsonschema.validate(json.loads(_text(smol, ids)), SCHEMA)


def test_json_object_replies_parse_as_objects(smol, compiler):
    grammar, bias = json_object_grammar(), _bias(smol) * 1.5
    for seed in range(4):
        ids, end = _drive(compiler.constraint(grammar), smol, Sampler(SamplingParams(seed=seed)),
                          np.random.default_rng(seed), bias, steps=1500)
        assert end == "finished"
        assert isinstance(json.loads(_text(smol, ids)), dict)


def test_lark_choice_finishes_and_eos_is_allowed_exactly_when_the_grammar_is_complete(smol, compiler):
    for seed in range(5):
        constraint = compiler.constraint('start: "yes" | "no"')
        first = allowed_tokens(constraint.mask(), smol.vocab_size)
        assert not any(first[i] for i in smol.eos_ids)  # nothing written yet: the reply cannot end
        ids, end = _drive(constraint, smol, Sampler(SamplingParams(seed=seed)), np.random.default_rng(seed))
        assert end == "finished" and constraint.is_finished and _text(smol, ids) in ("yes", "no")
        assert {i for i in np.flatnonzero(allowed_tokens(constraint.mask(), smol.vocab_size))} <= smol.eos_ids

    constraint = compiler.constraint('start: "a" | "ab"')  # after "a" the grammar may end or go on
    constraint.accept(smol.encode("a", add_special=False)[0])
    allowed = allowed_tokens(constraint.mask(), smol.vocab_size)
    assert not constraint.is_finished
    assert all(allowed[i] for i in smol.eos_ids) and allowed[smol.encode("b", add_special=False)[0]]


def test_bad_grammars_raise_grammar_error_naming_the_problem(compiler):
    unsupported = json_schema_grammar({"type": "object", "propertyNames": {"pattern": "^a"}})
    for call in (compiler.check, compiler.constraint):
        with pytest.raises(GrammarError, match="propertyNames") as info:
            call(unsupported)
        assert "| start:" not in str(info.value)  # no llguidance source excerpt of the generated lark
    with pytest.raises(GrammarError, match="Invalid type: strin"):
        compiler.check(json_schema_grammar({"type": "strin"}))
    with pytest.raises(GrammarError, match="look-around"):
        compiler.check(json_schema_grammar({"type": "string", "pattern": "(?<=a)b"}))
    with pytest.raises(GrammarError, match='unknown name: "nope"'):
        compiler.check('start: "yes" | nope')
    with pytest.raises(GrammarError, match="must be an object"):
        json_schema_grammar(["not", "a", "schema"])
    compiler.check(json_schema_grammar({"type": "object", "propertyNames": {"pattern": "^a"}}, strict=False))
    assert isinstance(compiler.constraint(json_object_grammar()), TokenConstraint)


def test_lazy_constraint_is_inactive_until_the_trigger_spelled_over_tokens_then_constrains(smol, compiler):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    grammar = 'start: "\\n" %json' + json.dumps(schema) + ' "\\n</tool_call>"'
    prefix = smol.encode("Let me look that up. <tool_call>\n", add_special=False)
    assert len(prefix) > 3 and smol.token_to_id("<tool_call>") is None  # SmolLM2 spells it over tokens
    for seed in range(3):
        constraint = compiler.constraint(grammar, lazy_trigger="<tool_call>")
        ids = []
        for token in prefix:
            assert constraint.is_active == ("<tool_call>" in _text(smol, ids))
            if not constraint.is_active:
                constraint.begin_mask()  # a no-op before the trigger
                assert constraint.mask() is None
            constraint.accept(token)
            ids.append(token)
        assert constraint.is_active and constraint.mask() is not None
        rest, end = _drive(constraint, smol, Sampler(SamplingParams(seed=seed)), np.random.default_rng(seed),
                           _bias(smol))
        assert end == "finished"
        text = _text(smol, ids + rest)
        after = text[text.index("<tool_call>") + len("<tool_call>"):]
        assert after.startswith("\n") and after.endswith("\n</tool_call>")
        jsonschema.validate(json.loads(after[1:-len("\n</tool_call>")]), schema)


def test_lazy_trigger_as_one_user_defined_token_and_the_text_after_it_in_the_same_token(qwen_like):
    compiler = GrammarCompiler(qwen_like)
    ll = compiler.prepare()
    tool_call = qwen_like.token_to_id("<tool_call>")
    assert not ll.is_special_token(tool_call)  # USER_DEFINED: plain bytes, grammar text can match it
    assert ll.is_special_token(qwen_like.token_to_id("<|im_start|>"))  # CONTROL: never grammar text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    grammar = "start: %json" + json.dumps(schema)

    one = compiler.constraint(grammar, lazy_trigger="<tool_call>")
    one.accept(qwen_like.encode("hi ", add_special=False)[0])
    assert not one.is_active
    one.accept(tool_call)  # the whole trigger in one token, nothing after it
    assert one.is_active
    allowed = np.flatnonzero(allowed_tokens(one.mask(), qwen_like.vocab_size))
    assert [qwen_like.token_piece(i) for i in allowed] == [b"{"]

    split = compiler.constraint(grammar, lazy_trigger="<tc>")
    for token in qwen_like.encode("<tc", add_special=False):
        split.accept(token)
    split.accept(qwen_like.token_to_id('>{"'))  # completes the trigger and carries '{"' after it
    assert split.is_active and not split.is_finished
    allowed = np.flatnonzero(allowed_tokens(split.mask(), qwen_like.vocab_size))
    assert [qwen_like.token_piece(i) for i in allowed] == [b"n"]  # '{"' was consumed: the key comes next
    ids, end = _drive(split, qwen_like, Sampler(SamplingParams(seed=0)), np.random.default_rng(0))
    assert end == "finished"
    jsonschema.validate(json.loads('{"' + _text(qwen_like, ids)), schema)

    broken = compiler.constraint('start: "yes"', lazy_trigger="<tc>")
    for token in qwen_like.encode("<tc", add_special=False):
        broken.accept(token)
    broken.accept(qwen_like.token_to_id('>{"'))  # '{"' does not fit "yes": the reply ends
    assert broken.is_finished
    assert set(np.flatnonzero(allowed_tokens(broken.mask(), qwen_like.vocab_size))) <= qwen_like.eos_ids


def test_special_tokens_never_match_grammar_text_but_user_defined_ones_do(qwen_like):
    compiler = GrammarCompiler(qwen_like)
    allowed = allowed_tokens(compiler.constraint('start: "<|im_start|>x"').mask(), qwen_like.vocab_size)
    assert not allowed[qwen_like.token_to_id("<|im_start|>")] and allowed[qwen_like.encode("<", add_special=False)[0]]
    allowed = allowed_tokens(compiler.constraint('start: "<tool_call>x"').mask(), qwen_like.vocab_size)
    assert allowed[qwen_like.token_to_id("<tool_call>")]
    assert not allowed[qwen_like.token_to_id("[PAD0]")]  # UNUSED: no bytes, never allowed


def test_sentencepiece_vocabulary():
    tok = Tokenizer.from_gguf_fields(spm_fields())
    compiler = GrammarCompiler(tok)
    ll = compiler.prepare()
    for text in ("hello world", " hello", "héllo\nworld"):  # forced text is spelled with no SPM space prefix
        assert ll.decode_bytes(ll.tokenize_str(text)) == text.encode()
    assert ll.is_special_token(0) and ll.is_special_token(2) and not ll.is_special_token(4)  # <unk>, </s>; "\n"
    for seed in range(3):
        constraint = compiler.constraint('start: "hello world" | "world"')
        ids, end = _drive(constraint, tok, Sampler(SamplingParams(seed=seed)), np.random.default_rng(seed))
        assert end == "finished" and _text(tok, ids) in ("hello world", "world")


def test_mask_begun_in_the_background_equals_the_synchronous_one(smol, compiler, monkeypatch):
    grammar, bias = json_schema_grammar(SCHEMA), _bias(smol)
    ids, _ = _drive(compiler.constraint(grammar), smol, Sampler(SamplingParams(seed=3)), np.random.default_rng(3), bias)
    background, synchronous = compiler.constraint(grammar), compiler.constraint(grammar)
    threads = set()
    real = TokenConstraint._compute

    def spy(self):
        threads.add(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(TokenConstraint, "_compute", spy)
    for token in ids:
        background.begin_mask()
        background.begin_mask()  # a second call while one is pending is a no-op
        assert np.array_equal(background.mask(), synchronous.mask())
        background.accept(token)
        synchronous.accept(token)
    assert background.is_finished and synchronous.is_finished
    assert any(name.startswith("strata-grammar") for name in threads)


# -- the engine loop --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("llama", seed=3, n_ctx=512)


async def _collect(stream):
    text, tokens, last = "", [], None
    async for delta in stream:
        text += delta.text
        tokens += delta.token_ids
        last = delta
    return text, tokens, last


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_loop_request_with_a_constraint_finishes_with_text_matching_the_grammar(tiny, temperature,
                                                                                      monkeypatch):
    model, tokenizer = tiny
    compiler = GrammarCompiler(tokenizer)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    grammars = {"choice": 'start: "yes" | "no"', "schema": json_schema_grammar(schema)}
    begun = []
    real = TokenConstraint.begin_mask

    def spy(self):
        begun.append(self)
        real(self)

    async def main():
        loop = EngineLoop(ModelRunner(model, 256, 4), tokenizer, num_slots=4, prefill_chunk=8, max_queue=8)
        loop.start()
        requests = {}
        for i, (name, grammar) in enumerate(grammars.items()):
            for k in range(2):  # prompts long enough for several prefill chunks, beside plain requests
                prompt = list(np.random.default_rng(10 * i + k).integers(3, 250, size=12 + 9 * k))
                params = SamplingParams(temperature=temperature, seed=k, max_tokens=800)
                requests[(name, k)] = Request(f"{name}{k}", [int(t) for t in prompt], params,
                                              constraint=compiler.constraint(grammar))
        plain = Request("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        results = await asyncio.gather(*[_collect(loop.submit(r)) for r in [*requests.values(), plain]])
        await loop.shutdown(1)
        return dict(zip([*requests, "plain"], results))

    monkeypatch.setattr(TokenConstraint, "begin_mask", spy)
    results = asyncio.run(main())
    for (name, _), (text, tokens, last) in ((k, v) for k, v in results.items() if k != "plain"):
        assert last.finish_reason == "stop", text
        assert tokens and tokenizer.eos_ids.isdisjoint(tokens)  # ended by the grammar, not by an EOS step
        assert text == tokenizer.decode(tokens)
        if name == "choice":
            assert text in ("yes", "no")
        else:
            jsonschema.validate(json.loads(text), schema)
    assert results["plain"][2].finish_reason == "length" and len(results["plain"][1]) == 20
    constrained_tokens = sum(len(tokens) for key, (_, tokens, _) in results.items() if key != "plain")
    assert len(begun) == constrained_tokens  # one mask begun per sampled token, none for prompt chunks
