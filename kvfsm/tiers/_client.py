"""What the remote tiers share: values kept under a key prefix by a store client they own, and
the health of the store as their calls find it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfsm.tiers._contract import BlockKey, StoredTier, TierError
from kvfsm.tiers._health import Health


class ClientTier(StoredTier):
    """A stored tier over a store's client (``_client``, set by the subclass; None once
    closed), naming each value ``prefix + key.name``; ``_health`` (set by the subclass) is
    what :attr:`available` and :attr:`last_error` report."""

    prefix: str
    _client: Any = None
    _health: Health

    @property
    def client(self) -> Any:
        """The store's client underneath (for tools and tests)."""
        if self._client is None:
            raise TierError(f"this {type(self).__name__} is closed")
        return self._client

    @property
    def available(self) -> bool:
        return self._health.available

    @property
    def last_error(self) -> str | None:
        return self._health.last_error

    def close(self) -> None:
        """Close the client (what happens to the stored values is the store's: see the
        subclass)."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _names(self, keys: Sequence[BlockKey]) -> list[str]:
        return [self.prefix + key.name for key in keys]
