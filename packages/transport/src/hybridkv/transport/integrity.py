"""Integrity tags: a keyed BLAKE2b tag over each object's key and bytes, checked on load.

Anyone who reaches a Mooncake transfer port can write into the pool's segments (see
docs/security.md): without a tag, bytes changed there load as KV. `TaggedStore` wraps a
`Store`: each object is written with a 64-byte header in front of its bytes (the tag, the
payload length, a magic) and every whole read checks it; a mismatch answers the key
`Status.TAG_MISMATCH`, a failed load like any other (the block is quarantined and
recomputed), never used.

Why one tag per whole object, in front: the tag is checked as the read returns, before any
byte is scattered from staging into the caches or the step that needs the KV runs, and
whole reads are what host caches use (staged, or in place when an object is one run of
memory). A layer-by-layer read from the pool (granularity "layer") could check a whole
object's tag only after its last layer, once earlier layers were used, and per-range tags
would bind the tag to one reader's cut of the object: ranged calls are refused, and the
integration refuses integrity with that granularity. The tag is computed by the CPU over
host memory, so caches on an accelerator cannot be tagged (refused at start-up too).

The secret never leaves the environment variable that holds it: the tag key is derived
from it (BLAKE2b with its own personalisation), and neither is logged. Objects written
without a tag, or with another secret, fail to load (their size or their tag differs).
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import struct
import threading
from collections.abc import Sequence

import numpy as np

from hybridkv.transport.errors import InvalidRequestError, Status
from hybridkv.transport.store import Offsets, Pointers, Sizes, Store, check_whole

HEADER_BYTES = 64
TAG_BYTES = 32
MIN_SECRET_BYTES = 16
_MAGIC = b"hkvtag01"
_LENGTH = struct.Struct("<Q")
# Header: tag (32 B), payload length (8 B, little-endian), magic (8 B), zeros (16 B).
_TAG, _LEN, _MAG = slice(0, TAG_BYTES), slice(32, 40), slice(40, 48)


class IntegrityKey:
    """The tag key, derived from a deployment secret; computes and checks tags."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the integrity secret must hold at least {MIN_SECRET_BYTES} bytes, "
                f"got {len(secret)}"
            )
        self._key = hashlib.blake2b(secret, digest_size=64, person=b"hkv-integrity").digest()

    def __repr__(self) -> str:
        return "IntegrityKey(<secret>)"

    @classmethod
    def from_env(cls, variable: str) -> IntegrityKey:
        """The key from the secret in environment variable `variable` (named, not held, by
        configuration files)."""
        secret = os.environ.get(variable)
        if not secret:
            raise ValueError(
                f"integrity_secret_env names {variable!r}, but that environment variable is "
                "unset or empty"
            )
        try:
            return cls(secret.encode())
        except ValueError as exc:
            raise ValueError(f"{variable}: {exc}") from exc

    def tag(self, key: str, ptrs: Pointers, sizes: Sizes) -> bytes:
        """The tag of object `key` whose bytes are the pieces `ptrs`/`sizes`, in order."""
        name = key.encode()
        mac = hashlib.blake2b(key=self._key, digest_size=TAG_BYTES, person=b"hkv-object-v1")
        mac.update(_LENGTH.pack(len(name)) + name + _LENGTH.pack(sum(sizes)))
        for ptr, size in zip(ptrs, sizes, strict=True):
            if size:
                mac.update((ctypes.c_ubyte * size).from_address(ptr))  # hashed without a copy
        return mac.digest()

    def write_header(self, header: np.ndarray, key: str, ptrs: Pointers, sizes: Sizes) -> None:
        header[:] = 0
        header[_TAG] = np.frombuffer(self.tag(key, ptrs, sizes), dtype=np.uint8)
        header[_LEN] = np.frombuffer(_LENGTH.pack(sum(sizes)), dtype=np.uint8)
        header[_MAG] = np.frombuffer(_MAGIC, dtype=np.uint8)

    def verify(self, header: np.ndarray, key: str, ptrs: Pointers, sizes: Sizes) -> bool:
        """Whether the header read with the pieces vouches for exactly these bytes."""
        if header[_MAG].tobytes() != _MAGIC:
            return False
        if _LENGTH.unpack(header[_LEN].tobytes())[0] != sum(sizes):
            return False
        return hmac.compare_digest(header[_TAG].tobytes(), self.tag(key, ptrs, sizes))


