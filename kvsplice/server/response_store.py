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
responses; storing one more evicts that tenant's oldest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_MAX_PER_TENANT = 1024


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its `body` (the answer as sent), the chat messages up to and including its
    reply, and the id of its chain's first response."""

    response_id: str
    root_id: str
    history: tuple[dict[str, Any], ...]
    body: dict[str, Any]


class ResponseStore:
    """Stored responses by (tenant, id), oldest evicted first within a tenant. Thread-safe (handlers
    read it on the event loop, answers are stored from worker threads too)."""

    def __init__(self, max_per_tenant: int = DEFAULT_MAX_PER_TENANT):
        if max_per_tenant < 1:
            raise ValueError(f"max_per_tenant: must be >= 1, got {max_per_tenant}")
        self.max_per_tenant = max_per_tenant
        self._by_tenant: dict[Optional[str], OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def put(self, owner: Optional[str], stored: StoredResponse) -> None:
        with self._lock:
            responses = self._by_tenant.setdefault(owner, OrderedDict())
            responses[stored.response_id] = stored
            responses.move_to_end(stored.response_id)
            while len(responses) > self.max_per_tenant:
                responses.popitem(last=False)

    def get(self, owner: Optional[str], response_id: str) -> Optional[StoredResponse]:
        """The tenant's response of that id, or None (missing, evicted, or another tenant's)."""
        with self._lock:
            return self._by_tenant.get(owner, {}).get(response_id)

    def delete(self, owner: Optional[str], response_id: str) -> bool:
        """Remove the tenant's response of that id; False when it has none."""
        with self._lock:
            return self._by_tenant.get(owner, {}).pop(response_id, None) is not None

    def count(self, owner: Optional[str]) -> int:
        with self._lock:
            return len(self._by_tenant.get(owner, {}))
