"""The scheduler's requests to the pool, made of worker rank 0 over ZMQ.

The scheduler process holds no store client; worker rank 0 does. One REQ/REP round trip
per lookup carries every key of that lookup (msgspec-encoded); a cache reset asks for the
model's objects to be removed the same way (which objects, the server alone decides: its
own model's, so that whoever reaches its loopback port cannot name others'). The server
answers every request, a malformed one with an error, and survives anything a request
does; the client gives up after a timeout and reports "unknown", which the scheduler
treats as a miss (recompute), never as a hang.

Unless a fixed loopback port is configured, worker rank 0 listens on a Unix socket in a
directory only its user can enter, named by the engine: no other local user can ask it
anything (a loopback port is open to every user of the host), and the scheduler finds it
without a port to pass around. Once answered, the scheduler removes the socket's path
(its connection stays): nobody else can connect from then on, and no file outlives the
instance even when its workers are killed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import zmq

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_POLL_MS = 100
_MAX_SOCKET_PATH = 107  # Linux's sun_path, less its terminating NUL
# A removal walks the whole pool (a big one takes seconds): it is given at least this
# long, so that a reset that did remove is not reported failed for a lookup's timeout.
REMOVAL_TIMEOUT_MS = 60_000
# How long closing waits for an answer in progress (a pool call that hangs) before
# leaving the server's thread and socket to the process's exit.
CLOSE_TIMEOUT_S = 5.0


class LookupRequest(msgspec.Struct, frozen=True, tag="lookup"):
    keys: list[str]


class RemoveRequest(msgspec.Struct, frozen=True, tag="remove"):
    """Remove the objects of the server's own model, layout and namespace (a cache reset)."""


class LookupReply(msgspec.Struct, frozen=True):
    readable: list[bool] | None = None
    removed: int | None = None
    error: str | None = None


_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(LookupRequest | RemoveRequest).decode
_decode_reply = msgspec.msgpack.Decoder(LookupReply).decode

Readability = Callable[[Sequence[str]], list[bool]]
Removal = Callable[[], int]


def socket_path(instance: str) -> Path:
    """Where worker rank 0 of `instance` listens for its scheduler (no fixed port set)."""
    digest = hashlib.sha256(instance.encode()).hexdigest()[:16]  # short: sun_path is small
    path = Path(tempfile.gettempdir()) / f"hybridkv-lookup-{digest}" / "sock"
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ValueError(
            f"the lookup socket {path} is longer than a Unix socket path may be "
            f"({_MAX_SOCKET_PATH} bytes): set TMPDIR shorter, or set lookup_rpc_port"
        )
    return path


def is_private(directory: Path) -> bool:
    """A directory of this user's that no other user may enter (not a link to one)."""
    try:
        status = directory.lstat()
    except FileNotFoundError:
        return False
    return (
        stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid() and not status.st_mode & 0o077
    )


def make_private(directory: Path) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    if not is_private(directory):
        raise PermissionError(
            f"{directory} must be a directory of this user's alone (mode 0700) to hold the "
            f"lookup socket: remove it, or set TMPDIR elsewhere, or set lookup_rpc_port"
        )


def claim_socket(path: Path, instance: str) -> None:
    """Ready the socket's private directory for `instance`'s worker to bind in.

    A socket some process still listens on belongs to a running instance of the same id
    (two instances on this host given one engine id): binding over it would hand that
    instance's scheduler our answers and our cache resets. A socket nobody listens on is a
    killed instance's, taken over.
    """
    make_private(path.parent)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return
    raise RuntimeError(
        f"hybridkv: another process listens for lookups at {path}, an instance with the id "
        f"{instance!r}: give each instance on this host its own kv_transfer_config "
        "engine_id, or set lookup_rpc_port"
    )


def remove_socket(path: Path) -> None:
    """The socket file and its directory, once the server is closed (ZMQ leaves both)."""
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: not ours to remove
        path.parent.rmdir()


class LookupServer:
    """REP socket (loopback TCP or a Unix socket) answering `LookupRequest`s from a
    readability function and `RemoveRequest`s from a removal function."""

    def __init__(
        self,
        readable: Readability,
        endpoint: str = f"tcp://{LOOPBACK}:*",
        remove: Removal | None = None,
    ) -> None:
        self._readable = readable
        self._remove = remove
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hybridkv-lookup", daemon=True)
        self._thread.start()

    def _answer(self, payload: bytes) -> LookupReply:
        try:
            request = _decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return LookupReply(error=f"malformed lookup request: {exc}")
        if isinstance(request, RemoveRequest):
            return self._answer_remove()
        try:
            answers = self._readable(request.keys)
        except Exception as exc:  # the pool failing must not take the server down
            logger.warning("hybridkv lookup of %d keys failed: %s", len(request.keys), exc)
            return LookupReply(error=f"lookup failed: {type(exc).__name__}: {exc}")
        if len(answers) != len(request.keys):
            return LookupReply(error=f"{len(answers)} answers for {len(request.keys)} keys")
        return LookupReply(readable=[bool(answer) for answer in answers])

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
                    reply = self._answer(payload)
                except Exception as exc:  # a bug must not end the thread: lookups would
                    logger.exception("hybridkv lookup server failed to answer")  # time out
                    reply = LookupReply(error=f"lookup failed: {type(exc).__name__}: {exc}")
                self._socket.send(_encode(reply))
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.warning("hybridkv lookup server socket error: %s", exc)

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