class _Headers:
    """Per-thread header memory (a call's headers, one row per key), registered with the
    store like any memory a transfer moves, grown as a call needs and released at close."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._local = threading.local()
        self._lock = threading.Lock()
        self._arenas: list[np.ndarray] = []

    def rows(self, count: int) -> np.ndarray:
        arena: np.ndarray | None = getattr(self._local, "arena", None)
        if arena is None or len(arena) < count:
            grown = np.zeros((max(count, 64, 2 * len(arena) if arena is not None else 0),
                              HEADER_BYTES), dtype=np.uint8)  # fmt: skip
            self._store.register_buffer(int(grown.ctypes.data), grown.nbytes)
            with self._lock:
                self._arenas.append(grown)
            self._local.arena = arena = grown
        return arena[:count]

    def release(self) -> None:
        with self._lock:
            arenas, self._arenas = self._arenas, []
        for arena in arenas:
            self._store.unregister_buffer(int(arena.ctypes.data))


class TaggedStore:
    """A `Store` whose objects carry an integrity tag (see the module docstring).

    Whole puts write the header from this process's memory in front of the object's
    pieces; whole reads read it into the same memory and check the tag before answering.
    Everything that moves no object bytes passes through unchanged.
    """

    def __init__(self, inner: Store, key: IntegrityKey) -> None:
        self.inner = inner
        self._key = key
        self._headers = _Headers(inner)

    def register_buffer(self, ptr: int, size: int) -> None:
        self.inner.register_buffer(ptr, size)

    def unregister_buffer(self, ptr: int) -> None:
        self.inner.unregister_buffer(ptr)

    def batch_is_readable(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.batch_is_readable(keys)

    def batch_put_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        check_whole("batch_put_whole", keys, ptrs, sizes)
        headers = self._headers.rows(len(keys))
        for header, key, key_ptrs, key_sizes in zip(headers, keys, ptrs, sizes, strict=True):
            self._key.write_header(header, key, key_ptrs, key_sizes)
        return self.inner.batch_put_whole(keys, *_with_headers(headers, ptrs, sizes))

    def batch_get_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        check_whole("batch_get_whole", keys, ptrs, sizes)
        headers = self._headers.rows(len(keys))
        statuses = self.inner.batch_get_whole(keys, *_with_headers(headers, ptrs, sizes))
        return [
            status
            if not status.ok or self._key.verify(header, key, key_ptrs, key_sizes)
            else Status.TAG_MISMATCH
            for status, header, key, key_ptrs, key_sizes in zip(
                statuses, headers, keys, ptrs, sizes, strict=True
            )
        ]

    def put_session_start(self, keys: Sequence[str], object_sizes: Sequence[int]) -> list[Status]:
        raise _ranged("put_session_start")

    def put_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        raise _ranged("put_ranges")

    def put_session_end(self, keys: Sequence[str]) -> list[Status]:
        raise _ranged("put_session_end")

    def put_session_revoke(self, keys: Sequence[str]) -> list[Status]:
        return self.inner.put_session_revoke(keys)  # drops, never writes: harmless

    def get_session_start(self, keys: Sequence[str]) -> list[Status]:
        raise _ranged("get_session_start")

    def get_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        raise _ranged("get_ranges")

    def get_session_end(self, keys: Sequence[str]) -> None:
        self.inner.get_session_end(keys)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[Status]:
        return self.inner.batch_remove(keys, force)

    def remove_by_prefix(self, prefix: str, force: bool = False) -> int:
        return self.inner.remove_by_prefix(prefix, force)

    def close(self) -> None:
        try:
            self._headers.release()
        finally:
            self.inner.close()


def _with_headers(
    headers: np.ndarray, ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
) -> tuple[list[list[int]], list[list[int]]]:
    """Each key's pieces behind its header row."""
    base, stride = int(headers.ctypes.data), headers.strides[0]
    return (
        [[base + row * stride, *key_ptrs] for row, key_ptrs in enumerate(ptrs)],
        [[HEADER_BYTES, *key_sizes] for key_sizes in sizes],
    )


def _ranged(operation: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{operation}: objects with integrity tags move whole (granularity 'staged' or "
        "'group'); a ranged read could check the tag only after its last range"
    )
