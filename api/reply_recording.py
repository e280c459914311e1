"""Where a turn meets the reply memory (api/reply_memory.py): a reply is remembered as it ends, and a prompt
that kept replies as generated says so in the log and in /cache."""
from __future__ import annotations

import logging
from typing import AsyncIterator

from api.prompt_ids import PromptIds
from api.reply_memory import ReplyMemory, reply_as_generated
from scheduler.request import Delta, Request

log = logging.getLogger("strata.api")
LISTED = 3  # replies named in the log line; the rest are counted


async def remember_reply(memory: ReplyMemory, tokenizer, stream: AsyncIterator[Delta], request: Request,
                         salt: str, prompt_text: str, message_index: int,
                         hidden_ids: frozenset[int] = frozenset()) -> AsyncIterator[Delta]:
    """`stream`, passed through; a reply that ends ("stop", "length") is remembered as the answer to
    `prompt_text` before its last delta goes out, so the client's next turn always finds it (`hidden_ids`:
    the control tokens the stream shows no text for). Closing this stream closes `stream` (a client that
    went away aborts the request)."""
    texts = []
    try:
        async for delta in stream:
            texts.append(delta.text)
            if delta.finish_reason in ("stop", "length"):
                reply = reply_as_generated(tokenizer, request.output_ids, "".join(texts), message_index,
                                           hidden_ids)
                if reply is not None:
                    memory.remember(salt, prompt_text, reply)
            yield delta
    finally:
        await stream.aclose()


def note_kept_replies(memory: ReplyMemory, request_id: str, encoded: PromptIds | None) -> None:
    """Count a prepared prompt's kept replies for /cache; log the ones that mattered: those whose text
    re-encodes to other ids (the others' ids are the same either way), and those not there as generated."""
    if encoded is None or not (encoded.kept or encoded.not_as_generated):
        return
    memory.count_prompt(encoded.kept, len(encoded.not_as_generated))
    differing = [k for k in encoded.kept if k.splits_differently]
    if not differing and not encoded.not_as_generated:
        return
    notes = [k.describe() for k in differing[-LISTED:]]
    if len(differing) > LISTED:
        notes.insert(0, f"{len(differing) - LISTED} earlier replies")
    notes += [f"message {m} is not the reply generated there (edited or cut): encoded from its text"
              for m in encoded.not_as_generated[-LISTED:]]
    fields = {"request_id": request_id, "replies_kept": len(encoded.kept),
              "reply_tokens_kept": sum(k.num_tokens for k in encoded.kept),
              "replies_not_as_generated": list(encoded.not_as_generated)}
    log.info("prompt keeps %d replies (%d tokens) as generated: %s", len(encoded.kept), fields["reply_tokens_kept"],
             "; ".join(notes), extra={"fields": fields})
