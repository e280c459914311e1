"""The llguidance view of a GGUF vocabulary: token byte strings, EOS ids, special tokens, a tokenize callback.

llguidance matches grammars on bytes, so it needs every token's bytes exactly as the detokeniser emits them
(`Tokenizer.token_piece`: GPT-2 byte characters mapped back to bytes for BPE, U+2581 -> space and <0xNN> ->
one byte for SentencePiece). CONTROL and UNKNOWN tokens (GGUF token types 3 and 2) are passed as special:
llguidance marks them with a 0xFF byte so grammar text never matches them (a grammar can still name one as
`<|name|>`). USER_DEFINED tokens (type 4, e.g. Qwen's `<tool_call>`) stay plain bytes, so the grammar text
"<tool_call>" matches both the single token and the same text spelled over several tokens. UNUSED tokens have
no bytes and are never allowed. Every end-of-generation id (the tokenizer's EOG set, primary EOS first) is an
EOS for llguidance: its mask allows all of them exactly when the grammar is complete.

The tokenize callback (llguidance calls it for text the grammar forces, to know how the model would spell
it) is the tokenizer itself: llama.cpp BPE for 'gpt2' vocabularies; for SentencePiece the merge model without
the space prefix llama.cpp puts on each fragment, because the forced text continues a reply. A result that
does not spell the text byte for byte falls back to a greedy longest-match over the vocabulary.

Building takes ~0.15 s for a 49K vocabulary and ~0.65 s for 152K (docs/BENCHMARKS.md; nearly all of it in
llguidance's token trie and its mask slices), so GrammarCompiler builds it once per model.
"""
from __future__ import annotations

import llguidance

from engine.tokenizer import Tokenizer


class _Encode:
    """tokenize(bytes) -> ids for llguidance; always spells the input exactly."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[bytes], special: set[int]):
        self._tok = tokenizer
        self._pieces = pieces
        # bytes -> the lowest id spelling them, over the tokens grammar text may use (not specials, not empty).
        self._ids: dict[bytes, int] = {}
        for i, p in enumerate(pieces):
            if p and i not in special:
                self._ids.setdefault(p, i)
        self._max_len = max((len(p) for p in self._ids), default=1)

    def __call__(self, data: bytes) -> list[int]:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return self.greedy(data)
        if self._tok.model == "llama":
            ids = self._spm(text)
        else:
            ids = self._tok.encode(text, add_special=False, parse_special=False)
        if b"".join(self._pieces[i] for i in ids) == data:
            return ids
        return self.greedy(data)

    def _spm(self, text: str) -> list[int]:
        # The merge model of Tokenizer (SentencePiece BPE with byte fallback) on the escaped text, with no
        # space prefix: Tokenizer.encode would prefix every fragment, which is right for a prompt but not for
        # text in the middle of a reply.
        return self._tok.encode_merges(text.replace(" ", "\u2581"))  # the same model encode() runs, minus the prefix

    def greedy(self, data: bytes) -> list[int]:
        """Longest match at each position (bytes no token spells are skipped; a byte-level vocabulary and
        SentencePiece byte fallback spell every byte)."""
        out, i, n = [], 0, len(data)
        while i < n:
            for k in range(min(self._max_len, n - i), 0, -1):
                tid = self._ids.get(data[i:i + k])
                if tid is not None:
                    out.append(tid)
                    i += k
                    break
            else:
                i += 1
        return out


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: tokens, eos/bos ids, special ids, and the callable."""

    def __init__(self, tokenizer: Tokenizer):
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_piece(i) for i in range(n)]
        self.special_token_ids = sorted(tokenizer.special_ids)  # CONTROL and UNKNOWN
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._encode = _Encode(tokenizer, self.tokens, set(self.special_token_ids))

    def __call__(self, data: bytes) -> list[int]:
        return self._encode(data)


def eos_ids(tokenizer: Tokenizer) -> list[int]:
    """The end-of-generation ids, the primary EOS first."""
    primary = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    return primary + sorted(tokenizer.eos_ids - set(primary))


def build_ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for a GGUF vocabulary (see the module docstring)."""
    vocab = _Vocabulary(tokenizer)
    eos = eos_ids(tokenizer)
    if not eos:
        raise ValueError("the vocabulary has no end-of-generation token; grammars need one")
    vocab.eos_token_id = eos[0]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=tokenizer.vocab_size, eos_token=eos)
