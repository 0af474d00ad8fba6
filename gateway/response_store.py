"""Stored responses (/v1/responses with store: true), kept in memory per API key and bounded.

Each API key has its own shelf, so one client can neither read another's responses nor push
them out: per key, at most max_count responses and max_bytes bytes (the oldest are dropped
first), each kept for max_age seconds. A response is stored with its conversation (the input
items that led to it, then its output items), which is what previous_response_id continues.
An id that is unknown, expired or another key's is simply not found.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as GET /v1/responses/{id} returns it
    conversation: list[dict]  # input items then output items, as a later request's input would hold them
    size: int  # bytes of both, as JSON
    expires: float


class ResponseStore:
    def __init__(
        self, max_count: int, max_bytes: int, max_age: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.clock = clock
        self._shelves: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}

    @staticmethod
    def owner(api_key: bytes | None) -> str:
        """The shelf of an API key (a digest: the store keeps no keys); one shelf when the server has none."""
        return "" if api_key is None else hashlib.sha256(api_key).hexdigest()

    def put(self, owner: str, response_id: str, body: dict, conversation: list[dict]) -> bool:
        """Keep a response, dropping the owner's oldest as needed; False when it alone exceeds the limits."""
        size = len(json.dumps(body, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes or self.max_count < 1 or self.max_age <= 0:
            return False
        self._expire(owner)
        shelf = self._shelves.get(owner)
        while shelf and (len(shelf) >= self.max_count or self._bytes[owner] + size > self.max_bytes):
            self._drop(owner, next(iter(shelf)))
        self._shelves.setdefault(owner, OrderedDict())[response_id] = StoredResponse(
            body, conversation, size, self.clock() + self.max_age
        )
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        self._expire(owner)
        return self._shelves.get(owner, {}).get(response_id)

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        self._drop(owner, response_id)
        return True

    def __len__(self) -> int:
        return sum(len(shelf) for shelf in self._shelves.values())

    def _expire(self, owner: str) -> None:
        shelf = self._shelves.get(owner)
        now = self.clock()
        while shelf and next(iter(shelf.values())).expires <= now:  # kept in order of expiry
            self._drop(owner, next(iter(shelf)))

    def _drop(self, owner: str, response_id: str) -> None:
        stored = self._shelves[owner].pop(response_id)
        self._bytes[owner] -= stored.size
        if not self._shelves[owner]:
            del self._shelves[owner]
            del self._bytes[owner]
