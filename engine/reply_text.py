"""A reply's text and the rules that end it: one home for the server (scheduler/output.py) and `strata
generate` (engine/generate.py), so a one-shot completion ends where the server's reply would.

Per sampled token, in this order:
- an end-of-generation token (unless ``ignore_eos``) ends the reply, "stop"; it is not part of the reply;
- otherwise the token is decoded (never half a UTF-8 character; control tokens in ``hidden_ids`` give no text)
  and its text passes the stop-string matcher (never half a stop string; a completed one, and all after it,
  withheld);
- a completed stop string or a completed grammar ends the reply, "stop" (a completed grammar sends the
  held-back text at once: no end-of-generation step follows it);
- the ``max_tokens``-th generated token ends it, "length".
Whatever the reply ends on, ``flush`` gives the text still held back (none after a stop string).
"""
from __future__ import annotations

from engine.sampling import SamplingParams
from engine.stop import StopStringMatcher
from engine.tokenizer import IncrementalDecoder, Tokenizer


class ReplyText:
    """The decoder, stop strings and finish rules of one reply. Mutated by ``push`` and ``flush``."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, hidden_ids: frozenset[int] = frozenset()):
        self.decoder = IncrementalDecoder(tokenizer, hidden_ids=hidden_ids)
        self.stops = StopStringMatcher(params.stop)
        self.end_ids = frozenset() if params.ignore_eos else frozenset(tokenizer.eos_ids)
        self.max_tokens = params.max_tokens

    def ends_on(self, token: int) -> bool:
        """Whether sampling ``token`` ends the reply before it (an end-of-generation token: "stop")."""
        return token in self.end_ids

    def push(self, token: int, grammar_done: bool = False) -> str:
        """The text ``token`` adds that can be sent now; with ``grammar_done`` (the reply's grammar completed
        with it), all the text held back too."""
        text = self.stops.push(self.decoder.push(token))
        if grammar_done and not self.stops.stopped:
            text += self.stops.push(self.decoder.flush()) + self.stops.flush()
        return text

    @property
    def stopped(self) -> bool:
        """A stop string completed: no more text is sent."""
        return self.stops.stopped

    def finish_reason(self, num_generated: int, grammar_done: bool = False) -> str | None:
        """"stop", "length", or None to go on, after ``push`` of the ``num_generated``-th token."""
        if self.stops.stopped or grammar_done:
            return "stop"
        return "length" if num_generated >= self.max_tokens else None

    def flush(self) -> str:
        """At the end of the reply: the text still held back (a partial character, a stop-string prefix)."""
        return self.stops.push(self.decoder.flush()) + self.stops.flush()