class LookupClient:
    """REQ side; `query` returns None (and warns) instead of waiting past the timeout.

    `address` may be a function answering None until the server is known; it is asked
    from construction on until it answers, and never again. `answered` is called once,
    after the first answer: the connection stands, and the scheduler removes the Unix
    socket's path then, so that nobody else can connect and nothing is left behind.

    While a timed-out request is still unanswered, lookups are misses at once, not sent:
    a server slower than the timeout would otherwise answer a queue that only grows, and
    every lookup would wait out the timeout on the scheduler's loop.
    """

    def __init__(
        self,
        address: str | Callable[[], str | None],
        timeout_ms: int,
        answered: Callable[[], None] | None = None,
    ) -> None:
        self._find = address if callable(address) else lambda: address
        self._address = self._find()
        self._timeout_ms = timeout_ms
        self._answered = answered
        self._context = zmq.Context()
        self._socket: zmq.Socket[bytes] | None = None
        self._unanswered = False  # a request timed out and its reply has not come yet

    def _connect(self) -> zmq.Socket[bytes] | None:
        if self._socket is not None:
            return self._socket
        if self._address is None:
            self._address = self._find()
        address = self._address
        if address is None:
            return None
        socket: zmq.Socket[bytes] = self._context.socket(zmq.REQ)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            # A request that timed out stays unanswered: the next one goes out on the same
            # connection, and the late reply is told apart and dropped. The connection, not
            # the socket's path, is what a lookup needs once answered.
            socket.setsockopt(zmq.REQ_RELAXED, 1)
            socket.setsockopt(zmq.REQ_CORRELATE, 1)
            socket.connect(address)
        except zmq.ZMQError:
            socket.close(0)
            raise
        self._socket = socket
        return socket

    def query(self, keys: Sequence[str]) -> list[bool] | None:
        """Readability of every key, or None when the server cannot answer in time."""
        reply = self._ask(
            LookupRequest(list(keys)), "lookup", "recomputing instead", self._timeout_ms, 0
        )
        return None if reply is None else reply.readable

    def remove(self) -> int | None:
        """Objects of the server's model removed, or None when the server did not answer."""
        timeout_ms = max(self._timeout_ms, REMOVAL_TIMEOUT_MS)
        reply = self._ask(
            RemoveRequest(), "removal", "the pool may keep them", timeout_ms, timeout_ms
        )
        return None if reply is None else reply.removed

    def _ask(
        self,
        request: LookupRequest | RemoveRequest,
        what: str,
        fallback: str,
        timeout_ms: int,
        late_ms: int,
    ) -> LookupReply | None:
        """One round trip; None (after a warning saying `fallback`) unless answered
        within `timeout_ms`, or unless the reply to a timed-out request is still due after
        `late_ms`."""
        try:
            socket = self._connect()
        except zmq.ZMQError as exc:  # e.g. out of file descriptors: a miss, not a crash
            logger.warning("hybridkv %s could not connect (%s): %s", what, exc, fallback)
            return None
        if socket is None:
            logger.warning("hybridkv lookup server not listening yet: %s %s", what, fallback)
            return None
        try:
            if self._unanswered:
                if not socket.poll(late_ms, zmq.POLLIN):
                    logger.warning(
                        "hybridkv lookup server still busy with a timed-out request: %s %s",
                        what,
                        fallback,
                    )
                    return None
                socket.recv()  # the late reply: its caller has moved on
                self._unanswered = False
            socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            socket.send(_encode(request))
            try:
                payload = socket.recv()
            except zmq.Again:
                self._unanswered = True
                raise
            reply = _decode_reply(payload)
        except zmq.Again:
            logger.warning("hybridkv %s timed out after %d ms: %s", what, timeout_ms, fallback)
            return None
        except (zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("hybridkv %s failed (%s): %s", what, exc, fallback)
            return None
        if self._answered is not None:
            answered, self._answered = self._answered, None
            try:
                answered()
            except OSError as exc:  # the answer stands; only the tidying failed
                logger.warning("hybridkv lookup: after the first answer: %s", exc)
        if reply.error is not None:
            logger.warning("hybridkv %s refused: %s", what, reply.error)
            return None
        return reply

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
        self._context.term()
