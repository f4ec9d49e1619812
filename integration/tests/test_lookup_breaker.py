"""The lookup client's circuit breaker: its schedule (no sockets, a clock passed in), and
the scheduler's lookups against a real master that stalls (SIGSTOP)."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.integration.lookup import Breaker, LookupClient, LookupReply, LookupServer
from hybridkv.transport import Status
from hybridkv.transport.master import LOOPBACK, MasterProcess
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.testing import mooncake_config, require_mooncake


def test_a_stalled_pool_is_probed_on_a_doubling_backoff_never_two_probes_at_once() -> None:
    breaker = Breaker(timeout_s=5.0, first_backoff_s=1.0, max_backoff_s=30.0)
    assert not breaker.is_open
    assert not breaker.probe_due(0.0)
    with pytest.raises(RuntimeError, match="no probe is due"):
        breaker.probe_sent(0.0)
    breaker.trip(100.0)
    sent = []
    for tick in range(1, 400):
        now = 100.0 + tick / 2
        assert breaker.is_open
        if breaker.probe_due(now):
            breaker.probe_sent(now)
            sent.append(now - 100.0)
    # The timed-out request counts for one timeout (5 s), each probe for one more; the
    # gaps double from 1 s (hidden by the timeout at first) up to the 30 s cap.
    assert sent == [5.0, 10.0, 15.0, 23.0, 39.0, 69.0, 99.0, 129.0, 159.0, 189.0]
    assert (breaker.opened, breaker.probes) == (1, 10)


def test_an_answered_probe_closes_and_a_failed_one_waits_for_the_next() -> None:
    breaker = Breaker(timeout_s=0.5)
    breaker.trip(0.0)
    assert breaker.in_flight_until(0.2) == 0.5
    breaker.answered(ok=False)  # answered fast, with an error: still down
    assert breaker.is_open
    assert breaker.in_flight_until(0.2) is None
    assert not breaker.probe_due(0.9)  # the backoff still runs
    assert breaker.probe_due(1.0)
    breaker.probe_sent(1.0)
    breaker.answered(ok=True)
    assert not breaker.is_open
    assert not breaker.probe_due(100.0)
    breaker.trip(200.0)  # a new outage starts its backoff afresh
    assert breaker.opened == 2
    assert not breaker.probe_due(200.9)
    assert not breaker.probe_due(200.4)
    assert breaker.probe_due(201.0)


@dataclass
class Oracle:
    """The breaker's rules, recomputed from the history of the current outage."""

    timeout_s: float
    first_s: float
    cap_s: float
    open: bool = False
    launches: list[float] = field(default_factory=list)  # since the outage began
    answered: bool = False

    def trip(self, now: float) -> None:
        if not self.open:
            self.open, self.launches = True, []
        self.launches.append(now)
        self.answered = False

    def in_flight(self, now: float) -> bool:
        if not self.launches or self.answered:
            return False
        return now < self.launches[-1] + self.timeout_s

    def due(self, now: float) -> bool:
        if not self.open or self.in_flight(now):
            return False
        gap = min(self.first_s * 2 ** (len(self.launches) - 1), self.cap_s)
        return now >= self.launches[-1] + gap

    def answer(self, ok: bool) -> None:
        self.answered = True
        self.open = self.open and not ok


