"""Put sessions a revoke may have left open, revoked again before their keys are reused.

A revoke the pool did not confirm (the call raised, or a key reported a failure other than
"no such session") may leave the session open: nobody else can write the key, and this
client's own next start on it reports INVALID, for as long as the client lives. So the
keys are remembered, revoked again just before a session on them is opened (their writer
settled; the engine lets no other write of them run meanwhile), and once more at close.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from hybridkv.transport.errors import Status, StoreError
from hybridkv.transport.store import Store

log = logging.getLogger(__name__)

# Statuses after which no put session of this client is open for the key: revoked, or
# none to revoke (ended already, never opened, or another client's).
_CLOSED = frozenset({Status.OK, Status.INVALID, Status.NOT_FOUND})


class StaleSessions:
    """The keys of one client whose revoke is unconfirmed; safe from any thread."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._keys: set[str] = set()
        self._lock = threading.Lock()

    def revoke(self, keys: Sequence[str]) -> None:
        """Revoke the sessions of `keys`, remembering each the pool did not confirm (all
        of them when the client raises, which this re-raises)."""
        try:
            unconfirmed = self._unconfirmed(keys)
        except BaseException:
            with self._lock:
                self._keys.update(keys)
            raise
        with self._lock:
            self._keys.difference_update(keys)
            self._keys.update(unconfirmed)

    def revoke_again(self, keys: Iterable[str]) -> None:
        """Before sessions on `keys` open: revoke those of them still remembered."""
        with self._lock:
            if not self._keys:  # nearly always: every save passes its keys through here
                return
            again = [key for key in keys if key in self._keys]
        self.revoke(again)

    def revoke_all(self) -> None:
        """At close: one last try for every remembered key; logs what stays open."""
        with self._lock:
            keys = sorted(self._keys)
        try:
            self.revoke(keys)
        except Exception:  # the client is closing: what it could not revoke is logged below
            log.warning("put_session_revoke of %d keys raised at close", len(keys), exc_info=True)
        with self._lock:
            left = len(self._keys)
        if left:
            log.warning("%d put sessions may stay open: their revoke was never confirmed", left)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def _unconfirmed(self, keys: Sequence[str]) -> set[str]:
        if not keys:
            return set()
        try:
            statuses = self._store.put_session_revoke(keys)
        except StoreError as exc:
            log.warning("put_session_revoke of %d keys failed: %s", len(keys), exc)
            return set(keys)
        return {key for key, status in zip(keys, statuses, strict=True) if status not in _CLOSED}
