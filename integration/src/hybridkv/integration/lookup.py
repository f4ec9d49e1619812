"""The scheduler's requests to the pool, made of worker rank 0 over ZMQ.

The scheduler process holds no store client; worker rank 0 does. One round trip (DEALER to
REP) per lookup carries every key of that lookup (msgspec-encoded; past the request caps
below, several do); a cache reset asks for the model's objects to be removed the same way
(which objects, the server alone decides: its own model's, so that whoever reaches its
loopback port cannot name others'). The server answers every request, a malformed one with
an error, and survives anything a request does; the client gives up after a timeout and
reports "unknown", which the scheduler treats as a miss (recompute), never as a hang. After
a timeout the pool counts as down (`Breaker`): lookups are misses at once, without being
sent, until a probe (sent without blocking, on a backoff) is answered: a stalled master
costs the scheduler's loop one timeout per outage, not one per lookup.

Unless a fixed loopback port is configured, worker rank 0 listens on a Unix socket in a
directory only its user can enter, named by the engine: no other local user can ask it
anything (a loopback port is open to every user of the host), and the scheduler finds it
without a port to pass around. Once answered, the scheduler removes the socket's path
(its connection stays): nobody else can connect from then on, and no file outlives the
instance even when its workers are killed.

A fixed port is open to every local user: with `HYBRIDKV_LOOKUP_SECRET` set on both sides,
the server speaks ZMQ CURVE with keys derived from it, so that a peer without the secret
completes no handshake (it can neither ask nor answer) and nothing it sends reaches the
server as a request. The server refuses requests past `MAX_REQUEST_KEYS` keys or
`MAX_REQUEST_BYTES` bytes (ZMQ drops a peer that sends a larger message); the client
splits a longer lookup into several round trips under those caps.
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
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import msgspec
import zmq
from zmq.utils import z85

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
# What one request may carry. A 1M-token prompt at 16-token blocks, 8 storing heads and
# 4 groups asks 2M keys of ~130 B: 32 round trips of at most 65,536 keys (~8.5 MiB) each.
# A request costs the server about 2.5x its size while it is decoded and answered.
MAX_REQUEST_KEYS = 1 << 16
MAX_REQUEST_BYTES = 16 << 20
# Requests a peer may have queued at the server (ZMQ's default, 1000, times the size cap
# would let one connection hold 16 GiB): the client has one in flight, two after a loss.
_SERVER_QUEUE = 4
# Stale replies (to timed-out requests) the client drops while waiting for its own.
_MAX_STALE_REPLIES = 16
# While the pool counts as down, probes go out this long apart at first, doubling up to
# the cap: a stalled master is asked about once a cap period, not once a lookup.
PROBE_BACKOFF_S = 1.0
PROBE_MAX_BACKOFF_S = 30.0
# How long the lookup that sends a probe waits for its answer (a healthy loopback round
# trip takes about a millisecond): that lookup is answered when the pool is back; an
# unanswered probe is polled, without waiting, by the lookups after it.
PROBE_WAIT_MS = 50
# A key of no model: a probe asks the store about it (an empty lookup never reaches it).
PROBE_KEY = "hybridkv-lookup-probe"
SECRET_ENV = "HYBRIDKV_LOOKUP_SECRET"
MIN_SECRET_CHARS = 16


class LookupRequest(msgspec.Struct, frozen=True, tag="lookup"):
    # Checked from the message's array header, before any key is decoded.
    keys: Annotated[list[str], msgspec.Meta(max_length=MAX_REQUEST_KEYS)]


class RemoveRequest(msgspec.Struct, frozen=True, tag="remove"):
    """Remove the objects of the server's own model, layout and namespace (a cache reset)."""


class LookupReply(msgspec.Struct, frozen=True):
    readable: list[bool] | None = None
    removed: int | None = None
    error: str | None = None


_MULTIPART = LookupReply(error="malformed lookup request: more than one message part")

_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(LookupRequest | RemoveRequest).decode
_decode_reply = msgspec.msgpack.Decoder(LookupReply).decode

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


