"""The workloads scripts/bench_cache.py replays, and the replayer that sends them and counts each request's
computed tokens against the ideal (the prompt's ids as the server makes them)."""
from __future__ import annotations

import itertools
import time

import httpx

from api.chat_turn import ChatTurn, encode_turn, render_turn
from api.completions import chat_turn_from_body
from api.schemas import ChatCompletionRequest
from api.tool_specs import normalise_tools
from engine.loader import encode_chat_prompt
from scheduler.cache.tree import common_prefix_len

TOOLS = [[{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing", "parameters": {}}}
          for i in range(n)] for n in (3, 6)]
TOPICS = ["the history of Rome", "how plants make food", "the water cycle", "how engines work"]
REPLY_TOKENS = 16  # max_tokens of every request
CALL_TOKENS = 96  # max_tokens of a tool loop's requests (a whole call)


class Replayer:
    def __init__(self, url, loaded, state, temperature=0.0):
        self.url, self.loaded, self.state, self.seen, self.rows = url, loaded, state, [], []
        self.temperature, self.seeds = temperature, itertools.count(1)

    def turn(self, messages, tools=None, first_of_conversation=False, tool_choice=None):
        """One streamed request; returns the reply's content, or with tool_choice its whole message."""
        body = {"model": self.state.served_name, "messages": messages, "temperature": self.temperature,
                "max_tokens": CALL_TOKENS if tool_choice else REPLY_TOKENS, "seed": next(self.seeds),
                "stream": True, "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = tools
        if tool_choice:  # one call a turn: the loop's turns are whole calls, never a call cut by max_tokens
            body.update(tool_choice=tool_choice, parallel_tool_calls=False)
        started, ttft, text, calls, usage = time.perf_counter(), None, [], {}, None
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                if delta.get("content") or delta.get("tool_calls"):
                    ttft = ttft or time.perf_counter() - started
                text.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    held = calls.setdefault(call["index"], {"id": "", "type": "function",
                                                            "function": {"name": "", "arguments": ""}})
                    held["id"] = call.get("id") or held["id"]
                    held["function"]["name"] += call.get("function", {}).get("name") or ""
                    held["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
        message = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        # The prompt's ids as the server has them: rendered (a template that does not render tools gets them
        # described in the system prompt by the generic tool format), the replies it generated kept as
        # generated; and what this request leaves cached: those ids, then the reply's (as the next prompt
        # that carries it has them).
        prompt = self._ids(body)
        assert len(prompt) == usage["prompt_tokens"], "the bench renders another prompt than the server"
        shared = max((common_prefix_len(prompt, s) for s in self.seen), default=0)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        computed = usage["prompt_tokens"] - cached
        # An earlier request this prompt carries whole, its reply included: what of it was computed again
        # (its last token, sampled and never fed back, not counted)
        carried = max((len(s) for s in self.seen if len(s) < len(prompt) and prompt[:len(s)] == s), default=0)
        self.rows.append({"prompt": usage["prompt_tokens"], "computed": computed,
                          "ideal": len(prompt) - shared + 1, "ttft": ttft or 0.0, "shared": shared,
                          "reply_recomputed": max(0, carried - 1 - cached),
                          "reread": not first_of_conversation and computed > 0.9 * usage["prompt_tokens"]})
        after = self._ids({**body, "messages": messages + [message], "add_generation_prompt": False})
        self.seen.append(after[:usage["prompt_tokens"] + usage["completion_tokens"]])
        return message if tool_choice else message["content"] or ""

    def _ids(self, body):
        """A body's prompt ids as the server makes them (api/completions.py, api/chat_turn.py)."""
        turn = chat_turn_from_body(ChatCompletionRequest.model_validate(body))
        return encode_turn(self.state, turn, render_turn(self.state, turn), "").ids


class DryReplayer:
    """Renders a workload's prompts without a server, each reply a placeholder of REPLY_TOKENS digits (one
    token each in SmolLM2's and the tiny lfm2's vocabularies), to find its longest request beforehand."""

    def __init__(self, loaded, state):
        self.loaded, self.state, self.longest = loaded, state, 0

    def turn(self, messages, tools=None, first_of_conversation=False, tool_choice=None):
        text = render_turn(self.state, ChatTurn(messages, normalise_tools(tools)))
        prompt = encode_chat_prompt(self.loaded.tokenizer, text)
        self.longest = max(self.longest, len(prompt) + (CALL_TOKENS if tool_choice else REPLY_TOKENS))
        if tool_choice:
            call = {"name": "get_weather", "arguments": '{"city": "' + "0" * 12 + '"}'}
            return {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "call_0", "type": "function", "function": call}]}
        return "0" * REPLY_TOKENS


def trimmed_turns(replayer, turns):
    """One conversation whose history is cut to the system message and the last exchange every turn."""
    history = [{"role": "system", "content": "You are a terse assistant. " * 4},
               {"role": "user", "content": f"Tell me about {TOPICS[0]}."}]
    for t in range(turns):
        reply = replayer.turn(history, first_of_conversation=t == 0)
        history = [history[0]] + history[-1:] + [{"role": "assistant", "content": reply},
                                                 {"role": "user", "content": f"Go on with part {t + 2}."}]


def fan_out_turns(replayer, turns):
    """One context (a long document and its summary), then one question over it per turn."""
    context = [{"role": "system", "content": "You answer questions about the document."},
               {"role": "user", "content": "Document: " + " ".join(TOPICS) * 3 + " Summarise it."}]
    summary = replayer.turn(context, first_of_conversation=True)
    context.append({"role": "assistant", "content": summary})
    for t in range(turns):
        replayer.turn(context + [{"role": "user", "content": f"Question {t}: what about {TOPICS[t % 4]}?"}])


def conversation_turns(replayer, names, turns, between=None, tools_for=None):
    history = {n: [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
               for i, n in enumerate(names)}
    for t in range(turns):
        for name in names:
            tools = tools_for(t) if tools_for else None
            reply = replayer.turn(history[name], tools, first_of_conversation=t == 0)
            history[name] += [{"role": "assistant", "content": reply},
                              {"role": "user", "content": f"Go on with part {t + 2}, in more detail."}]
            if between:
                replayer.turn([{"role": "user", "content": f"Quick: what is {t} plus {t}?"}],
                              first_of_conversation=True)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def tool_loop_turns(replayer, turns):
    """One agent loop: every turn the model must call the tool, once (tool_choice required, parallel_tool_calls
    false: the format's grammar), the call goes back as the client sends it (``tool_calls``, rendered by the template or, generic format,
    by the server), with its result."""
    history = [{"role": "user", "content": "What is the weather in " + ", then in ".join(TOPIC_CITIES) + "?"}]
    for t in range(turns):
        message = replayer.turn(history, [WEATHER], first_of_conversation=t == 0, tool_choice="required")
        calls = message.get("tool_calls") or []
        history += [message] + [{"role": "tool", "tool_call_id": c["id"], "content": f"{12 + t} degrees, clear"}
                                for c in calls]
        if not calls:  # a reply cut before its call ended (max_tokens): the loop goes on from a user turn
            history.append({"role": "user", "content": "Go on."})


TOPIC_CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Quito", "Hanoi", "Perth"]

WORKLOADS = {
    "two alternating": lambda r, n: conversation_turns(r, ["a", "b"], n),
    "short request between turns": lambda r, n: conversation_turns(r, ["a"], n, between=True),
    "toggling tool list": lambda r, n: conversation_turns(r, ["a"], n, tools_for=lambda t: TOOLS[t % 2]),
    "4 conversations, 2 slots": lambda r, n: conversation_turns(r, ["a", "b", "c", "d"], n),
    "trimmed history": trimmed_turns,
    "fan-out over one context": fan_out_turns,
}
EXTRA_WORKLOADS = {"tool loop": tool_loop_turns}  # --only "tool loop" (a model that can take a tool grammar)
