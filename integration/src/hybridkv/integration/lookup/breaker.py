"""Whether the pool counts as down after a timed-out lookup, and when to probe it."""

from __future__ import annotations

# While the pool counts as down, probes go out this long apart at first, doubling up to
# the cap: a stalled master is asked about once a cap period, not once a lookup.
PROBE_BACKOFF_S = 1.0
PROBE_MAX_BACKOFF_S = 30.0


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
        self.closed = 0  # times a probe closed it: outages over
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
        if ok and self.is_open:
            self.is_open = False
            self.closed += 1
