"""The scheduler's side of the lookup channel: a lookup never waits past its timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec
import zmq

from hybridkv.integration.block_query import BlockBatch
from hybridkv.integration.lookup import wire
from hybridkv.integration.lookup.breaker import PROBE_BACKOFF_S, PROBE_MAX_BACKOFF_S, Breaker
from hybridkv.integration.lookup.wire import (
    LookupReply,
    LookupRequest,
    RemoveRequest,
    blocks_payloads,
    decode_reply,
    encode,
    lookup_payloads,
    resolve_secret,
    server_keys,
)

logger = logging.getLogger(__name__)

_Asked = TypeVar("_Asked")

# A removal walks the whole pool (a big one takes seconds): it is given at least this
# long, so that a reset that did remove is not reported failed for a lookup's timeout.
REMOVAL_TIMEOUT_MS = 60_000
# Stale replies (to timed-out requests) the client drops while waiting for its own.
_MAX_STALE_REPLIES = 16
# How long the lookup that sends a probe waits for its answer (a healthy loopback round
# trip takes about a millisecond): that lookup is answered when the pool is back; an
# unanswered probe is polled, without waiting, by the lookups after it.
PROBE_WAIT_MS = 50
# A key of no model: a probe asks the store about it (an empty lookup never reaches it).
PROBE_KEY = "hybridkv-lookup-probe"


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
        self._secret = resolve_secret(secret)
        self._context = zmq.Context()
        self._socket: zmq.Socket[bytes] | None = None
        self._sent = 0  # requests sent: the next one's id
        self.breaker = Breaker(timeout_ms / 1000, probe_backoff_s, probe_max_backoff_s)
        self._probe: bytes | None = None  # the id of the probe in flight (or the last one)
        self.skipped = 0  # lookups answered miss, not sent, while the pool counted as down
        self._told = False  # whether this outage's first skipped lookup was warned of
        self._reported: dict[str, int] = {}  # the counts `take_stats` last returned
        self.sent_bytes = 0  # lookup requests' payloads sent (a benchmark reads it)

    def take_stats(self) -> dict[str, int]:
        """The breaker's counts since the last call (the connector's stats)."""
        counts = {
            "skipped_lookups": self.skipped,
            "breaker_opened": self.breaker.opened,
            "breaker_closed": self.breaker.closed,
            "breaker_probes": self.breaker.probes,
        }
        since = {name: count - self._reported.get(name, 0) for name, count in counts.items()}
        self._reported = counts
        return since

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
            socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
            if self._secret is not None:
                socket.curve_serverkey = server_keys(self._secret)[0]
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
        return self._lookup(lookup_payloads, list(keys))

    def query_blocks(self, batches: Sequence[BlockBatch]) -> list[bool] | None:
        """Per hash of `batches`, whether all its objects are readable (the server renders
        their keys), or None as for `query`."""
        return self._lookup(blocks_payloads, batches)

    def _lookup(
        self, split: Callable[[_Asked], list[tuple[int, bytes]]], asked: _Asked
    ) -> list[bool] | None:
        """One lookup: its requests (`split` within the caps), answered in order."""
        deadline = time.monotonic() + self._timeout_ms / 1000
        try:
            payloads = split(asked)
        except ValueError as exc:
            logger.warning("hybridkv lookup not sent (%s): recomputing instead", exc)
            return None
        readable: list[bool] = []
        for count, payload in payloads:
            self.sent_bytes += len(payload)
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
        payload = encode(RemoveRequest())
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
                probe = encode(LookupRequest([PROBE_KEY]))
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
            reply = decode_reply(answer)
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
