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


class NpuEvent:
    """A `torch.npu.Event` waited for on the device of the thread that made it.

    An NPU context is per thread: a transfer thread that never chose a device would wait
    in device 0's (vLLM-Ascend's own transfer threads set theirs first), so a wait first
    makes the event's device current on the waiting thread."""

    def __init__(self) -> None:
        importlib.import_module("torch_npu")  # registers the torch.npu namespace
        self._npu = importlib.import_module("torch").npu
        self._device = self._npu.current_device()
        self._event = self._npu.Event()

    def record(self) -> None:
        self._event.record()

    def synchronize(self) -> None:
        if self._npu.current_device() != self._device:
            self._npu.set_device(self._device)
        self._event.synchronize()


_EVENT_FACTORIES: dict[str, Callable[[], Event]] = {
    "cpu": CpuEvent,
    "cuda": _cuda_event,
    "npu": NpuEvent,
}


def make_event(device: str) -> Event:
    """An event for `device` ("cpu", "cuda[:n]", "npu[:n]"), built at run time."""
    factory = _EVENT_FACTORIES.get(device.split(":", 1)[0].lower())
    if factory is None:
        raise ValueError(
            f"no event type for device {device!r}; expected one of {sorted(_EVENT_FACTORIES)}"
        )
    return factory()
