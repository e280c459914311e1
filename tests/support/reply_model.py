"""The tiny lfm2 the reply-token tests serve (test_server_reply_tokens, test_reply_journal): its head writes
OUTPUT_TEXT one byte a token, and "h" "e" re-encodes as "he", "i" "n" as "in", so a reply read back from its
text is not the ids the model generated."""
from __future__ import annotations

from engine.loader import open_model
from tests.support.tiny_gguf import tiny_vocab
from tests.support.tiny_lfm2 import write_tiny_lfm2

OUTPUT_TEXT = "heint"
MAX_TOKENS = 12
FIRST = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "How many?"}]


def open_reply_model(folder):
    """The model, written into folder (a pytest tmp folder) and loaded at 1024 positions."""
    tokens = tiny_vocab()[0]
    path = folder / "tiny-lfm2.gguf"
    write_tiny_lfm2(path, seed=5, n_ctx=1024, output_ids=[tokens.index(c) for c in OUTPUT_TEXT])
    return open_model(str(path), max_positions=1024)
