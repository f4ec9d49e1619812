"""The connector's shutdown: bounded when a store call hangs, and never closing the store
under a call that may still run in it."""

from __future__ import annotations

import threading

import pytest

from hybridkv.integration import connector as connector_module
from hybridkv.integration.connector import HybridKVConnector
from hybridkv.integration.lookup import LookupChannel
from hybridkv.integration.pool import Pool


class RecordingStore:
    closed = False

    def close(self) -> None:
        self.closed = True


class Worker:
    """A worker side whose close waits for `release` (a hung store call) or raises."""

    def __init__(self, release: threading.Event, error: Exception | None = None) -> None:
        self.release = release
        self.error = error
        self.closed = threading.Event()

    def close(self) -> None:
        self.release.wait(30)
        self.closed.set()
        if self.error is not None:
            raise self.error


def _connector(worker: Worker, store: RecordingStore) -> HybridKVConnector:
    """A worker-side connector holding `worker` and `store` (no vLLM engine needed)."""
    connector = object.__new__(HybridKVConnector)
    connector._worker = worker  # type: ignore[assignment]
    connector._server = None
    connector._channel = LookupChannel("shutdown-test", port=1)  # no socket file
    connector._pool = Pool(store)  # type: ignore[arg-type]
    connector._client = None
    return connector


def test_a_hung_transfer_holds_shutdown_up_for_a_bound_and_leaves_the_store_open(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(connector_module, "SHUTDOWN_WAIT_S", 0.2)
    release, store = threading.Event(), RecordingStore()
    worker = Worker(release)
    connector = _connector(worker, store)
    connector.shutdown()  # returns although the worker's close still waits
    assert not worker.closed.is_set()
    assert not store.closed  # a call may still run in it
    assert "still running" in caplog.text
    release.set()
    assert worker.closed.wait(10)
    connector.shutdown()  # again: nothing left to do
    assert not store.closed


def test_shutdown_closes_the_store_once_the_worker_drained() -> None:
    release, store = threading.Event(), RecordingStore()
    release.set()
    connector = _connector(Worker(release), store)
    connector.shutdown()
    assert store.closed


def test_an_error_of_the_worker_s_close_reaches_the_caller_and_leaves_the_store_open() -> None:
    """A close that raised may have left a call running: the store is not closed under it."""
    release, store = threading.Event(), RecordingStore()
    release.set()
    connector = _connector(Worker(release, RuntimeError("engine broke")), store)
    with pytest.raises(RuntimeError, match="engine broke"):
        connector.shutdown()
    assert not store.closed
    assert connector._pool is None  # nothing left to close twice
