"""A chat prompt's token ids, with the replies this server generated kept as the ids it generated them as.

The rendered prompt is searched for the places a reply was generated: each end of the template's generation
prompt (``<|im_start|>assistant\\n``) where the text before it is, byte for byte, a prompt this server
answered (api/reply_memory.py). Where the text after it starts with a reply generated for that prompt (its
content, and the tool calls the template renders back from ``tool_calls``, when they render as generated),
that span's ids are the generated ones:

    text   |<- prompt answered before ->|<- reply ->|<|im_end|>\\n<|im_start|>user ...|<- reply ->| ...
    ids    |  encoded (one piece each)   | generated | encoded, going on from the reply | generated | ...

So the prompt's ids are those of a session that never left the server: the earlier prompt's ids, the ids the
model sampled, then the new text. The cache's match runs through the reply, and on a hybrid model reaches the
state checkpoint at its end. A reply whose text is not there as generated (edited, cut by the client) is
encoded from its text like any other, and the cache explains that miss as before.
"""
from __future__ import annotations

from dataclasses import dataclass

from api.reply_memory import ReplyMemory, prompt_hasher
from engine.loader import encode_chat_parts, encode_chat_prompt


@dataclass(frozen=True)
class KeptReply:
    """A reply a prompt carries as generated."""

    message_index: int
    position: int  # its first token's position in the prompt
    num_tokens: int
    text_tokens: int  # what its text alone encodes to
    splits_differently: bool

    def describe(self) -> str:
        what = f"message {self.message_index}'s {self.num_tokens} tokens as generated"
        return what + (f" (its text re-encodes as {self.text_tokens})" if self.splits_differently else "")


@dataclass(frozen=True)
class PromptIds:
    ids: list[int]
    kept: tuple[KeptReply, ...] = ()
    not_as_generated: tuple[int, ...] = ()  # messages where a reply was generated, now with other text


def encode_prompt(tokenizer, text: str, generation_prompt: str, memory: ReplyMemory | None,
                  salt: str = "") -> PromptIds:
    """The ids of a rendered prompt; the replies `memory` holds for prompts this one starts with stand as
    generated. `generation_prompt`: the text the template ends a prompt with to ask for a reply ("" when
    unknown: plain encoding). Changes nothing but the memory's recency of use."""
    if memory is None or not generation_prompt or not memory.holds_salt(salt):
        return PromptIds(encode_chat_prompt(tokenizer, text))
    parts: list[str | list[int]] = []
    kept, not_as_generated = [], []
    hasher, hashed, cursor = prompt_hasher(salt), 0, 0
    search = 0
    while (found := text.find(generation_prompt, search)) >= 0:
        end = found + len(generation_prompt)  # where a reply would have been generated
        if end == len(text):  # the prompt asks for a reply here (the same prompt again: a retry)
            break
        search = end
        hasher.update(text[hashed:end].encode("utf-8", "surrogatepass"))
        hashed = end
        replies = memory.replies_for(hasher.copy().digest())
        if not replies:
            continue
        reply = max((r for r in replies if text.startswith(r.text, end)), key=lambda r: len(r.text), default=None)
        if reply is None:
            not_as_generated.append(replies[0].message_index)
            continue
        parts += [text[cursor:end], list(reply.token_ids)]
        kept.append(reply)
        cursor = search = end + len(reply.text)
    parts.append(text[cursor:])
    ids, starts = encode_chat_parts(tokenizer, parts)
    spans = tuple(KeptReply(r.message_index, start, len(r.token_ids), r.text_tokens, r.splits_differently)
                  for r, start in zip(kept, starts[1::2]))
    return PromptIds(ids, spans, tuple(not_as_generated))
