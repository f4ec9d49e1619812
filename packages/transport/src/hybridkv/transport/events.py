"""Readiness of device memory, so a put never reads KV the device has not finished writing.

The engine only calls `synchronize()` on its send thread before reading a layer's bytes;
the model thread calls `record()` right after the layer's kernels are queued. CPU memory
is ready as soon as the Python call that wrote it returned, so its event does nothing.
torch is imported only when a device event is asked for: nothing here needs it otherwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Event(Protocol):
    """A point in a device stream that the host can wait for."""

    def record(self) -> None:
        """Mark the current point of the producing stream."""

    def synchronize(self) -> None:
        """Block until the device has passed the recorded point."""


class CpuEvent:
    """Host memory needs no wait: writes are visible when the writing call returns."""

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _cuda_event() -> Event:
    event: Event = importlib.import_module("torch").cuda.Event()
    return event


def _npu_event() -> Event:
    importlib.import_module("torch_npu")  # registers the torch.npu namespace
    event: Event = importlib.import_module("torch").npu.Event()
    return event


_EVENT_FACTORIES: dict[str, Callable[[], Event]] = {
    "cpu": CpuEvent,
    "cuda": _cuda_event,
    "npu": _npu_event,
}


def make_event(device: str) -> Event:
    """An event for `device` ("cpu", "cuda[:n]", "npu[:n]"), built at run time."""
    factory = _EVENT_FACTORIES.get(device.split(":", 1)[0].lower())
    if factory is None:
        raise ValueError(
            f"no event type for device {device!r}; expected one of {sorted(_EVENT_FACTORIES)}"
        )
    return factory()
