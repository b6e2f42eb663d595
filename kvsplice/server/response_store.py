"""Stored responses of the Responses API (`store: true`), per tenant, for `previous_response_id`,
`GET` and `DELETE /v1/responses/{id}`.

Each stored response keeps its answer body and the conversation up to and including its reply, as
chat messages (`history`, without `instructions`: the API does not carry them over to a chained
request), and the id of its chain's first response (`root_id`: the chain's SCR session is named after
it, so every turn of a chain finds its predecessor's K/V by session id). A chained history shares
the message objects of the one before it, so a chain of n turns costs n lists of references, not n
copies of the text.

Tenancy: a response is found only by the tenant (the API key's owner) that stored it; another
tenant's id is answered exactly like a missing one. Each tenant keeps at most `max_per_tenant`
responses and at most `max_chars_per_tenant` characters of history (each response's whole history
counted, shared or not, so the bound holds whatever clients send); storing one more evicts that
tenant's oldest until both hold, never the newest (a chain can always go on from its last turn, and
evicting oldest first drops a chain's early turns, which continuing it does not need).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_MAX_PER_TENANT = 1024
DEFAULT_MAX_CHARS_PER_TENANT = 1 << 25


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its `body` (the answer as sent), the chat messages up to and including its
    reply, and the id of its chain's first response."""

    response_id: str
    root_id: str
    history: tuple[dict[str, Any], ...]
    body: dict[str, Any]

    @property
    def chars(self) -> int:
        """Characters of text in the history (contents, reasoning, call arguments)."""
        total = 0
        for message in self.history:
            total += len(message.get("content") or "") + len(message.get("reasoning_content") or "")
            total += sum(len(call["function"]["arguments"]) for call in message.get("tool_calls") or ())
        return total


class ResponseStore:
    """Stored responses by (tenant, id), oldest evicted first within a tenant. Thread-safe (handlers
    read it on the event loop, answers are stored from worker threads too)."""

    def __init__(self, max_per_tenant: int = DEFAULT_MAX_PER_TENANT,
                 max_chars_per_tenant: int = DEFAULT_MAX_CHARS_PER_TENANT):
        for name, value in (("max_per_tenant", max_per_tenant), ("max_chars_per_tenant", max_chars_per_tenant)):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.max_per_tenant, self.max_chars_per_tenant = max_per_tenant, max_chars_per_tenant
        self._by_tenant: dict[Optional[str], OrderedDict[str, tuple[StoredResponse, int]]] = {}
        self._chars: dict[Optional[str], int] = {}
        self._lock = threading.Lock()

    def put(self, owner: Optional[str], stored: StoredResponse) -> None:
        chars = stored.chars
        with self._lock:
            responses = self._by_tenant.setdefault(owner, OrderedDict())
            self._drop(owner, stored.response_id)
            responses[stored.response_id] = (stored, chars)
            self._chars[owner] = self._chars.get(owner, 0) + chars
            while len(responses) > 1 and (len(responses) > self.max_per_tenant
                                          or self._chars[owner] > self.max_chars_per_tenant):
                self._drop(owner, next(iter(responses)))

    def _drop(self, owner: Optional[str], response_id: str) -> bool:
        entry = self._by_tenant.get(owner, {}).pop(response_id, None)
        if entry is None:
            return False
        self._chars[owner] -= entry[1]
        return True

    def get(self, owner: Optional[str], response_id: str) -> Optional[StoredResponse]:
        """The tenant's response of that id, or None (missing, evicted, or another tenant's)."""
        with self._lock:
            entry = self._by_tenant.get(owner, {}).get(response_id)
            return entry[0] if entry is not None else None

    def delete(self, owner: Optional[str], response_id: str) -> bool:
        """Remove the tenant's response of that id; False when it has none."""
        with self._lock:
            return self._drop(owner, response_id)

    def count(self, owner: Optional[str]) -> int:
        with self._lock:
            return len(self._by_tenant.get(owner, {}))
