"""Content-chained hashes of full token blocks, equal in every process and every run.

vLLM's own block hashes depend on ``PYTHONHASHSEED`` unless every instance pins it; these do
not: they are SHA-256 over a fixed byte encoding, so a prefix computed by one instance is
found by any other. The hash of block ``i`` is

    H_i = sha256(H_{i-1} || X_i || T_i)

where ``H_{-1} = sha256(b"hybridkv-block-hash-v1\\0" || block_size as 8 bytes little-endian
|| namespace as UTF-8)``, ``T_i`` is the block's token ids as 4-byte little-endian unsigned
integers and ``X_i`` is empty without an extra, else ``sha256`` of the extra as compact JSON
with sorted keys. Dict keys must be str (JSON would make ``{1: x}`` and ``{"1": x}`` one
extra); tuples encode as lists, the same JSON array. Every field has a fixed length or
comes last, so no two inputs share an encoding. Hashing a block is one C call on bytes cut
from one buffer converted once per call, which is what makes pure Python fast enough for
long prompts.

A prefix that ends inside a block (``n`` tokens, ``n`` not a multiple of the block size,
``k = n // block_size`` full blocks before it) has the partial hash

    P_n = sha256(b"hybridkv-partial-hash-v1\\0" || H_{k-1} || m as 4 bytes LE || X || T)

with ``T`` the ``m = n - k * block_size`` token ids after the last full block: the tag keeps
it apart from every block hash and ``m`` says where ``X`` ends.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence

from ._json_keys import refuse_coerced_keys

_SEED_TAG = b"hybridkv-block-hash-v1\0"
_PARTIAL_TAG = b"hybridkv-partial-hash-v1\0"
_TOKEN_BYTES = 4
# The array typecode of a 4-byte unsigned int ("I" on every mainstream platform).
_TOKEN_TYPECODE = next(code for code in "IL" if array.array(code).itemsize == _TOKEN_BYTES)


def _token_bytes(token_ids: Iterable[int]) -> bytes:
    # array.array would take bytes/bytearray as raw machine words (4 bytes -> one token).
    if isinstance(token_ids, (bytes, bytearray)):
        raise TypeError(
            f"token_ids must be ints, got {type(token_ids).__name__}: its raw bytes are not "
            "token ids (pass list(...) to mean one token per byte)"
        )
    try:
        tokens = array.array(_TOKEN_TYPECODE, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token_ids: every token id must be in [0, 2**32): {exc}") from exc
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tobytes()


def _extra_bytes(extra: object) -> bytes:
    if extra is None:
        return b""
    refuse_coerced_keys(extra, "extra")
    try:
        text = json.dumps(extra, sort_keys=True, separators=(",", ":"))
    except TypeError as exc:
        raise TypeError(f"extra must be a JSON value: {exc}") from exc
    return hashlib.sha256(text.encode()).digest()


class BlockHasher:
    """Chained hashes of the full ``block_size``-token blocks of one request's tokens.

    Feed tokens with ``extend`` as they arrive; earlier blocks are never rehashed, and a
    trailing partial block waits for the tokens that complete it.

    ``extra`` is what else makes a block's KV differ from another with the same tokens (LoRA
    name, cache salt, multimodal feature hashes). It is folded into every block *completed by
    that call* (blocks finished earlier keep their hash; through the chain it reaches every
    later block). Hashes must not depend on how tokens were split between calls, so pass
    request-level extras on every call; an extra that covers only some tokens (a multimodal
    feature) must be passed with the call that completes each block it overlaps.
    """

    __slots__ = ("_block_size", "_hashes", "_num_tokens", "_pending", "_seed")

    def __init__(self, block_size: int, namespace: str) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if not 1 <= block_size < 1 << 32:
            raise ValueError(f"block_size must be positive and below 2**32, got {block_size}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        self._block_size = block_size
        self._seed = hashlib.sha256(
            _SEED_TAG + block_size.to_bytes(8, "little") + namespace.encode()
        ).digest()
        self._hashes: list[bytes] = []
        self._pending = b""
        self._num_tokens = 0

    @property
    def block_size(self) -> int:
        """Tokens per hashed block."""
        return self._block_size

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far, the partial last block included."""
        return self._num_tokens

    @property
    def hashes(self) -> list[bytes]:
        """One 32-byte hash per full block so far (a copy)."""
        return list(self._hashes)

    def extend(self, token_ids: Iterable[int], extra: object = None) -> list[bytes]:
        """Appends tokens; returns the hashes of the blocks this call completed."""
        salt = _extra_bytes(extra)
        tokens = _token_bytes(token_ids)
        data = self._pending + tokens
        step = self._block_size * _TOKEN_BYTES
        full = len(data) - len(data) % step
        previous = self._hashes[-1] if self._hashes else self._seed
        sha256 = hashlib.sha256
        completed = []
        for start in range(0, full, step):
            previous = sha256(previous + salt + data[start : start + step]).digest()
            completed.append(previous)
        self._hashes.extend(completed)
        self._pending = data[full:]
        self._num_tokens += len(tokens) // _TOKEN_BYTES
        return completed

    def rewind(self, tokens: int) -> None:
        """Forgets the tokens fed from position ``tokens`` on, and every block reaching them.

        For tokens that changed after they were fed (a streaming session drops the token it
        sampled last, then appends the next input). A partly forgotten block cannot be
        rebuilt from its hash, so afterwards ``num_tokens`` (at most ``tokens``) says where
        to feed from again.
        """
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
        if tokens < 0:
            raise ValueError(f"tokens must not be negative, got {tokens}")
        if tokens >= self._num_tokens:
            return
        blocks = tokens // self._block_size
        if blocks < len(self._hashes):
            del self._hashes[blocks:]
            self._pending = b""
            self._num_tokens = blocks * self._block_size
        else:
            self._pending = self._pending[: (tokens - blocks * self._block_size) * _TOKEN_BYTES]
            self._num_tokens = tokens

    def boundary_hash(self, tokens: int) -> bytes:
        """The chain hash at ``tokens``, a positive multiple of block_size already hashed."""
        blocks = self._blocks_in("tokens", tokens)
        if blocks > len(self._hashes):
            raise ValueError(
                f"tokens {tokens} is past the {len(self._hashes) * self._block_size} "
                "tokens hashed in full blocks"
            )
        return self._hashes[blocks - 1]

    def partial_hash(self, tokens: int, token_ids: Sequence[int], extra: object = None) -> bytes:
        """The hash of the first ``tokens`` of ``token_ids``, a prefix ending inside a block.

        Names what a prefix cut mid-block leaves behind (a recurrent state after exactly
        those tokens), so a later request with the same prefix finds it. The full blocks
        before it must be hashed already; pass the extra given to ``extend``.
        """
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
        full, rest = divmod(tokens, self._block_size)
        if tokens <= 0 or not rest:
            raise ValueError(
                f"tokens must be positive and not a multiple of block_size {self._block_size}, "
                f"got {tokens}"
            )
        if full > len(self._hashes):
            raise ValueError(
                f"tokens {tokens} needs {full} full blocks hashed, only {len(self._hashes)} are"
            )
        if len(token_ids) < tokens:
            raise ValueError(f"token_ids holds {len(token_ids)} tokens, fewer than {tokens}")
        previous = self._hashes[full - 1] if full else self._seed
        tail = _token_bytes(token_ids[full * self._block_size : tokens])
        fed = self._pending if len(self._hashes) == full else b""  # the block's tokens so far
        if tail[: len(fed)] != fed[: len(tail)]:
            start = full * self._block_size
            raise ValueError(
                f"token_ids[{start}:{tokens}] differ from the tokens fed at those positions"
            )
        return hashlib.sha256(
            _PARTIAL_TAG + previous + rest.to_bytes(4, "little") + _extra_bytes(extra) + tail
        ).digest()

    def hashes_for(self, group_block_size: int) -> list[bytes]:
        """One hash per full block of a group whose blocks cover ``group_block_size`` tokens.

        Each is the chain hash at the block's end boundary, so it covers the whole prefix
        up to there, whatever the group's block size.
        """
        ratio = self._blocks_in("group_block_size", group_block_size)
        return self._hashes[ratio - 1 :: ratio]

    def _blocks_in(self, name: str, tokens: int) -> int:
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise TypeError(f"{name} must be an int, got {type(tokens).__name__}")
        if tokens <= 0 or tokens % self._block_size:
            raise ValueError(
                f"{name} must be a positive multiple of block_size {self._block_size}, got {tokens}"
            )
        return tokens // self._block_size
