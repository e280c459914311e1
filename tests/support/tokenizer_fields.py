"""Tiny in-test tokenizer vocabularies as GGUF metadata fields (byte-level BPE as GPT-2 / SmolLM2 write it,
SentencePiece as Gemma's): shared by tests/test_tokenizer.py and the tests that need a tokenizer but not a
model (grammar, reply tokens, hidden control tokens)."""


def byte_chars() -> list[str]:
    """GPT-2's printable character for each byte value 0..255 (bytes it can't print map to 256+k)."""
    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]
    hidden = [b for b in range(256) if b not in shown]
    table = dict(zip(shown + hidden, shown + [256 + k for k in range(len(hidden))]))
    return [chr(table[b]) for b in range(256)]


GPT2_MERGES = [("3", "4"), ("1", "2"), ("12", "3"), ("Ġ", "t"), ("h", "e"), ("Ġt", "he")]


def gpt2_fields(pre: str = "smollm", **extra) -> dict:
    """Byte-level BPE vocab: 3 control tokens (SmolLM2's ids), the 256 bytes, one token per merge."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars() + [a + b for a, b in GPT2_MERGES]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * 3 + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in GPT2_MERGES],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0, **extra,
    }


def spm_fields(pieces: dict[str, float] | None = None, **extra) -> dict:
    """SentencePiece vocab: <unk> <s> </s> <start_of_turn> "\\n"(user-defined), 256 byte tokens, pieces."""
    pieces = pieces or {"▁": -1, "h": -2, "e": -3, "l": -4, "o": -5, "w": -6, "r": -7, "d": -8,
                        "ll": -9, "he": -10, "llo": -11, "hello": -12, "▁hello": -13, "or": -14,
                        "▁w": -15, "▁wor": -16, "ld": -17, "▁world": -18}
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "\n"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += list(pieces)
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 261 + list(pieces.values()),
        "tokenizer.ggml.token_type": [2, 3, 3, 3, 4] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **extra,
    }
