"""Tokenizer built from GGUF metadata, following llama.cpp (src/llama-vocab.cpp).

`tokenizer.ggml.model` 'gpt2' is byte-level BPE with merges (`tokenizer.ggml.pre` picks llama.cpp's
split regexes); 'llama' is SentencePiece BPE driven by token scores (Gemma 3, Llama 2): spaces become
U+2581 and unknown characters fall back to <0xNN> byte tokens. The merge loop runs in HF `tokenizers`;
the rest is done here in llama.cpp's order because HF differs in the details: special tokens are cut
out first (longest first; CONTROL/UNKNOWN only when parse_special, USER_DEFINED always), the SPM space
prefix goes on every text fragment, and decoding follows llama.cpp's piece rules.
"""
from __future__ import annotations

import codecs
import logging
import re
from typing import Any, Iterable

from gguf import GGUFReader
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger("strata.tokenizer")

# llama.cpp's llama_token_type values as stored in tokenizer.ggml.token_type.
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
_SPECIAL_TYPES = (CONTROL, UNKNOWN, USER_DEFINED)  # matched as whole tokens inside text

# Split regexes copied from llama.cpp's llm_tokenizer_bpe (the "adapted" forms it actually runs).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
# o200k (gpt-oss, Llama 4): llama.cpp's adapted form (upper/lower case classes as "a letter but not a-z/A-Z").
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS + "?"
          + r"|[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS + "?"
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# pre name -> (regexes, ignore_merges, clean_spaces, default add_bos), as set in llama_vocab::impl::load.
# "gpt2" is not a llama.cpp name; it is accepted as an alias of "gpt-2".
_PRE: dict[str, tuple[list[str], bool, bool, bool]] = {}
for _names, _spec in (
    (("default",), (_DEFAULT, False, True, False)),
    (("gpt-2", "gpt2"), ([_GPT2], False, True, False)),
    (("smollm",), ([r"\p{N}", _GPT2], False, False, False)),
    (("starcoder", "refact", "codeshell"), ([r"\p{N}", _GPT2], False, True, False)),
    (("llama-bpe", "llama3", "llama-v3", "falcon3"), ([_LLAMA3], True, True, True)),
    (("qwen2", "deepseek-r1-qwen"), ([_QWEN2], False, False, False)),
    (("stablelm2", "megrez"), ([_QWEN2], False, True, False)),
    (("gpt-4o", "llama4"), ([_GPT4O], False, False, False)),
):
    _PRE.update(dict.fromkeys(_names, _spec))

# Token texts llama.cpp puts in its end-of-generation set (and forces to CONTROL).
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
}
_HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # gpt-oss (see the EOG set below)
# FIM pad / repo / file-separator tokens are EOG too; llama.cpp finds them by key or by text.
_FIM_TEXTS = {
    "fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_token_id": ("<|file_sep|>",),
}


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in bs]
    return {chr(c): b for b, c in zip(bs + rest, bs + [256 + k for k in range(len(rest))])}


def default_add_bos(fields: dict[str, Any]) -> bool:
    """Whether llama.cpp prepends BOS for this vocabulary (GGUF key, else the per-model default)."""
    if "tokenizer.ggml.add_bos_token" in fields:
        return bool(fields["tokenizer.ggml.add_bos_token"])
    pre = _PRE.get(str(fields.get("tokenizer.ggml.pre") or "default"), _PRE["default"])
    return fields.get("tokenizer.ggml.model") == "llama" or pre[3]


