"""Outcomes of store calls, typed so callers branch on meaning rather than on numbers.

Mooncake reports per-key integer codes; hybridkv maps each to a `Status` member and raises
`StoreError` subclasses where a whole call cannot proceed.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """What happened to one key in a batch call."""

    OK = 0
    NO_SPACE = -200
    INVALID = -600
    NOT_READY = -703
    NOT_FOUND = -704
    LEASED = -706
    EXISTS = -707  # placeholder value; the stores helper must check Mooncake's real code
    TRANSFER_FAILED = -800
    RPC_FAILED = -900
    OTHER = -1

    @property
    def ok(self) -> bool:
        return self is Status.OK


class StoreError(RuntimeError):
    """A store call that could not proceed at all."""


class StoreClosed(StoreError):
    """The store was closed; Mooncake would crash on this call, so it is refused here."""


class StoreUnavailable(StoreError):
    """The master or the segment holding the data cannot be reached."""


class UnsupportedClient(StoreError):
    """The installed Mooncake client lacks the range/session API hybridkv needs."""
