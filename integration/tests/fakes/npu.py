"""A fake Ascend device: one compute stream that runs queued kernels on its own thread.

It models what matters to the window: the host queues kernels and returns at once; the
device runs them later, in order; `torch.npu.Event.record()` marks the stream position and
`synchronize()` blocks the host until the device has passed it. `hold()` stops the device
so a test can prove that a transfer waits for the event rather than for luck. The current
device is per thread (0 until `set_device`), as an NPU context is, and an event's wait
fails on a thread whose current device is not the event's.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class FakeNpuDevice:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[Callable[[], None]] = []
        self._queued = 0
        self._done = 0
        self._held = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="fake-npu-stream", daemon=True)
        self._thread.start()

    def launch(self, kernel: Callable[[], None]) -> int:
        """Queue a kernel; returns its stream position."""
        with self._cond:
            self._queue.append(kernel)
            self._queued += 1
            self._cond.notify_all()
            return self._queued

    @property
    def position(self) -> int:
        with self._cond:
            return self._queued

    def wait_until(self, position: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done >= position)

    def passed(self, position: int) -> bool:
        with self._cond:
            return self._done >= position

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._cond:
            self._held = True
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def synchronize(self) -> None:
        self.wait_until(self.position)

    def close(self) -> None:
        self.release()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._queue and not self._held))
                if self._closed and not self._queue:
                    return
                if self._held and not self._closed:
                    continue
                kernel = self._queue.pop(0)
            kernel()
            with self._cond:
                self._done += 1
                self._cond.notify_all()


def npu_namespace(device: FakeNpuDevice) -> types.ModuleType:
    """What `import torch_npu` adds as `torch.npu`, reduced to streams and events."""
    npu = types.ModuleType("torch.npu")
    current = threading.local()

    def current_device() -> int:
        index: int = getattr(current, "index", 0)
        return index

    def set_device(index: int) -> None:
        current.index = index

    class Stream:
        def synchronize(self) -> None:
            device.synchronize()

    stream = Stream()

    class Event:
        def __init__(
            self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
        ) -> None:
            self._position: int | None = None
            self._device = current_device()

        def record(self, stream: Stream | None = None) -> None:
            self._position = device.position

        def synchronize(self) -> None:
            if current_device() != self._device:
                raise RuntimeError(
                    f"event of npu:{self._device} waited for on npu:{current_device()}"
                )
            if self._position is not None:
                device.wait_until(self._position)

        def query(self) -> bool:
            return self._position is None or device.passed(self._position)

    npu.Stream = Stream  # type: ignore[attr-defined]
    npu.Event = Event  # type: ignore[attr-defined]
    npu.current_stream = lambda device_index=None: stream  # type: ignore[attr-defined]
    npu.synchronize = lambda device_index=None: device.synchronize()  # type: ignore[attr-defined]
    npu.is_available = lambda: True  # type: ignore[attr-defined]
    npu.current_device = current_device  # type: ignore[attr-defined]
    npu.set_device = set_device  # type: ignore[attr-defined]
    return npu


def torch_npu_module() -> types.ModuleType:
    """The `torch_npu` import the transport performs before touching `torch.npu`."""
    module = types.ModuleType("torch_npu")
    module.__dict__["__hybridkv_fake__"] = True
    return module


def real_torch_npu_present() -> bool:
    existing = sys.modules.get("torch_npu")
    return existing is not None and not getattr(existing, "__hybridkv_fake__", False)