class Tokenizer:
    """Encode/decode text with a GGUF vocabulary exactly as llama.cpp's llama_tokenize/llama_detokenize."""

    def __init__(self, fields: dict[str, Any]):
        self.model = str(fields.get("tokenizer.ggml.model", ""))
        if self.model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer model {self.model!r} (supported: 'gpt2', 'llama')")
        if "tokenizer.ggml.tokens" not in fields:
            raise ValueError("GGUF has no tokenizer.ggml.tokens")
        toks = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(fields["tokenizer.ggml.tokens"])]
        self._tokens, n = toks, len(toks)
        self._ids = {t: i for i, t in enumerate(toks)}
        if len(self._ids) != n:
            raise ValueError("duplicate token text in tokenizer.ggml.tokens")
        types = list(fields.get("tokenizer.ggml.token_type") or [NORMAL] * n)
        spm = self.model == "llama"
        self.pre = "" if spm else str(fields.get("tokenizer.ggml.pre") or "")
        if not spm and not self.pre:
            log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
            self.pre = "default"
        if not spm and self.pre not in _PRE:
            raise ValueError(f"unsupported pre-tokenizer {self.pre!r} for tokenizer model 'gpt2'")
        regexes, ignore_merges, self._clean_spaces, _ = ([], False, False, True) if spm else _PRE[self.pre]

        # Special ids: llama.cpp's per-model defaults (disabled when out of range), then GGUF keys.
        def sid(key: str, default: int | None) -> int | None:
            v = fields.get(f"tokenizer.ggml.{key}")
            return next((int(x) for x in (v, default) if x is not None and 0 <= int(x) < n), None)
        self._bos = sid("bos_token_id", 1 if spm else 11)
        self._eos = sid("eos_token_id", 2 if spm else 11)
        self.add_bos = default_add_bos(fields)
        self.add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", spm))
        if (self.add_bos and self._bos is None) or (self.add_eos and self._eos is None):
            raise ValueError("add_bos/add_eos is set but the BOS/EOS token id is missing")

        # End-of-generation set as llama.cpp builds it: ids from keys, plus tokens found by their text
        # (EOG-looking texts; a FIM token whose key is absent), which are also forced to CONTROL.
        found = {self._ids[t] for t in _EOG_TEXTS & self._ids.keys()}
        for key, texts in _FIM_TEXTS.items():
            if sid(key, None) is None:
                found.add(next((self._ids[t] for t in texts if t in self._ids), None))
        for i in found - {None}:
            types[i] = CONTROL
        keyed = {sid(k, None) for k in ("eot_token_id", "eom_token_id", *_FIM_TEXTS)} | {self._eos}
        eog = (keyed | found) - {None}
        if all(t in self._ids for t in _HARMONY_ENDS):
            # llama.cpp's o200k_harmony workaround: with <|return|> and <|call|> there, <|end|> ends one
            # channel message (analysis, then final) and generation goes on, so it is not end-of-generation.
            eog.discard(self._ids["<|end|>"])
        self._eog = frozenset(eog)
        self._types = types

        # Specials grouped by their first 8 characters: encode() looks for a group's members only when
        # the prefix occurs (Gemma has 6k "<unusedN>" tokens; checking each one on long texts is slow).
        self._special_groups: dict[str, list[int]] = {}
        for i, ty in enumerate(types):
            if ty in _SPECIAL_TYPES:
                self._special_groups.setdefault(toks[i][:8], []).append(i)

        self._pieces = self._build_pieces(spm)
        self._hf = self._build_hf(fields, spm, regexes, ignore_merges)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata given as {key: python value} (strings, ints, floats, lists)."""
        return cls(fields)

    @classmethod
    def from_gguf_path(cls, path: str) -> "Tokenizer":
        """Read the tokenizer.* metadata of a GGUF file with gguf.GGUFReader and build the tokenizer."""
        fields = GGUFReader(path, "r").fields
        return cls({k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")})

    def _build_hf(self, fields: dict[str, Any], spm: bool, regexes: list[str], ignore_merges: bool) -> _HFTokenizer:
        ids = self._ids
        if spm:
            # SentencePiece BPE = merge the adjacent pair whose concatenation is the best-scoring token.
            # Expressed as HF merges: every split (a, b) of every token t with a, b in the vocab,
            # ranked by t's score (ties: token id, then split point, to be deterministic).
            scores = list(fields.get("tokenizer.ggml.scores") or [0.0] * len(self._tokens))
            ranked = sorted((-scores[i], i, k) for t, i in ids.items() for k in range(1, len(t))
                            if t[:k] in ids and t[k:] in ids)
            merges = [(self._tokens[tid][:k], self._tokens[tid][k:]) for _, tid, k in ranked]
            return _HFTokenizer(models.BPE(vocab=ids, merges=merges, byte_fallback=True))
        merges, seen = [], set()
        for m in fields.get("tokenizer.ggml.merges") or []:
            k = m.find(" ", 1)  # llama.cpp splits at the first space after position 0
            pair = (m[:k], m[k + 1:])
            # HF needs both halves and the result in the vocab; llama.cpp keeps the first duplicate.
            if k > 0 and pair not in seen and pair[0] in ids and pair[1] in ids and pair[0] + pair[1] in ids:
                seen.add(pair)
                merges.append(pair)
        hf = _HFTokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=ignore_merges))
        # Each regex splits every piece further, keeping matches and gaps (llama.cpp unicode_regex_split).
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return hf

    def _build_pieces(self, spm: bool) -> list[bytes]:
        """llama.cpp token_to_piece(special=True) for every id."""
        dec = _byte_decoder()
        def piece(t: str, ty: int) -> bytes:
            if ty in _SPECIAL_TYPES:
                return t.encode()
            if ty == BYTE:
                return bytes([int(t[3:5], 16)])
            if ty != NORMAL:
                return b""  # UNUSED / UNDEFINED render as nothing
            if spm:
                return t.replace("\u2581", " ").encode()
            return b"".join(bytes([dec[c]]) if c in dec else c.encode() for c in t)  # non-byte char: UTF-8
        return [piece(t, ty) for t, ty in zip(self._tokens, self._types)]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp tokenizer_st_partition: split out special tokens, longest text first."""
        frags: list[str | int] = [text]
        cands = [i for prefix, group in self._special_groups.items() if prefix in text for i in group
                 if (parse_special or self._types[i] == USER_DEFINED) and self._tokens[i] in text]
        for tid in sorted(cands, key=lambda i: (-len(self._tokens[i]), i)):
            tok, out = self._tokens[tid], []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                for k, part in enumerate(f.split(tok)):
                    out += ([tid] if k else []) + ([part] if part else [])
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True,
               continues: bool = False) -> list[int]:
        """Token ids for ``text``; BOS/EOS per the GGUF flags when ``add_special``; special-token
        texts (CONTROL/UNKNOWN) become their ids when ``parse_special`` (USER_DEFINED always do).
        ``continues``: the text goes on from ids already encoded (a reply's generated tokens), so a text
        fragment it starts with gets no SPM space prefix (that would be a space inside the text)."""
        frags = self._partition(text, parse_special) if text else []
        texts = [f for f in frags if isinstance(f, str)]
        if self.model == "llama":  # every SPM text fragment follows BOS/start/a special token
            pre = " " if self.add_space_prefix else ""
            texts = [("" if continues and k == 0 and isinstance(frags[0], str) else pre) + f
                     for k, f in enumerate(texts)]
            texts = [f.replace(" ", "\u2581") for f in texts]
        try:
            encoded = iter([e.ids for e in self._hf.encode_batch_fast(texts, add_special_tokens=False)])
        except TypeError:
            text.encode("utf-8")  # lone surrogates: raise UnicodeEncodeError (a ValueError), not HF's TypeError
            raise
        out = [self._bos] if add_special and self.add_bos else []
        for f in frags:
            out += [f] if isinstance(f, int) else next(encoded)
        if add_special and self.add_eos:
            out.append(self._eos)
        return out

    def token_piece(self, token_id: int) -> bytes:
        """Raw bytes of one token (special tokens as their text), for streaming detokenisation."""
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} out of range (vocab size {len(self._pieces)})")
        return self._pieces[token_id]

    def text_piece(self, token_id: int, special: bool) -> bytes:
        """token_piece, or b"" for a control / unknown token when `special` is False (what decode shows)."""
        p = self.token_piece(token_id)
        return b"" if not special and self._types[token_id] in (CONTROL, UNKNOWN) else p

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids`` (llama_detokenize with remove_special = skip_special, unparse_special =
        not skip_special); invalid UTF-8 becomes U+FFFD."""
        ids = list(ids)
        strip_space = self.add_space_prefix  # drop the SPM prefix space of the first piece
        if skip_special and self.add_bos and ids and ids[0] == self._bos:
            strip_space, ids = False, ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self._eos:
            ids = ids[:-1]
        pieces = [self.text_piece(i, not skip_special) for i in ids]
        if pieces and strip_space and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces).decode("utf-8", errors="replace")
        if self._clean_spaces:  # llama.cpp's clean_up_tokenization_spaces passes
            text = re.sub(r" (?=[?!.,])", "", text).replace(" ' ", "'")
            text = re.sub(r" '(?=[sm]|re|ve)", "'", text)
        return text

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id (None when the vocabulary has none)."""
        return self._bos

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence id from tokenizer.ggml.eos_token_id."""
        return self._eos

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation: llama.cpp's EOG set (EOS, EOT, EOM, FIM, <|im_end|>-like texts)."""
        return self._eog

    def encode_merges(self, text: str) -> list[int]:
        """The merge model alone on `text` as given: no special-token split, no prefix, no normalisation
        (grammar_tokenizer encodes text from the middle of a reply with it)."""
        return self._hf.encode(text, add_special_tokens=False).ids

    @property
    def special_ids(self) -> frozenset[int]:
        """CONTROL and UNKNOWN ids: the ones decode(skip_special=True) leaves out."""
        return frozenset(i for i, ty in enumerate(self._types) if ty in (CONTROL, UNKNOWN))

    def token_to_id(self, text: str) -> int | None:
        """Id of the token whose text is exactly ``text``, or None."""
        return self._ids.get(text)

    def id_to_token(self, token_id: int) -> str:
        """Stored text of a token (GPT-2 byte characters / U+2581 spaces as in the vocabulary)."""
        return self._tokens[token_id]


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back incomplete UTF-8 sequences.

    ``hidden_ids``: tokens whose text is left out (the control tokens a reply shows no text for).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, hidden_ids: frozenset[int] = frozenset()):
        self._tok, self._skip, self._hidden = tokenizer, skip_special, hidden_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (may be empty)."""
        if token_id in self._hidden:
            return ""
        return self._utf8.decode(self._tok.text_piece(token_id, not self._skip))

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
