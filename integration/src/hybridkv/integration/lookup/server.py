"""Worker rank 0's side of the lookup channel: answers lookups and a cache reset's removal."""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from hybridkv.integration.block_query import per_block, render
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.lookup import wire
from hybridkv.integration.lookup.channel import LOOPBACK
from hybridkv.integration.lookup.wire import (
    MAX_REQUEST_KEYS,
    MULTIPART_REPLY,
    SECRET_ENV,
    BlocksRequest,
    LookupReply,
    Readability,
    Removal,
    RemoveRequest,
    decode_request,
    encode,
    resolve_secret,
    server_keys,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
# How long closing waits for an answer in progress (a pool call that hangs) before
# leaving the server's thread and socket to the process's exit.
CLOSE_TIMEOUT_S = 5.0
# Requests a peer may have queued at the server (ZMQ's default, 1000, times the size cap
# would let one connection hold 16 GiB): the client has one in flight, two after a loss.
_SERVER_QUEUE = 4


class LookupServer:
    """REP socket (loopback TCP or a Unix socket) answering `LookupRequest`s from a
    readability function and `RemoveRequest`s from a removal function.

    `secret`: the shared secret of CURVE authentication; None reads `HYBRIDKV_LOOKUP_SECRET`
    (unset: none), b"" is none. `keys`: the scheduler's key space (every stage's), which
    renders the keys of a `BlocksRequest` (None: only lookups by keys are answered).
    """

    def __init__(
        self,
        readable: Readability,
        endpoint: str = f"tcp://{LOOPBACK}:*",
        remove: Removal | None = None,
        secret: bytes | None = None,
        keys: KeySpace | None = None,
    ) -> None:
        self._readable = readable
        self._keys = keys
        self._remove = remove
        secret = resolve_secret(secret)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, _SERVER_QUEUE)
        if secret is not None:
            public, secret_key = server_keys(secret)
            self._socket.curve_secretkey = secret_key
            self._socket.curve_publickey = public
            self._socket.curve_server = True
        elif endpoint.startswith("tcp://"):
            logger.warning(
                "hybridkv lookup server on %s: any local user can look keys up and reset "
                "this model's pool objects; set %s on the scheduler and workers",
                endpoint,
                SECRET_ENV,
            )
        self._socket.bind(endpoint)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hybridkv-lookup", daemon=True)
        self._thread.start()

    def _answer(self, payload: bytes) -> LookupReply:
        try:
            request = decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # e.g. "Expected `array` of length <= 65536 - at `$.keys`": a client of ours
            # splits longer lookups, so this comes from a foreign or broken peer.
            logger.warning("hybridkv lookup request refused: %s", exc)
            return LookupReply(error=f"malformed lookup request: {exc}")
        if isinstance(request, RemoveRequest):
            return self._answer_remove()
        if isinstance(request, BlocksRequest):
            return self._answer_blocks(request)
        return self._answer_keys(request.keys)

    def _answer_keys(self, keys: list[str]) -> LookupReply:
        try:
            answers = self._readable(keys)
        except Exception as exc:  # the pool failing must not take the server down
            logger.warning("hybridkv lookup of %d keys failed: %s", len(keys), exc)
            return LookupReply(error=f"lookup failed: {type(exc).__name__}: {exc}")
        if len(answers) != len(keys):
            return LookupReply(error=f"{len(answers)} answers for {len(keys)} keys")
        return LookupReply(readable=[bool(answer) for answer in answers])

    def _answer_blocks(self, request: BlocksRequest) -> LookupReply:
        """Per hash, whether every key it renders to is readable."""
        if self._keys is None:
            return LookupReply(error="this lookup server renders no keys: ask by keys")
        objects = request.objects()
        if objects > MAX_REQUEST_KEYS:
            return LookupReply(
                error=f"malformed lookup request: {objects} (hash, head) pairs, over the "
                f"{MAX_REQUEST_KEYS} a request may ask"
            )
        batches = [(batch.group, batch.hashes, batch.heads) for batch in request.batches]
        try:
            keys = render(self._keys, batches)
        except ValueError as exc:
            return LookupReply(error=f"malformed lookup request: {exc}")
        reply = self._answer_keys(keys)
        if reply.readable is None:
            return reply
        return LookupReply(readable=per_block(self._keys, batches, reply.readable))

    def _answer_remove(self) -> LookupReply:
        if self._remove is None:
            return LookupReply(error="this lookup server does not remove objects")
        try:
            return LookupReply(removed=self._remove())
        except Exception as exc:  # the pool failing must not take the server down
            logger.warning("hybridkv removal of this model's objects failed: %s", exc)
            return LookupReply(error=f"removal failed: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_POLL_MS):
                    continue
                payload = self._socket.recv()
                try:
                    reply = self._answer(payload) if not self._rest_dropped() else MULTIPART_REPLY
                except Exception as exc:  # a bug must not end the thread: lookups would
                    logger.exception("hybridkv lookup server failed to answer")  # time out
                    reply = LookupReply(error=f"lookup failed: {type(exc).__name__}: {exc}")
                self._socket.send(encode(reply))
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.warning("hybridkv lookup server socket error: %s", exc)

    def _rest_dropped(self) -> bool:
        """Whether the request had more parts than one, dropped (a reply needs them read).
        Bounded: ZMQ delivers a message whole, each part within the size cap."""
        more = False
        while self._socket.getsockopt(zmq.RCVMORE):
            self._socket.recv(copy=False)
            more = True
        return more

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Whether the server stopped (False: an answer still runs, its store call too)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # its socket is not ours to close while it answers
            logger.warning(
                "hybridkv lookup server still answering after %g s; left to the process's exit",
                timeout_s,
            )
            return False
        self._socket.close(0)
        self._context.term()
        return True
