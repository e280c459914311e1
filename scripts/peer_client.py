"""The client side of scripts/bench_peer.py: fresh prompts of a given length, and streamed chat requests timed
the same way against any OpenAI-compatible server (strata or llama-server).

A prompt is fresh when no server has seen any of it: each starts with its own nonce (in the system message, so
it differs from the third token on) followed by random words, so neither server's prefix cache reuses anything
of an earlier round, depth or stream. Its length is set with the model's own tokenizer; the servers report what
they read (usage.prompt_tokens), and that is what the rates are computed from.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import httpx
import orjson

# Ordinary words (tokenised like prose, not like noise); random order so the text never repeats.
WORDS = ("river stone light window market winter garden letter engine harbor mountain silver lantern forest "
         "paper station morning evening bridge village railway library teacher captain kitchen island thunder "
         "meadow signal orchard factory candle compass journey balcony carpet whistle ladder pocket mirror "
         "shadow blanket feather copper basket valley tower anchor castle pencil button jacket wagon "
         "ribbon saddle quarry tunnel cellar chimney lighthouse glacier canyon desert prairie harvest "
         "slowly quietly bright heavy narrow ancient gentle hollow distant crooked golden broken patient "
         "carried opened watched followed gathered painted counted mended crossed remembered whispered").split()


def fresh_prompt(tokenizer, num_tokens: int, seed: int) -> list[dict]:
    """Chat messages whose user text is about num_tokens tokens of random words, unique to `seed`."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(int(num_tokens * 1.1) + 16)]
    ids = tokenizer.encode(" ".join(words), add_special=False)
    text = tokenizer.decode(ids[:num_tokens])
    return [{"role": "system", "content": f"Session {seed:08d}-{rng.getrandbits(48):012x}. You are a helpful "
                                          f"assistant."},
            {"role": "user", "content": "Here are my notes:\n\n" + text + "\n\nWrite a long story that uses "
                                                                          "these words."}]


@dataclass
class StreamTiming:
    sent_s: float
    first_s: float  # first streamed token of the reply
    end_s: float
    prompt_tokens: int
    completion_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tok_s(self) -> float:
        return (self.completion_tokens - 1) / (self.end_s - self.first_s)


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                      max_tokens: int) -> StreamTiming:
    """One streamed, greedy request that decodes exactly max_tokens tokens (ignore_eos, which both servers
    honour); usage comes in the last chunk (stream_options.include_usage)."""
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
            if first is None and any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None or usage is None:
        raise RuntimeError(f"{url}: the stream brought no token or no usage")
    return StreamTiming(sent, first, end, usage["prompt_tokens"], usage["completion_tokens"])


async def one_prompt(url: str, model: str, messages: list[dict], max_tokens: int) -> StreamTiming:
    async with httpx.AsyncClient(timeout=3600) as client:
        return await stream_chat(client, url, model, messages, max_tokens)


async def concurrent(url: str, model: str, prompts: list[list[dict]], max_tokens: int) -> dict:
    """All prompts sent at once. TTFT: the median over the streams; aggregate decode: every stream's tokens
    after its first / (last finish - first first token), as scripts/bench_serve.py counts it."""
    async with httpx.AsyncClient(timeout=3600) as client:
        timings = await asyncio.gather(*[stream_chat(client, url, model, m, max_tokens) for m in prompts])
    span = max(t.end_s for t in timings) - min(t.first_s for t in timings)
    return {"ttft_s": statistics.median(t.ttft_s for t in timings),
            "decode_tok_s": sum(t.completion_tokens - 1 for t in timings) / span,
            "prompt_tokens": statistics.median(t.prompt_tokens for t in timings)}
