"""MasterHealth: down from the first unanswered call until a real call is answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hybridkv.transport.errors import StoreClosed
from hybridkv.transport.master_health import MasterHealth


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


class Master:
    """What the probe sees: whether the port accepts, whether a call is answered."""

    def __init__(self) -> None:
        self.accepts = True
        self.answering = False
        self.asked = 0
        self._lock = threading.Lock()

    def reachable(self) -> bool:
        return self.accepts

    def answers(self) -> bool:
        with self._lock:
            self.asked += 1
        return self.answering


def test_up_until_a_call_fails() -> None:
    health = MasterHealth(lambda: True, lambda: True, interval_s=0.01)
    assert not health.down


def test_an_accepting_port_alone_does_not_bring_it_back() -> None:
    master = Master()
    health = MasterHealth(master.reachable, master.answers, interval_s=0.01)
    health.failed()
    wait_until(lambda: master.asked >= 3)
    assert health.down  # the port accepted each time, the master never answered
    master.answering = True
    wait_until(lambda: not health.down)
    health.close()


def test_the_probe_asks_only_once_the_port_accepts() -> None:
    master = Master()
    master.accepts = False
    health = MasterHealth(master.reachable, master.answers, interval_s=0.01)
    health.failed()
    time.sleep(0.1)
    assert master.asked == 0
    assert health.down
    master.accepts, master.answering = True, True
    wait_until(lambda: not health.down)
    health.close()


def test_failures_while_down_start_no_second_probe() -> None:
    master = Master()
    health = MasterHealth(master.reachable, master.answers, interval_s=0.2)
    before = threading.active_count()
    for _ in range(20):
        health.failed()
    assert threading.active_count() <= before + 1
    master.answering = True
    wait_until(lambda: not health.down)
    health.failed()  # down again: a new probe
    assert health.down
    wait_until(lambda: not health.down)
    health.close()


def test_a_closed_store_ends_the_probe() -> None:
    def closed() -> bool:
        raise StoreClosed("MooncakeStore is closed")

    health = MasterHealth(lambda: True, closed, interval_s=0.01)
    health.failed()
    wait_until(lambda: not any(t.name == "hybridkv-master-probe" for t in threading.enumerate()))
    assert health.down


def test_no_probe_after_close() -> None:
    master = Master()
    health = MasterHealth(master.reachable, master.answers, interval_s=0.01)
    health.close()
    health.failed()
    time.sleep(0.05)
    assert master.asked == 0
