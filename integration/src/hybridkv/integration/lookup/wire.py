"""The lookup channel's messages, its request caps, and the secret of its CURVE handshake."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated

import msgspec
import zmq
from zmq.utils import z85

from hybridkv.integration.block_query import BlockBatch

# What one request may carry. A 1M-token prompt at 16-token blocks, 8 storing heads and
# 4 groups asks 2M keys of ~130 B: 32 round trips of at most 65,536 keys (~8.5 MiB) each
# by keys; by block hashes (`BlocksRequest`) the same objects, about 34 B a block, in as
# many round trips of under 300 KiB. A request costs the server about 2.5x its size
# while it is decoded and answered, and a hash one the keys it renders besides.
MAX_REQUEST_KEYS = 1 << 16
MAX_REQUEST_BYTES = 16 << 20
# A block hash (`hybridkv.keys.BlockHasher`: SHA-256), and the heads one batch may name.
HASH_BYTES = 32
MAX_BATCH_HEADS = 1024

SECRET_ENV = "HYBRIDKV_LOOKUP_SECRET"
MIN_SECRET_CHARS = 16


class LookupRequest(msgspec.Struct, frozen=True, tag="lookup"):
    # Checked from the message's array header, before any key is decoded.
    keys: Annotated[list[str], msgspec.Meta(max_length=MAX_REQUEST_KEYS)]


class HashBatch(msgspec.Struct, frozen=True, array_like=True):
    """Every stage's objects of `heads` of each of `hashes` in plan group `group`."""

    group: Annotated[int, msgspec.Meta(ge=0)]
    heads: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_BATCH_HEADS)
    ]
    hashes: Annotated[
        list[Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]],
        msgspec.Meta(max_length=MAX_REQUEST_KEYS),
    ]


class BlocksRequest(msgspec.Struct, frozen=True, tag="blocks"):
    """Per hash, whether all its objects are readable: the server renders the keys with
    its model's key space. At most `MAX_REQUEST_KEYS` (hash, head) pairs in all."""

    batches: Annotated[list[HashBatch], msgspec.Meta(max_length=MAX_REQUEST_KEYS)]

    def objects(self) -> int:
        """(hash, head) pairs asked: the keys rendered, per stage."""
        return sum(len(batch.hashes) * len(batch.heads) for batch in self.batches)


class RemoveRequest(msgspec.Struct, frozen=True, tag="remove"):
    """Remove the objects of the server's own model, layout and namespace (a cache reset)."""


class LookupReply(msgspec.Struct, frozen=True):
    readable: list[bool] | None = None
    removed: int | None = None
    error: str | None = None


MULTIPART_REPLY = LookupReply(error="malformed lookup request: more than one message part")

encode = msgspec.msgpack.Encoder().encode
decode_request = msgspec.msgpack.Decoder(LookupRequest | BlocksRequest | RemoveRequest).decode
decode_reply = msgspec.msgpack.Decoder(LookupReply).decode

Readability = Callable[[Sequence[str]], list[bool]]
Removal = Callable[[], int]


def lookup_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The shared secret of authenticated lookups (`HYBRIDKV_LOOKUP_SECRET`), or None.

    Read from the environment, not kv_connector_extra_config, which vLLM logs. Refused
    when too short to resist guessing, or when this pyzmq has no CURVE.
    """
    text = environ.get(SECRET_ENV, "")
    if not text:
        return None
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{SECRET_ENV} must be at least {MIN_SECRET_CHARS} characters, got {len(text)}"
        )
    if not zmq.has("curve"):
        raise RuntimeError(f"{SECRET_ENV} is set, but this pyzmq has no CURVE support")
    return text.encode()


def server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The server's CURVE key pair (public, secret), derived from the shared secret: only
    a holder of the secret knows the server's public key, which a client must know to
    complete the handshake, and only the server can prove it holds the secret key."""
    seed = hashlib.blake2b(secret, digest_size=32, person=b"hybridkv-lookup").digest()
    secret_key = z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


def resolve_secret(secret: bytes | None) -> bytes | None:
    return lookup_secret() if secret is None else secret or None


def lookup_payloads(keys: list[str]) -> list[tuple[int, bytes]]:
    """The requests of one lookup, each within the server's caps: (keys, payload) each.

    Split by the key cap, then halved while over the size cap (keys of one lookup are of
    about one length); a single key over the size cap is a miss. Bounded: each halving
    makes a part smaller, and a part of one key is never split.
    """
    size = MAX_REQUEST_KEYS
    stack = [keys[start : start + size] for start in range(0, len(keys), size)][::-1] or [[]]
    payloads: list[tuple[int, bytes]] = []
    while stack:
        part = stack.pop()
        payload = encode(LookupRequest(part))
        if len(payload) <= MAX_REQUEST_BYTES:
            payloads.append((len(part), payload))
        elif len(part) == 1:
            raise ValueError(f"a lookup key of {len(payload)} B is over {MAX_REQUEST_BYTES} B")
        else:
            half = len(part) // 2
            stack += [part[half:], part[:half]]
    return payloads


def blocks_payloads(batches: Sequence[BlockBatch]) -> list[tuple[int, bytes]]:
    """The requests of one lookup by block hashes, each within the server's caps: (hashes,
    payload) each. Batches are cut so that no request asks more than `MAX_REQUEST_KEYS`
    (hash, head) pairs (well under `MAX_REQUEST_BYTES`: 32 B a hash, whatever the heads)."""
    requests: list[list[HashBatch]] = [[]]
    room = MAX_REQUEST_KEYS
    for group, hashes, heads in batches:
        if not 0 < len(heads) <= MAX_BATCH_HEADS:
            raise ValueError(f"a lookup batch of {len(heads)} heads (1..{MAX_BATCH_HEADS})")
        start = 0
        while start < len(hashes):
            if room < len(heads):
                requests.append([])
                room = MAX_REQUEST_KEYS
            take = min(len(hashes) - start, room // len(heads))
            part = list(hashes[start : start + take])
            requests[-1].append(HashBatch(group, list(heads), part))
            room -= take * len(heads)
            start += take
    return [
        (sum(len(batch.hashes) for batch in request), encode(BlocksRequest(request)))
        for request in requests
    ]
