"""Outcomes of store calls, typed so callers branch on meaning rather than on numbers.

Mooncake reports per-key integer codes (`ErrorCode` in mooncake-store/include/types.h);
hybridkv maps each to a `Status` member and raises `StoreError` subclasses where a whole
call cannot proceed. The member values are Mooncake's own codes so logs of both agree.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class Status(enum.Enum):
    """What happened to one key in a batch call."""

    OK = 0
    NO_SPACE = -200  # NO_AVAILABLE_HANDLE: no segment has room for the object
    INVALID = -600  # INVALID_PARAMS: bad range, size mismatch, no open session for the key
    NOT_READY = -703  # REPLICA_IS_NOT_READY: allocated in an open put session, not committed
    NOT_FOUND = -704  # OBJECT_NOT_FOUND
    EXISTS = -705  # OBJECT_ALREADY_EXISTS: a put session on a committed key
    LEASED = -706  # OBJECT_HAS_LEASE: remove refused right after a read
    TRANSFER_FAILED = -800  # TRANSFER_FAIL: the segment holding the bytes is gone
    RPC_FAILED = -900  # RPC_FAIL: the master cannot be reached
    OTHER = -1  # INTERNAL_ERROR and every code hybridkv has no better name for
    # hybridkv's own, never Mooncake's: the object's integrity tag does not vouch for the
    # bytes read (changed in the pool, or written with another secret or none)
    TAG_MISMATCH = -10_000

    @property
    def ok(self) -> bool:
        return self is Status.OK

    @classmethod
    def from_code(cls, code: int) -> Status:
        """Map one Mooncake result; non-negative results (byte counts) mean success."""
        if code >= 0:
            return cls.OK
        return _STATUS_OF_CODE.get(code, cls.OTHER)


# Mooncake codes that mean the same thing to hybridkv as one of the members above.
_STATUS_OF_CODE: dict[int, Status] = {status.value: status for status in Status} | {
    -10: Status.INVALID,  # BUFFER_OVERFLOW
    -101: Status.NO_SPACE,  # SEGMENT_NOT_FOUND: no segment mounted at all
    -400: Status.INVALID,  # INVALID_KEY
    -700: Status.INVALID,  # INVALID_WRITE
    -701: Status.INVALID,  # INVALID_READ
    -702: Status.INVALID,  # INVALID_REPLICA: e.g. a ranged call with no pieces
    -707: Status.TRANSFER_FAILED,  # LEASE_EXPIRED before the transfer completed
    -710: Status.NOT_FOUND,  # REPLICA_NOT_FOUND
    -711: Status.EXISTS,  # REPLICA_ALREADY_EXISTS
    -712: Status.NOT_FOUND,  # REPLICA_IS_GONE
    -500: Status.TRANSFER_FAILED,  # WRITE_FAIL
    -901: Status.RPC_FAILED,  # RPC_TIMEOUT: the master did not answer in time
}


class StoreError(RuntimeError):
    """A store call that could not proceed at all."""


class StoreClosed(StoreError):  # noqa: N818 (named in the package contract)
    """The store was closed; Mooncake would crash on this call, so it is refused here."""


class StoreUnavailable(StoreError):  # noqa: N818 (named in the package contract)
    """The master or the segment holding the data cannot be reached."""


class CalledOff(StoreError):  # noqa: N818 (what happened, as its siblings say)
    """A save's waiter gave up on it: a call that would read the caches was not made."""


class UnsupportedClient(StoreError):  # noqa: N818 (named in the package contract)
    """The installed Mooncake client lacks the range/session API hybridkv needs."""


class NoSpaceError(StoreError):
    """The pool has no room for the object (evict, shrink, or mount more segments)."""


class NotFoundError(StoreError):
    """The object is not in the pool (never written, removed, evicted or not committed)."""


class TransferError(StoreError):
    """The bytes could not be moved: the segment holding them is gone or broke mid-copy."""


class InvalidRequestError(StoreError, ValueError):
    """The call itself is malformed: a range out of bounds, a size mismatch, no session."""


_ERROR_OF_STATUS: dict[Status, type[StoreError]] = {
    Status.NO_SPACE: NoSpaceError,
    Status.INVALID: InvalidRequestError,
    Status.NOT_READY: NotFoundError,
    Status.NOT_FOUND: NotFoundError,
    Status.TRANSFER_FAILED: TransferError,
    Status.RPC_FAILED: StoreUnavailable,
}


def error_for(status: Status, key: str, operation: str) -> StoreError:
    """The exception naming what happened to `key` in `operation`."""
    error_type = _ERROR_OF_STATUS.get(status, StoreError)
    return error_type(f"{operation} of {key!r} failed: {status.name} ({status.value})")


def raise_on_failure(operation: str, keys: Sequence[str], statuses: Sequence[Status]) -> None:
    """Raise for the first failed key, for callers that need all keys to succeed."""
    for key, status in zip(keys, statuses, strict=True):
        if not status.ok:
            raise error_for(status, key, operation)