_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("wait"), st.floats(0.0, 20.0)),
        st.tuples(st.just("trip"), st.just(0.0)),
        st.tuples(st.just("probe"), st.just(0.0)),
        st.tuples(st.just("ok"), st.just(0.0)),
        st.tuples(st.just("failed"), st.just(0.0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    steps=_STEPS,
    timeout_s=st.floats(0.01, 10.0),
    first_s=st.floats(0.01, 5.0),
    cap_factor=st.floats(1.0, 20.0),
)
def test_the_breaker_follows_its_rules(
    steps: list[tuple[str, float]], timeout_s: float, first_s: float, cap_factor: float
) -> None:
    breaker = Breaker(timeout_s, first_s, first_s * cap_factor)
    oracle = Oracle(timeout_s, first_s, first_s * cap_factor)
    now = 0.0
    for action, value in steps:
        if action == "wait":
            now += value
        elif action == "trip":  # a lookup (closed) or a removal (open too) timed out
            breaker.trip(now)
            oracle.trip(now)
        elif action == "probe" and oracle.due(now):
            breaker.probe_sent(now)
            oracle.trip(now)
        elif action in ("ok", "failed") and oracle.in_flight(now):
            breaker.answered(ok=action == "ok")
            oracle.answer(action == "ok")
        assert breaker.is_open == oracle.open
        assert (breaker.in_flight_until(now) is not None) == oracle.in_flight(now)
        assert breaker.probe_due(now) == oracle.due(now)
        if oracle.in_flight(now):  # at most one probe at a time
            assert not breaker.probe_due(now)


TIMEOUT_MS = 1000
STALL_S = 40.0  # past Mooncake's RPC timeout (~30 s): the store call's late error comes
EVERY_S = 0.1
PROBE_CAP_S = 8.0  # the test's backoff cap, so that recovery is seen within seconds
PROBE_WAIT_S = 0.05  # lookup.PROBE_WAIT_MS: what each probe may cost the lookup sending it


def _lookups_for(
    client: LookupClient, keys: list[str], seconds: float
) -> tuple[list[float], list[tuple[float, list[bool] | None]]]:
    """A lookup every `EVERY_S` for `seconds`, as a scheduler's loop: (seconds spent inside
    each lookup, each lookup's (start, answer))."""
    waits: list[float] = []
    answers: list[tuple[float, list[bool] | None]] = []
    started = time.monotonic()
    while (now := time.monotonic()) < started + seconds:
        answer = client.query(keys)
        waits.append(time.monotonic() - now)
        answers.append((now - started, answer))
        time.sleep(EVERY_S)
    return waits, answers


def test_a_stalled_master_costs_the_scheduler_one_lookup_timeout_not_one_per_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45: with the master SIGSTOPped, each lookup timed out or, once a timed-out
    reply counted as lost, went out again and waited the timeout anew: the scheduler
    froze for a timeout every two. Now the first one times out, the pool counts as down,
    and lookups are misses at once while probes (one at a time, on a backoff) wait for it."""
    require_mooncake()
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", LOOPBACK)
    monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    with MasterProcess.start(log_path=tmp_path / "master.log") as master:
        store = MooncakeStore.connect(mooncake_config(master.address))
        server = LookupServer(store.batch_is_readable, secret=b"")
        client = LookupClient(
            server.address, TIMEOUT_MS, secret=b"", probe_max_backoff_s=PROBE_CAP_S
        )
        try:
            data = np.arange(4096, dtype=np.uint8)
            stored = [f"breaker-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
            pointers, sizes = [[data.ctypes.data]] * 2, [[data.nbytes]] * 2
            assert store.batch_put_whole(stored, pointers, sizes) == [Status.OK] * 2
            keys = [*stored, "breaker-absent"]
            assert client.query(keys) == [True, True, False]
            os.kill(master.pid, signal.SIGSTOP)
            try:
                waits, stalled = _lookups_for(client, keys, STALL_S)
                skipped, probes = client.skipped, client.breaker.probes
            finally:
                os.kill(master.pid, signal.SIGCONT)
            _, resumed = _lookups_for(client, keys, PROBE_CAP_S + 2 * TIMEOUT_MS / 1000 + 3)
            stats, again = client.take_stats(), client.take_stats()
        finally:
            client.close()
            server.close()
            store.close()
    # SIGSTOP reaches every thread of the master within a moment: answers until then.
    first_miss = next(at for at, answer in stalled if answer is None)
    assert first_miss < 1.0
    assert all(answer is None for at, answer in stalled if at >= first_miss)
    # One lookup waited the timeout; each probe waited at most PROBE_WAIT_S; the others
    # cost a poll each (a few ms at most on a loaded machine).
    blocked = sum(waits)
    assert [wait for wait in waits if wait > 4 * PROBE_WAIT_S] == [
        pytest.approx(TIMEOUT_MS / 1000, abs=0.2)
    ]
    assert blocked < TIMEOUT_MS / 1000 + probes * PROBE_WAIT_S + 0.002 * len(waits) + 0.3
    assert client.breaker.opened == 1
    misses = sum(answer is None for _, answer in stalled)
    assert skipped == misses - 1  # all but the first: not sent, not waited on
    found = [at for at, answer in resumed if answer == [True, True, False]]
    assert found, "lookups did not find the stored keys after the master resumed"
    print(f"blocked {blocked:.2f} s, {len(stalled)} lookups, {probes} probes, {found[0]:.1f} s")
    assert all(answer == [True, True, False] for at, answer in resumed if at >= found[0])
    # The connector's stats tell the outage: one opening, one closing, what was skipped.
    assert stats == {
        "skipped_lookups": client.skipped,
        "breaker_opened": 1,
        "breaker_closed": 1,
        "breaker_probes": client.breaker.probes,
    }
    assert stats["breaker_probes"] >= probes >= 1
    assert set(again.values()) == {0}  # counts since the last call


def test_a_silent_server_gets_one_probe_at_a_time_and_lookups_never_wait_again() -> None:
    """A server that takes requests and never answers (a worker stuck in a store call):
    after the first time-out, lookups return at once; the server sees one probe at a
    time, on the backoff; once it answers a probe, lookups go out again."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)  # counts what arrives, answers when told
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port(f"tcp://{LOOPBACK}")
    client = LookupClient(
        f"tcp://{LOOPBACK}:{port}", 200, secret=b"", probe_backoff_s=0.1, probe_max_backoff_s=0.4
    )
    try:
        assert client.query(["yes"]) is None  # timed out: the one wait of this outage
        arrivals: list[tuple[float, list[bytes]]] = []
        blocked, started = 0.0, time.monotonic()
        while time.monotonic() < started + 2.0:
            blocked += _looked_up_in_vain(client, server, arrivals, started)
        probes = client.breaker.probes
        assert blocked < probes * PROBE_WAIT_S + 0.2
        assert len(arrivals) == 1 + probes  # the timed-out lookup, then the probes
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(arrivals[1:])]
        assert all(gap >= 0.2 - 0.05 for gap in gaps)  # never one before the last expired
        assert 3 <= probes <= 2.0 / 0.2 + 1
        while len(arrivals) == 1 + probes:  # the next probe (bounded: the test's timeout)
            _looked_up_in_vain(client, server, arrivals, started)
        peer, request_id, empty, _ = arrivals[-1][1]  # answered in time, by the server
        server.send_multipart([peer, request_id, empty, lookup_reply([False])])
        time.sleep(0.05)
        answering = threading.Thread(target=_answer_next, args=(server, [True]))
        answering.start()
        assert client.query(["yes"]) == [True]  # the probe's answer seen: sent again
        answering.join()
        assert not client.breaker.is_open
    finally:
        client.close()
        server.close(0)
        context.term()


def _looked_up_in_vain(
    client: LookupClient,
    server: zmq.Socket[bytes],
    arrivals: list[tuple[float, list[bytes]]],
    started: float,
) -> float:
    """One lookup, a miss (how long it took), and what reached the server meanwhile."""
    before = time.monotonic()
    assert client.query(["yes"]) is None
    took = time.monotonic() - before
    while server.poll(0, zmq.POLLIN):
        arrivals.append((time.monotonic() - started, server.recv_multipart()))
    time.sleep(0.02)
    return took


def lookup_reply(readable: list[bool]) -> bytes:
    return msgspec.msgpack.encode(LookupReply(readable=readable))


def _answer_next(server: zmq.Socket[bytes], readable: list[bool]) -> None:
    """Answer the next request that arrives within 2 s."""
    if server.poll(2000, zmq.POLLIN):
        peer, request_id, empty, _ = server.recv_multipart()
        server.send_multipart([peer, request_id, empty, lookup_reply(readable)])
