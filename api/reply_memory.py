"""The replies this server generated, with the token ids it generated them as, by the prompt they answered.

A client sends a reply back as text, and the tokenizer does not always split that text into the tokens the
model wrote (``h`` + ``e`` sampled, ``he`` re-encoded; digits, whitespace runs, JSON punctuation), so the next
turn's ids would leave the cached ones where the reply begins. The memory keeps, per answered prompt, the
reply's text and ids; api/prompt_ids.py puts the ids back where a later prompt carries that very prompt
followed by that text. Keyed by (cache salt, the prompt's whole text): a tenant never sees another's replies,
and a reply is only ever used right after the prompt that produced it.

Bounded by the tokens it holds (least recently used out first). With a disk tier its replies are also written
to a file there (api/reply_journal.py), so after a restart the conversations on the disk tier are matched
through their replies as before it; without one they are held in RAM only.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

DEFAULT_MAX_TOKENS = 2_000_000  # about 16 MiB of ids and text; far more replies than a host tier holds turns
REPLIES_PER_PROMPT = 4  # retries of one prompt (sampled replies) kept side by side


def prompt_hasher(salt: str) -> "hashlib._Hash":
    """A hash of (salt, prompt text) fed with the text as it comes; ``digest()`` at any length is the key
    of the prompt that ends there (api/prompt_ids.py feeds a prompt once and reads it at many lengths)."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(salt.encode("utf-8", "surrogatepass") + b"\0")
    return hasher


def salt_digest(salt: str) -> bytes:
    """What the memory (and its file) keeps of a salt: it names a tenant's API key."""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"strata-salt").digest()


def prompt_key(salt: str, prompt_text: str) -> bytes:
    hasher = prompt_hasher(salt)
    hasher.update(prompt_text.encode("utf-8", "surrogatepass"))
    return hasher.digest()


@dataclass(frozen=True)
class GeneratedReply:
    """One reply as generated: its text (the ids' pieces, decoded as the stream was) and the ids."""

    text: str
    token_ids: array  # array('l'): a third of a list's memory
    message_index: int  # where it stands in the next turn's messages: the prompt's message count
    text_tokens: int  # how many ids its text alone re-encodes to
    splits_differently: bool  # ... and whether those differ from the generated ones (what this memory is for)


