"""OpenAI response objects (chat and legacy completions, whole and as SSE chunks), built from Deltas."""
from __future__ import annotations

import time

from api.sse_json import sse_json
from engine.tokenizer import Tokenizer
from scheduler.request import Delta, TokenLogprob, Usage


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def sse(obj: dict | str) -> bytes:
    payload = obj.encode() if isinstance(obj, str) else sse_json(obj)
    return b"data: " + payload + b"\n\n"


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
