"""Events: CPU needs no wait, device events are built lazily, unknown devices refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridkv.transport.device_events import CpuEvent, Event, make_event


def test_cpu_event_satisfies_the_protocol_and_never_blocks() -> None:
    event = make_event("cpu")
    assert isinstance(event, CpuEvent)
    assert isinstance(event, Event)
    event.record()
    event.synchronize()


def test_unknown_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="no event type for device 'tpu'"):
        make_event("tpu")


def test_importing_the_package_or_making_a_cpu_event_does_not_import_torch() -> None:
    code = (
        "import sys, hybridkv.transport as t; t.make_event('cpu'); "
        "print([m for m in ('torch', 'torch_npu') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_cuda_event_comes_from_torch_when_a_gpu_is_there() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    event = make_event("cuda:0")
    assert isinstance(event, torch.cuda.Event)
    event.record()
    event.synchronize()
