"""A reply's own tokens (api/reply_memory.py, api/prompt_ids.py) on a tiny byte-level BPE vocabulary whose merges
make a reply's text re-encode to other ids than the ones it was generated as (``h`` + ``e`` -> ``he``)."""
from engine.chat_template import CHATML_TEMPLATE, ChatTemplate
from engine.loader import encode_chat_prompt
from engine.tokenizer import Tokenizer
from api.prompt_ids import KeptReply, PromptIds, encode_prompt
from api.reply_memory import ReplyMemory, prompt_key, reply_as_generated
from tests.support.tokenizer_fields import gpt2_fields

TOK = Tokenizer.from_gguf_fields(gpt2_fields())
TEMPLATE = ChatTemplate(CHATML_TEMPLATE, "test")
ASK = "<|im_start|>assistant\n"
H, E = TOK.token_to_id("h"), TOK.token_to_id("e")
GENERATED = [H, E, H, E]  # "hehe" as sampled: one byte a token; its text re-encodes as ["he", "he"]


def render(messages, add_generation_prompt=True):
    return TEMPLATE.render(messages, add_generation_prompt=add_generation_prompt)


def remember(memory, messages, ids, salt=""):
    text = TOK.decode(ids)
    reply = reply_as_generated(TOK, ids, text, len(messages))
    memory.remember(salt, render(messages), reply)
    return text


def test_a_reply_that_re_encodes_differently_is_kept_as_generated():
    memory, first = ReplyMemory(), [{"role": "user", "content": "hi"}]
    text = remember(memory, first, GENERATED)
    assert TOK.encode(text, add_special=False) != GENERATED  # the case this is for
    second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "the end"}]
    rendered = render(second)
    encoded = encode_prompt(TOK, rendered, ASK, memory)
    # the session that never left the server: the first prompt's ids, the generated ids, the rest going on
    head = encode_chat_prompt(TOK, render(first))
    rest = rendered[len(render(first)) + len(text):]
    assert encoded.ids == head + GENERATED + TOK.encode(rest, add_special=False, continues=True)
    assert encoded.kept == (KeptReply(1, len(head), 4, 2, True),)
    assert encoded.ids != encode_chat_prompt(TOK, rendered)


def test_every_reply_of_a_conversation_is_kept_and_the_prompts_nest():
    memory, messages, prompts = ReplyMemory(), [{"role": "user", "content": "hi"}], []
    for turn, ids in enumerate(([H, E], [E, H, E], [H, E, E])):
        encoded = encode_prompt(TOK, render(messages), ASK, memory)
        assert [k.message_index for k in encoded.kept] == list(range(1, 2 * turn, 2))
        prompts.append(encoded.ids)
        text = TOK.decode(ids)
        memory.remember("", render(messages), reply_as_generated(TOK, ids, text, len(messages)))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"more {turn}"}]
    for earlier, (later, ids) in zip(prompts, zip(prompts[1:], ([H, E], [E, H, E]))):
        assert later[:len(earlier) + len(ids)] == earlier + ids  # each turn extends the last, reply included


def test_an_edited_or_cut_reply_is_encoded_from_its_text():
    memory, first = ReplyMemory(), [{"role": "user", "content": "hi"}]
    text = remember(memory, first, GENERATED)
    for other in ("hEhe", "heh"):
        rendered = render(first + [{"role": "assistant", "content": other}, {"role": "user", "content": "x"}])
        encoded = encode_prompt(TOK, rendered, ASK, memory)
        assert encoded.ids == encode_chat_prompt(TOK, rendered)
        assert encoded.kept == () and encoded.not_as_generated == (1,)
    assert text == "hehe"


def test_the_prompt_a_reply_answered_sent_again_is_a_retry_not_an_edit():
    memory, first = ReplyMemory(), [{"role": "user", "content": "hi"}]
    remember(memory, first, GENERATED)
    assert encode_prompt(TOK, render(first), ASK, memory) == PromptIds(encode_chat_prompt(TOK, render(first)))


def test_a_reply_after_another_prompt_or_under_another_salt_is_not_taken():
    memory, first = ReplyMemory(), [{"role": "user", "content": "hi"}]
    text = remember(memory, first, GENERATED, salt="tenant a")
    same = render(first + [{"role": "assistant", "content": text}, {"role": "user", "content": "x"}])
    assert encode_prompt(TOK, same, ASK, memory, salt="tenant b").kept == ()
    assert encode_prompt(TOK, same, ASK, memory, salt="tenant a").kept != ()
    # the same reply text after a different user message: not the prompt it answered
    other = render([{"role": "user", "content": "ho"}, {"role": "assistant", "content": text},
                    {"role": "user", "content": "x"}])
    assert encode_prompt(TOK, other, ASK, memory, salt="tenant a").ids == encode_chat_prompt(TOK, other)


def test_a_reply_cut_by_a_stop_string_keeps_the_ids_of_the_text_it_streamed():
    ids = GENERATED + [TOK.token_to_id("X"), TOK.token_to_id("Y")]
    reply = reply_as_generated(TOK, ids, "hehe", 1)  # "XY" was a stop string: not streamed
    assert list(reply.token_ids) == GENERATED and reply.text == "hehe"
    assert reply_as_generated(TOK, [TOK.token_to_id("Z")], "", 1) is None
    # a control token the stream showed no text for stays in the ids, as generated
    hidden = reply_as_generated(TOK, [H, 1, E], "he", 1, hidden_ids=frozenset({1}))
    assert list(hidden.token_ids) == [H, 1, E] and hidden.text == "he"


def test_the_memory_keeps_its_token_budget_least_recently_used_first():
    memory = ReplyMemory(max_tokens=10)
    for n in range(4):
        remember(memory, [{"role": "user", "content": f"q{n}"}], GENERATED)
    assert memory.num_tokens == 8 and memory.snapshot()["prompts"] == 2  # q0 and q1 went, oldest first
    assert not memory.replies_for(prompt_key("", render([{"role": "user", "content": "q0"}])))
    memory.replies_for(prompt_key("", render([{"role": "user", "content": "q2"}])))  # q2 used: q3 is older
    remember(memory, [{"role": "user", "content": "q4"}], GENERATED)
    assert memory.replies_for(prompt_key("", render([{"role": "user", "content": "q2"}])))
    assert not memory.replies_for(prompt_key("", render([{"role": "user", "content": "q3"}])))
    assert memory.stats["replies_forgotten"] == 3 and not memory.holds_salt("x") and memory.holds_salt("")
