"""OpenAI response objects (chat and legacy completions, whole and as SSE chunks), built from Deltas, and the
encoders that write a reply's events (api/reply_stream.py) as their SSE frames."""
from __future__ import annotations

import time

from api.chat_output import ReplyAssembler
from api.reply_stream import Failed, Finished, Keepalive, Piece, ReplyEvent, Started
from api.sse import COMMENT_KEEPALIVE, sse_frame
from engine.tokenizer import Tokenizer
from scheduler.request import Delta, TokenLogprob, Usage


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ResponseBuilder:
    """Builds the JSON bodies of one request in the chat or the completions shape."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: Tokenizer):
        assert kind in ("chat", "completion")
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id.removeprefix("req-")
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj + (".chunk" if chunk and self.kind == "chat" else ""),
                "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str, usage: Usage,
              text_offset: int = 0) -> dict:
        """The non-streaming text completion (chat: ``chat_whole``)."""
        choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(logprobs, text_offset),
                  "finish_reason": finish_reason}
        body = self._envelope([choice], chunk=False)
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, delta: Delta | None, want_logprobs: bool = False) -> dict:
        """One streamed text-completion chunk (chat: ``chat_chunk``)."""
        logprobs = (delta.logprobs if delta else []) if want_logprobs else None
        choice = {"index": 0, "text": delta.text if delta else "", "logprobs": self.completion_logprobs(logprobs, 0),
                  "finish_reason": delta.finish_reason if delta else None}
        return self._envelope([choice], chunk=True)

    def chat_whole(self, message: dict, logprobs: list[TokenLogprob] | None, finish_reason: str,
                   usage: Usage) -> dict:
        """The non-streaming chat response around an assembled message (api/chat_output.py)."""
        choice = {"index": 0, "message": message, "logprobs": self.chat_logprobs(logprobs),
                  "finish_reason": finish_reason}
        body = self._envelope([choice], chunk=False)
        body["usage"] = usage_body(usage)
        return body

    def chat_chunk(self, delta: dict, finish_reason: str | None = None,
                   logprobs: list[TokenLogprob] | None = None) -> dict:
        """One streamed chat chunk around a parsed delta (content / reasoning / tool_calls)."""
        choice = {"index": 0, "delta": delta, "logprobs": self.chat_logprobs(logprobs), "finish_reason": finish_reason}
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage_body(usage)
        return body

    def chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        return {"content": [
            {**self._token_entry(lp.token_id, lp.logprob),
             "top_logprobs": [self._token_entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]}

    def completion_logprobs(self, logprobs: list[TokenLogprob] | None, text_offset: int) -> dict | None:
        if logprobs is None:
            return None
        tokens, offsets, offset = [], [], text_offset
        for lp in logprobs:
            piece = self._piece(lp.token_id)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._piece(t): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.token_piece(token_id).decode("utf-8", errors="replace")

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        raw = self.tokenizer.token_piece(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


DONE = sse_frame("[DONE]")


def error_frame(message: str) -> bytes:
    """An error inside a stream, in OpenAI's error object shape."""
    return sse_frame({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


class ChatStreamEncoder:
    """Chat chunks: the role first, then parsed deltas (markup held back by the parser), a last chunk with
    the finish reason (always, even after an error: "error"), the usage chunk when asked, [DONE]."""

    def __init__(self, builder: ResponseBuilder, assembler: ReplyAssembler, include_usage: bool,
                 want_logprobs: bool):
        self.builder, self.assembler = builder, assembler
        self.include_usage, self.want_logprobs = include_usage, want_logprobs

    def opening(self) -> list[bytes]:
        return [sse_frame(self.builder.chat_chunk({"role": "assistant", "content": ""}))]

    def encode(self, event: ReplyEvent) -> list[bytes]:
        """The frames of one event (mutates the assembler)."""
        if isinstance(event, Keepalive):
            return [COMMENT_KEEPALIVE]
        if isinstance(event, Started):
            return []
        builder, assembler, delta = self.builder, self.assembler, event.delta
        frames = [error_frame(event.message)] if isinstance(event, Failed) else []
        body = assembler.delta(assembler.feed(delta.text))
        logprobs = delta.logprobs if self.want_logprobs else None
        if body or logprobs:
            frames.append(sse_frame(builder.chat_chunk(body, logprobs=logprobs)))
        if isinstance(event, Piece):
            return frames
        tail = assembler.delta(assembler.finish())
        if tail:
            frames.append(sse_frame(builder.chat_chunk(tail)))
        reason = assembler.finish_reason(event.reason) if isinstance(event, Finished) else "error"
        frames.append(sse_frame(builder.chat_chunk({}, reason)))
        return frames + _usage_and_done(builder, delta, self.include_usage)

    @staticmethod
    def on_bug() -> list[bytes]:
        return [error_frame("internal server error"), DONE]


class CompletionStreamEncoder:
    """Text-completion chunks: each delta with text (or logprobs), the finish chunk, usage when asked, [DONE]."""

    def __init__(self, builder: ResponseBuilder, include_usage: bool, want_logprobs: bool):
        self.builder, self.include_usage, self.want_logprobs = builder, include_usage, want_logprobs

    def encode(self, event: ReplyEvent) -> list[bytes]:
        """The frames of one event."""
        if isinstance(event, Keepalive):
            return [COMMENT_KEEPALIVE]
        if isinstance(event, Started):
            return []
        delta = event.delta
        frames = [error_frame(event.message)] if isinstance(event, Failed) else []
        if delta.text or delta.finish_reason or (self.want_logprobs and delta.logprobs):
            frames.append(sse_frame(self.builder.chunk(delta, want_logprobs=self.want_logprobs)))
        if isinstance(event, Piece):
            return frames
        return frames + _usage_and_done(self.builder, delta, self.include_usage)

    @staticmethod
    def on_bug() -> list[bytes]:
        return [error_frame("internal server error"), DONE]


def _usage_and_done(builder: ResponseBuilder, last: Delta, include_usage: bool) -> list[bytes]:
    usage = [sse_frame(builder.usage_chunk(last.usage))] if include_usage and last.usage is not None else []
    return usage + [DONE]