class ReplyMemory:
    """prompt key -> the replies generated for it. Mutated on the event loop only (records at a reply's end,
    lookups while a prompt is prepared)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.max_tokens = max_tokens
        self._by_prompt: OrderedDict[bytes, list[GeneratedReply]] = OrderedDict()
        self._salts: dict[bytes, int] = {}  # salt digest -> prompts held: a salt with none skips the search
        self._salt_of: dict[bytes, bytes] = {}
        self.journal = None  # api/reply_journal.ReplyJournal: with a disk tier, the replies' file
        self.num_tokens = 0
        self.stats = {"replies_remembered": 0, "replies_forgotten": 0, "prompts_with_kept_replies": 0,
                      "replies_kept": 0, "reply_tokens_kept": 0, "replies_kept_split_differently": 0,
                      "replies_not_as_generated": 0, "replies_loaded": 0}

    def remember(self, salt: str, prompt_text: str, reply: GeneratedReply) -> None:
        """Keep `reply` as the answer to `prompt_text` (the same text again replaces the older copy)."""
        if not reply.text or not reply.token_ids or len(reply.token_ids) > self.max_tokens:
            return
        key, salt_key = prompt_key(salt, prompt_text), salt_digest(salt)
        self._insert(key, salt_key, reply)
        self.stats["replies_remembered"] += 1
        if self.journal is not None:
            self.journal.append(key, salt_key, reply)
            if self.journal.ids_written > 2 * self.max_tokens:  # the file holds twice what is kept: rewrite
                self.journal.rewrite(self.records())

    def attach_journal(self, journal) -> None:
        """Load the replies a journal's file holds (oldest first, the bound applying as they come), rewrite
        the file with those kept, and write each reply remembered from now on to it."""
        for key, salt_key, reply in journal.read():
            if reply.token_ids and len(reply.token_ids) <= self.max_tokens:
                self._insert(key, salt_key, reply)
                self.stats["replies_loaded"] += 1
        journal.rewrite(self.records())
        self.journal = journal

    def records(self) -> list[tuple[bytes, bytes, GeneratedReply]]:
        """What is held as (prompt key, salt digest, reply), least recently used first, each prompt's oldest
        reply first: remembered again in this order, they come back as they are."""
        return [(key, self._salt_of[key], reply) for key, replies in self._by_prompt.items() for reply in replies[::-1]]

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def _insert(self, key: bytes, salt_key: bytes, reply: GeneratedReply) -> None:
        replies = self._by_prompt.pop(key, None)
        if replies is None:
            replies = []
            self._salts[salt_key] = self._salts.get(salt_key, 0) + 1
            self._salt_of[key] = salt_key
        others = [r for r in replies if r.text != reply.text]  # the same text again: the new ids replace it
        for old in [r for r in replies if r.text == reply.text] + others[REPLIES_PER_PROMPT - 1:]:
            self._forget(old)
        self._by_prompt[key] = [reply] + others[:REPLIES_PER_PROMPT - 1]
        self.num_tokens += len(reply.token_ids)
        while self.num_tokens > self.max_tokens:
            self._drop_oldest()

    def holds_salt(self, salt: str) -> bool:
        return self._salts.get(salt_digest(salt), 0) > 0

    def replies_for(self, key: bytes) -> list[GeneratedReply]:
        """The replies generated for the prompt with this key, newest first; a hit counts as a use (LRU)."""
        replies = self._by_prompt.get(key)
        if replies is None:
            return []
        self._by_prompt.move_to_end(key)
        return replies

    def count_prompt(self, kept: Iterable, not_as_generated: int) -> None:
        """A prepared prompt's outcome, for /cache: the replies it took as generated, those it could not."""
        kept = list(kept)
        self.stats["prompts_with_kept_replies"] += bool(kept)
        self.stats["replies_kept"] += len(kept)
        self.stats["reply_tokens_kept"] += sum(k.num_tokens for k in kept)
        self.stats["replies_kept_split_differently"] += sum(k.splits_differently for k in kept)
        self.stats["replies_not_as_generated"] += not_as_generated

    def snapshot(self) -> dict:
        """For GET /cache: what is held and what prompts took."""
        return {"prompts": len(self._by_prompt), "tokens": self.num_tokens, "max_tokens": self.max_tokens,
                **self.stats}

    def _drop_oldest(self) -> None:
        key, replies = self._by_prompt.popitem(last=False)
        for reply in replies:
            self._forget(reply)
        salt = self._salt_of.pop(key)
        self._salts[salt] -= 1
        if not self._salts[salt]:
            del self._salts[salt]

    def _forget(self, reply: GeneratedReply) -> None:
        self.num_tokens -= len(reply.token_ids)
        self.stats["replies_forgotten"] += 1


MAX_TRIMMED_TOKENS = 64  # a stop string's tokens, the most a reply's text may fall short of its ids


def reply_as_generated(tokenizer, output_ids: list[int], streamed_text: str, message_index: int,
                       hidden_ids: frozenset[int] = frozenset()) -> GeneratedReply | None:
    """The reply a finished request streamed, as its ids and their text. A reply cut by a stop string
    streamed less text than its ids hold: it keeps the ids whose text is the start of what was streamed (the
    rest is encoded from the text, as any text is). `hidden_ids`: control tokens the stream showed no text
    for; they stay in the ids, as generated. None when nothing of it is as generated."""
    pieces = [b"" if i in hidden_ids else tokenizer.token_piece(i) for i in output_ids]
    for count in range(len(pieces), max(0, len(pieces) - MAX_TRIMMED_TOKENS) - 1, -1):
        # decoded as the stream decodes (invalid UTF-8 as U+FFFD), so the text is what the client got
        text = b"".join(pieces[:count]).decode("utf-8", errors="replace")
        if streamed_text.startswith(text):
            break
    else:
        return None
    if not count:
        return None
    ids = list(output_ids[:count])
    encoded = tokenizer.encode(text, add_special=False, continues=True)
    return GeneratedReply(text, array("l", ids), message_index, len(encoded), encoded != ids)
