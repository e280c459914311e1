"""Tests for engine.tokenizer: tiny in-test vocabularies (fast) and the real SmolLM2 / Gemma 3 files."""
import heapq
import os
import random
from pathlib import Path

import pytest
from gguf import GGUFReader

from engine.tokenizer import IncrementalDecoder, Tokenizer
from tests.support.tokenizer_fields import gpt2_fields, spm_fields


NO_PREFIX = {"tokenizer.ggml.add_space_prefix": False}


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.id_to_token(i) for i in ids]


def test_gpt2_roundtrip():
    tok = Tokenizer.from_gguf_fields(gpt2_fields())
    for text in ["the hello", "  two  spaces\n\ttab", "héllo wörld 🤖 日本語", "x = 12*34;", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_gpt2_control_token_matched_whole():
    tok = Tokenizer.from_gguf_fields(gpt2_fields())
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"


def test_gpt2_control_token_left_as_text_without_parse_special():
    tok = Tokenizer.from_gguf_fields(gpt2_fields())
    ids = tok.encode("<|im_start|>", parse_special=False)
    assert 1 not in ids and len(ids) == len("<|im_start|>")
    assert tok.decode(ids) == "<|im_start|>"


def test_smollm_pre_splits_digits_one_by_one():
    digits = Tokenizer.from_gguf_fields(gpt2_fields("smollm"))
    plain = Tokenizer.from_gguf_fields(gpt2_fields("gpt-2"))
    assert pieces(digits, digits.encode("1234")) == ["1", "2", "3", "4"]
    assert pieces(plain, plain.encode("1234")) == ["12", "34"]


def test_llama_bpe_pre_groups_digits_by_three_and_qwen2_splits_them():
    llama3 = Tokenizer.from_gguf_fields(gpt2_fields("llama-bpe"))
    qwen2 = Tokenizer.from_gguf_fields(gpt2_fields("qwen2"))
    assert pieces(llama3, llama3.encode("1234", add_special=False)) == ["123", "4"]
    assert pieces(qwen2, qwen2.encode("1234")) == ["1", "2", "3", "4"]


def test_bos_eos_follow_gguf_flags_else_llama_cpp_defaults():
    flags = {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    tok = Tokenizer.from_gguf_fields(gpt2_fields(**flags, **{"tokenizer.ggml.eos_token_id": 2}))
    assert pieces(tok, tok.encode("the")) == ["<|endoftext|>", "t", "he", "<|im_end|>"]
    assert pieces(tok, tok.encode("the", add_special=False)) == ["t", "he"]
    llama3 = Tokenizer.from_gguf_fields(gpt2_fields("llama-bpe"))  # no flag: llama.cpp adds BOS for llama3
    assert pieces(llama3, llama3.encode("the")) == ["<|endoftext|>", "t", "he"]


def test_unknown_model_or_pre_raises():
    with pytest.raises(ValueError, match="bert"):
        Tokenizer.from_gguf_fields(gpt2_fields(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="no-such-pre"):
        Tokenizer.from_gguf_fields(gpt2_fields("no-such-pre"))


def test_eos_ids_include_end_of_turn_tokens_by_text():
    tok = Tokenizer.from_gguf_fields(gpt2_fields())
    assert tok.eos_id == 0
    assert tok.eos_ids == {0, 2}  # <|endoftext|> (eos) and <|im_end|>


def test_decode_skip_special_drops_control_tokens():
    tok = Tokenizer.from_gguf_fields(gpt2_fields())
    assert tok.decode(tok.encode("<|im_start|>the<|im_end|>"), skip_special=True) == "the"
    assert tok.special_ids == {0, 1, 2}


def test_token_piece_is_raw_bytes():
    tok = Tokenizer.from_gguf_fields(gpt2_fields())
    assert tok.token_piece(3 + 0xC3) == b"\xc3"
    assert tok.token_piece(1) == b"<|im_start|>"
    with pytest.raises(ValueError):
        tok.token_piece(tok.vocab_size)


def test_incremental_decoder_holds_back_partial_utf8():
    tok = Tokenizer.from_gguf_fields(gpt2_fields())
    text = "aé🤖b"
    dec = IncrementalDecoder(tok)
    outs = [dec.push(i) for i in tok.encode(text)]
    assert outs == ["a", "", "é", "", "", "", "🤖", "b"]
    assert "".join(outs) + dec.flush() == text


def test_gpt2_pre_cleans_spaces_before_punctuation_like_llama_cpp():
    tok = Tokenizer.from_gguf_fields(gpt2_fields("gpt-2"))
    assert tok.decode(tok.encode("a . b")) == "a. b"  # llama.cpp clean_spaces; off for smollm/qwen2
    smol = Tokenizer.from_gguf_fields(gpt2_fields("smollm"))
    assert smol.decode(smol.encode("a . b")) == "a . b"


def test_spm_merges_follow_scores():
    def split_abc(ab: float, bc: float) -> list[str]:
        tok = Tokenizer.from_gguf_fields(spm_fields({"a": -1, "b": -2, "c": -3, "ab": ab, "bc": bc}, **NO_PREFIX))
        return pieces(tok, tok.encode("abc", add_special=False))
    assert split_abc(-4, -5) == ["ab", "c"]
    assert split_abc(-5, -4) == ["a", "bc"]


def test_spm_space_prefix_and_bos():
    tok = Tokenizer.from_gguf_fields(spm_fields())
    assert pieces(tok, tok.encode("hello world")) == ["<s>", "▁hello", "▁world"]
    no_prefix = Tokenizer.from_gguf_fields(spm_fields(**NO_PREFIX))
    assert pieces(no_prefix, no_prefix.encode("hello world")) == ["<s>", "hello", "▁world"]


def test_spm_byte_fallback():
    tok = Tokenizer.from_gguf_fields(spm_fields(**NO_PREFIX))
    ids = tok.encode("hé", add_special=False)
    assert pieces(tok, ids) == ["h", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hé"


def test_spm_user_defined_split_even_without_parse_special():
    tok = Tokenizer.from_gguf_fields(spm_fields(**NO_PREFIX))
    ids = tok.encode("<start_of_turn>he\nhe", add_special=False, parse_special=False)
    assert 4 in ids and 3 not in ids  # "\n" is USER_DEFINED, <start_of_turn> CONTROL
    assert tok.encode("<start_of_turn>he", add_special=False) == [3, tok.token_to_id("he")]


def test_spm_decode_strips_prefix_space_only_without_leading_bos():
    tok = Tokenizer.from_gguf_fields(spm_fields())
    hello = tok.token_to_id("▁hello")
    assert tok.decode([hello]) == "hello"
    assert tok.decode([1, hello], skip_special=True) == " hello"  # llama.cpp keeps it after BOS


MODEL_FILES = {"SMOLLM2": "SmolLM2-135M-Instruct.Q4_1.gguf", "GEMMA3": "gemma-3-270m-q4_k_m.gguf"}


def _model_file(key: str) -> Path:
    """$STRATA_TEST_<key> if set, else the strata model cache (<STRATA_HOME or ~/.cache/strata>/models)."""
    env, home = f"STRATA_TEST_{key}", Path(os.environ.get("STRATA_HOME") or Path.home() / ".cache" / "strata")
    path = Path(os.environ[env]) if os.environ.get(env) else home / "models" / MODEL_FILES[key]
    if not path.is_file():
        pytest.skip(f"{MODEL_FILES[key]} not available (set {env})")
    return path


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf_path(str(_model_file("SMOLLM2")))


@pytest.fixture(scope="module")
def gemma3_fields() -> dict:  # reading Gemma's 262k-token vocabulary takes seconds: do it once
    fields = GGUFReader(str(_model_file("GEMMA3"))).fields
    return {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def gemma3(gemma3_fields) -> Tokenizer:
    return Tokenizer.from_gguf_fields(gemma3_fields)


# No whitespace right before a digit: transformers' GGUF converter has split those differently.
COMPARE_TEXTS = [
    "Hello world", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n", "  leading spaces",
    "tabs\tand\nnewlines\n\n\nend", "I'm sure they've gone, haven't they? We'll see.",
    "héllo wörld — “quotes” ‘single’", "日本語のテキスト", "emoji 🤖🎉 done", "def f(x):\n    return x*2  # note",
    "<b>html</b> &amp; stuff", "trailing space ", "MiXeD CaSe WORDS", "<start_of_turn>user\nhi<end_of_turn>\n",
    "multiple   spaces    here", "\u00a0nbsp\u2003em", "v1.2-rc3 (x86_64)",
]


@pytest.mark.slow
def test_smollm2_chat_prompt_ids(smollm2):
    ids = smollm2.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    assert ids == [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]


@pytest.mark.slow
def test_smollm2_digits_split_individually(smollm2):
    assert pieces(smollm2, smollm2.encode("a 123")) == ["a", "Ġ", "1", "2", "3"]


@pytest.mark.slow
def test_smollm2_special_ids(smollm2):
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.vocab_size) == (1, 2, 49152)
    assert smollm2.eos_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame> (llama.cpp's FIM-repo EOG)


@pytest.mark.slow
@pytest.mark.reference
def test_smollm2_matches_transformers(smollm2):
    transformers = pytest.importorskip("transformers")
    path = _model_file("SMOLLM2")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in COMPARE_TEXTS:
        assert smollm2.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False), text


@pytest.mark.slow
def test_gemma3_bos_and_turn_tokens(gemma3):
    ids = gemma3.encode("<start_of_turn>user\nhi<end_of_turn>\n")
    assert ids[:2] == [2, 105] and 106 in ids
    assert {1, 106} <= gemma3.eos_ids
    assert gemma3.decode(ids, skip_special=True) == "user\nhi\n"


def spm_reference(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    """Straight port of llama.cpp's llm_tokenizer_spm_session::tokenize for one escaped fragment."""
    sym, heap = list(text), []
    nxt, prev = list(range(1, len(text))) + [-1], list(range(-1, len(text) - 1))
    def add(left: int, right: int) -> None:
        if left != -1 and right != -1 and (t := ids.get(sym[left] + sym[right])) is not None:
            heapq.heappush(heap, (-scores[t], left, right, len(sym[left]) + len(sym[right])))
    for i in range(1, len(sym)):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left], sym[right], nxt[left] = sym[left] + sym[right], "", nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])
    out, i = [], 0 if sym else -1
    while i != -1:
        t = ids.get(sym[i])
        out += [t] if t is not None else [ids[f"<0x{b:02X}>"] for b in sym[i].encode()]
        i = nxt[i]
    return out


@pytest.mark.slow
def test_gemma3_matches_llama_cpp_spm_algorithm(gemma3, gemma3_fields):
    scores = gemma3_fields["tokenizer.ggml.scores"]
    ids = {gemma3.id_to_token(i): i for i in range(gemma3.vocab_size)}
    rng = random.Random(0)
    alphabet = "abcdeéß日本語🤖 .,!?-_<>/\\'\"0123456789\u0301\u200b\t"
    texts = COMPARE_TEXTS + ["".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(300)]
    texts += ["".join(chr(rng.randint(0x20, 0xD7FF)) for _ in range(rng.randint(1, 8))) for _ in range(100)]
    for text in texts:
        want = []  # special/user-defined tokens (tabs, space runs) are cut out first; compare the SPM part
        for frag in gemma3._partition(text, True):
            want += [frag] if isinstance(frag, int) else spm_reference(frag.replace(" ", "▁"), ids, scores)
        assert gemma3.encode(text, add_special=False) == want, text


@pytest.mark.slow
@pytest.mark.reference
def test_gemma3_matches_transformers(gemma3):
    transformers = pytest.importorskip("transformers")
    path = _model_file("GEMMA3")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in COMPARE_TEXTS:
        assert gemma3.encode(text) == hf.encode(text, add_special_tokens=True), text


def test_text_that_continues_from_ids_gets_no_spm_space_prefix():
    tok = Tokenizer.from_gguf_fields(spm_fields())
    assert pieces(tok, tok.encode("hello", add_special=False)) == ["▁hello"]
    assert pieces(tok, tok.encode("hello", add_special=False, continues=True)) == ["hello"]
    # a fragment after a special token is not the continued text: it keeps its prefix
    assert pieces(tok, tok.encode("hello<start_of_turn>hello", add_special=False, continues=True)) \
        == ["hello", "<start_of_turn>", "▁hello"]
