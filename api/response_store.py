"""Responses kept in memory for ``previous_response_id`` and ``GET /v1/responses/{id}``.

``store: true`` (the OpenAI default) keeps a response; ``store: false`` (what Codex sends: it resends the
whole history every turn) keeps nothing. Memory is bounded: the least recently used response is dropped
past ``capacity``, and a conversation that names a dropped one gets the same 404 as an unknown id. The KV
cache does not depend on this store: a stored conversation re-renders to the same prompt prefix either way.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from api.errors import INVALID_REQUEST, APIError

DEFAULT_CAPACITY = 256


@dataclass(frozen=True)
class StoredResponse:
    """A finished Response object and the conversation it ends: every input item of the chain so far, then
    its own output items (``instructions`` are not carried over, as in OpenAI's API)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """An LRU map response id -> StoredResponse, safe to use from the event loop and worker threads."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = StoredResponse(response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 in OpenAI's error shape (naming ``param``) when it is unknown."""
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
                return found
        raise APIError(404, f"Response with id '{response_id}' not found. Only responses created with "
                            f"store=true are kept, and only the last {self.capacity} of them.",
                       INVALID_REQUEST, param=param, code="previous_response_not_found" if param else "not_found")

    def __len__(self) -> int:
        return len(self._items)