def _server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The server's CURVE key pair (public, secret), derived from the shared secret: only
    a holder of the secret knows the server's public key, which a client must know to
    complete the handshake, and only the server can prove it holds the secret key."""
    seed = hashlib.blake2b(secret, digest_size=32, person=b"hybridkv-lookup").digest()
    secret_key = z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


def _resolve_secret(secret: bytes | None) -> bytes | None:
    return lookup_secret() if secret is None else secret or None


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


class Breaker:
    """Whether the pool counts as down, and when to probe it; the caller passes the clock
    (sans I/O: its schedule is tested without sockets or sleeps).

    A request that timed out opens it and counts as the first probe, in flight for one
    more timeout. While open, lookups are misses, not sent; one probe at a time is in
    flight, its answer counting for one timeout after it went out; each probe goes out
    no sooner than the backoff after the one before (`first_backoff_s`, doubling up to
    `max_backoff_s`), nor while the one before may still be answered. A probe answered
    without error closes it.
    """

    def __init__(
        self,
        timeout_s: float,
        first_backoff_s: float = PROBE_BACKOFF_S,
        max_backoff_s: float = PROBE_MAX_BACKOFF_S,
    ) -> None:
        if not 0 < first_backoff_s <= max_backoff_s:
            raise ValueError(f"backoff must be 0 < {first_backoff_s} <= {max_backoff_s}")
        self.timeout_s = timeout_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.is_open = False
        self.opened = 0  # times it opened: outages seen
        self.probes = 0  # probes sent (the requests that opened it not counted)
        self._until: float | None = None  # the probe in flight counts until then
        self._next = 0.0  # no probe before then
        self._backoff = first_backoff_s

    def trip(self, now: float) -> None:
        """A request got no answer in time: the pool is down, that request the probe."""
        if not self.is_open:
            self.is_open = True
            self.opened += 1
            self._backoff = self.first_backoff_s
        self._launch(now)

    def _launch(self, now: float) -> None:
        self._until = now + self.timeout_s
        self._next = now + self._backoff
        self._backoff = min(2 * self._backoff, self.max_backoff_s)

    def in_flight_until(self, now: float) -> float | None:
        """Until when the probe in flight may be answered; None: none (an expired one is
        forgotten: its reply, if it ever comes, is dropped)."""
        if self._until is not None and now >= self._until:
            self._until = None
        return self._until

    def probe_due(self, now: float) -> bool:
        return self.is_open and self.in_flight_until(now) is None and now >= self._next

    def probe_sent(self, now: float) -> None:
        if not self.probe_due(now):
            raise RuntimeError("no probe is due")
        self.probes += 1
        self._launch(now)

    def answered(self, ok: bool) -> None:
        """The probe in flight was answered in time: the pool is back unless it failed."""
        self._until = None
        if ok:
            self.is_open = False


class LookupServer:
    """REP socket (loopback TCP or a Unix socket) answering `LookupRequest`s from a
    readability function and `RemoveRequest`s from a removal function.

    `secret`: the shared secret of CURVE authentication; None reads `HYBRIDKV_LOOKUP_SECRET`
    (unset: none), b"" is none.
    """

    def __init__(
        self,
        readable: Readability,
        endpoint: str = f"tcp://{LOOPBACK}:*",
        remove: Removal | None = None,
        secret: bytes | None = None,
    ) -> None:
        self._readable = readable
        self._remove = remove
        secret = _resolve_secret(secret)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, _SERVER_QUEUE)
        if secret is not None:
            public, secret_key = _server_keys(secret)
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
            request = _decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # e.g. "Expected `array` of length <= 65536 - at `$.keys`": a client of ours
            # splits longer lookups, so this comes from a foreign or broken peer.
            logger.warning("hybridkv lookup request refused: %s", exc)
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
                    reply = self._answer(payload) if not self._rest_dropped() else _MULTIPART
                except Exception as exc:  # a bug must not end the thread: lookups would
                    logger.exception("hybridkv lookup server failed to answer")  # time out
                    reply = LookupReply(error=f"lookup failed: {type(exc).__name__}: {exc}")
                self._socket.send(_encode(reply))
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


class LookupClient:
    """DEALER side of the REP server; `query` returns None (and warns) instead of waiting
    past the timeout.

    `address` may be a function answering None until the server is known; it is asked
    from construction on until it answers, and never again. `answered` is called once,
    after the first answer: the connection stands, and the scheduler removes the Unix
    socket's path then, so that nobody else can connect and nothing is left behind.
    `secret` as for `LookupServer`.

    Each request carries an id that its reply echoes (REP returns the envelope), so a late
    reply is told apart and dropped; the socket never closes its connection (a Unix
    socket's path is gone once answered). A request that times out opens the `Breaker`:
    the pool counts as down, and lookups are misses at once, neither sent nor waited on
    (a stalled master would otherwise cost the scheduler's loop a timeout per lookup, and
    the server a queue that only grows). The timed-out request is the first probe; later
    ones (a lookup of one key, so that the server asks the store) go out on the breaker's
    backoff, each sent without blocking and waited on `PROBE_WAIT_MS` at most, then
    polled by the lookups after it; one answered in time closes the breaker. A reply lost
    with its server (killed, restarted on the same port) counts as lost one timeout after
    the time-out: the next probe goes to whatever listens there now.
    """

    def __init__(
        self,
        address: str | Callable[[], str | None],
        timeout_ms: int,
        answered: Callable[[], None] | None = None,
        secret: bytes | None = None,
        probe_backoff_s: float = PROBE_BACKOFF_S,
        probe_max_backoff_s: float = PROBE_MAX_BACKOFF_S,
    ) -> None:
        self._find = address if callable(address) else lambda: address
        self._address = self._find()
        self._timeout_ms = timeout_ms
        self._answered = answered
        self._secret = _resolve_secret(secret)
        self._context = zmq.Context()
        self._socket: zmq.Socket[bytes] | None = None
        self._sent = 0  # requests sent: the next one's id
        self.breaker = Breaker(timeout_ms / 1000, probe_backoff_s, probe_max_backoff_s)
        self._probe: bytes | None = None  # the id of the probe in flight (or the last one)
        self.skipped = 0  # lookups answered miss, not sent, while the pool counted as down
        self._told = False  # whether this outage's first skipped lookup was warned of

    def _connect(self) -> zmq.Socket[bytes] | None:
        if self._socket is not None:
            return self._socket
        if self._address is None:
            self._address = self._find()
        address = self._address
        if address is None:
            return None
        socket: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            if self._secret is not None:
                socket.curve_serverkey = _server_keys(self._secret)[0]
                socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()
            socket.connect(address)
        except zmq.ZMQError:
            socket.close(0)
            raise
        self._socket = socket
        return socket

    def query(self, keys: Sequence[str]) -> list[bool] | None:
        """Readability of every key, or None when the server cannot answer in time (or the
        pool counts as down: then at once).

        A lookup past the server's caps goes out in several requests, all within the one
        timeout."""
        deadline = time.monotonic() + self._timeout_ms / 1000
        try:
            payloads = _lookup_payloads(list(keys))
        except ValueError as exc:
            logger.warning("hybridkv lookup not sent (%s): recomputing instead", exc)
            return None
        readable: list[bool] = []
        for count, payload in payloads:
            remaining_ms = max(1, round((deadline - time.monotonic()) * 1000))
            reply = self._ask(
                payload, "lookup", "recomputing instead", remaining_ms, wait_late=False
            )
            if reply is None or reply.readable is None:
                return None
            if len(reply.readable) != count:
                logger.warning(
                    "hybridkv lookup answered %d of %d keys: recomputing instead",
                    len(reply.readable),
                    count,
                )
                return None
            readable.extend(reply.readable)
        return readable

    def remove(self) -> int | None:
        """Objects of the server's model removed, or None when the server did not answer
        within the removal's timeout (waiting for a late reply included). Sent even while
        the pool counts as down: a cache reset is asked for, and may wait."""
        timeout_ms = max(self._timeout_ms, REMOVAL_TIMEOUT_MS)
        payload = _encode(RemoveRequest())
        reply = self._ask(payload, "removal", "the pool may keep them", timeout_ms, wait_late=True)
        return None if reply is None else reply.removed

    def _ask(
        self, payload: bytes, what: str, fallback: str, timeout_ms: int, wait_late: bool
    ) -> LookupReply | None:
        """One round trip; None (after a warning saying `fallback`) unless answered within
        `timeout_ms`. While the pool counts as down a lookup is not sent (only probed); a
        removal (`wait_late`) waits for the probe in flight, then goes out."""
        try:
            socket = self._connect()
        except zmq.ZMQError as exc:  # e.g. out of file descriptors: a miss, not a crash
            logger.warning("hybridkv %s could not connect (%s): %s", what, exc, fallback)
            return None
        if socket is None:
            logger.warning("hybridkv lookup server not listening yet: %s %s", what, fallback)
            return None
        deadline = time.monotonic() + timeout_ms / 1000
        try:
            if self.breaker.is_open:
                if wait_late:
                    self._await_probe(socket, deadline)
                elif self._still_down(socket):
                    self.skipped += 1
                    self._tell(f"hybridkv {what}: {fallback}")
                    return None
            self._sent += 1
            request_id = self._sent.to_bytes(8, "big")
            socket.send_multipart([request_id, b"", payload])
            answer = self._receive(socket, request_id, deadline)
            if answer is None:
                self._trip(request_id)
                logger.warning("hybridkv %s timed out after %d ms: %s", what, timeout_ms, fallback)
                return None
        except zmq.Again:  # not even queued (no connection within the timeout)
            self._trip(None)
            logger.warning("hybridkv %s timed out after %d ms: %s", what, timeout_ms, fallback)
            return None
        except zmq.ZMQError as exc:
            logger.warning("hybridkv %s failed (%s): %s", what, exc, fallback)
            return None
        if self.breaker.is_open:  # a removal answered: the server and pool answer again
            self._recovered()
        return self._reply(answer, what, fallback)

    def _trip(self, request_id: bytes | None) -> None:
        if not self.breaker.is_open:
            self._told = False
        self.breaker.trip(time.monotonic())
        self._probe = request_id

    def _still_down(self, socket: zmq.Socket[bytes]) -> bool:
        """Whether the pool still counts as down: the probe in flight unanswered (polled,
        not waited on), or a new one sent unanswered within `PROBE_WAIT_MS`."""
        now = time.monotonic()
        if self._probe is not None and self.breaker.in_flight_until(now) is not None:
            answer = self._receive(socket, self._probe, 0.0)
            if answer is not None:
                self._probed(answer)
        if self.breaker.probe_due(now):
            if self._probe is not None:
                logger.warning(
                    "hybridkv lookup: a timed-out reply counted as lost: probing the pool"
                )
            self._sent += 1
            self._probe = self._sent.to_bytes(8, "big")
            self.breaker.probe_sent(now)
            wait_s = min(PROBE_WAIT_MS, self._timeout_ms) / 1000
            try:
                probe = _encode(LookupRequest([PROBE_KEY]))
                socket.send_multipart([self._probe, b"", probe], flags=zmq.NOBLOCK)
            except zmq.Again:  # the server's queue is full: this probe failed
                self.breaker.answered(ok=False)
                return True
            answer = self._receive(socket, self._probe, time.monotonic() + wait_s)
            if answer is not None:
                self._probed(answer)
        return self.breaker.is_open

    def _await_probe(self, socket: zmq.Socket[bytes], deadline: float) -> None:
        """Wait for the probe in flight while it counts, within `deadline` (a removal)."""
        until = self.breaker.in_flight_until(time.monotonic())
        if self._probe is not None and until is not None:
            answer = self._receive(socket, self._probe, min(until, deadline))
            if answer is not None:
                self._probed(answer)
                return
        if self.breaker.is_open:
            logger.warning("hybridkv lookup: a timed-out reply counted as lost: removal sent")

    def _probed(self, answer: bytes) -> None:
        """The probe in flight was answered in time: the pool is back unless it failed."""
        if self._reply(answer, "probe", "the pool still counts as down") is None:
            self.breaker.answered(ok=False)
        else:
            self._recovered()

    def _recovered(self) -> None:
        self.breaker.answered(ok=True)
        self._probe = None
        logger.warning("hybridkv lookup: the pool answers again: lookups sent")

    def _tell(self, what: str) -> None:
        """Warn of the first lookup skipped in an outage; the rest only at debug level."""
        level = logging.DEBUG if self._told else logging.WARNING
        self._told = True
        logger.log(
            level,
            "hybridkv pool counted as down (still busy with a timed-out request, or no "
            "answer to a probe yet): %s",
            what,
        )

    def _reply(self, answer: bytes, what: str, fallback: str) -> LookupReply | None:
        """The decoded reply, or None (warned) when malformed or an error."""
        try:
            reply = _decode_reply(answer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
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

    @staticmethod
    def _receive(socket: zmq.Socket[bytes], request_id: bytes, until: float) -> bytes | None:
        """The reply to `request_id` if it comes by `until` (monotonic), stale ones dropped."""
        for _ in range(_MAX_STALE_REPLIES):
            wait_ms = max(0, round((until - time.monotonic()) * 1000))
            if not socket.poll(wait_ms, zmq.POLLIN):
                return None
            frames = socket.recv_multipart()
            if len(frames) == 3 and frames[0] == request_id and not frames[1]:
                return frames[2]
        return None

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
        self._context.term()


def _lookup_payloads(keys: list[str]) -> list[tuple[int, bytes]]:
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
        payload = _encode(LookupRequest(part))
        if len(payload) <= MAX_REQUEST_BYTES:
            payloads.append((len(part), payload))
        elif len(part) == 1:
            raise ValueError(f"a lookup key of {len(payload)} B is over {MAX_REQUEST_BYTES} B")
        else:
            half = len(part) // 2
            stack += [part[half:], part[:half]]
    return payloads
