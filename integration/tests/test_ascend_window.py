"""The window installed into vLLM-Ascend's FA / SFA / DSA paths, on faithful fakes.

vllm-ascend and torch_npu cannot run here: `tests/fakes` mirrors their module paths, class
and method names and call order, and a fake NPU stream runs the fake kernels on its own
thread so the host really runs ahead of the device. The fakes are used only when the real
packages are absent.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import require
from fakes import FAKES_DIR, ascend_runtime, real_package_present
from fakes.ascend_runtime import AttentionLayer, FakeAttnMetadata
from fakes.npu import FakeNpuDevice, npu_namespace, torch_npu_module
from layerwise_rig import ClientFailsReads, GatedStore, Rig, wait_until

from hybridkv.integration.layerwise.ascend_window import (
    GraphModeNotSupportedError,
    install_ascend_windows,
    require_eager,
)
from hybridkv.integration.layerwise.vllm_window import VllmLayerwise, plan_vllm_layers
from hybridkv.transport import CpuEvent, Event, LayerwiseStep, MemoryStore, make_event

# vLLM (and through it transformers) probes for torch_npu on import; import the layer
# classes the plan uses before a test puts the fake torch_npu into sys.modules.
require("vllm.model_executor.layers.mamba.abstract")
require("vllm.model_executor.layers.attention.mla_attention")

if real_package_present("vllm_ascend") or real_package_present("torch_npu"):
    pytest.skip(
        "real vllm-ascend / torch_npu installed: the fake-based suite does not apply",
        allow_module_level=True,
    )

NAMES = [f"model.layers.{n}.self_attn.attn" for n in range(3)]  # FA, SFA, DSA
BLOCKS = [2, 4]
EAGER = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True))


class Connector:
    """The worker's hook lines, as the hybridkv connector forwards vLLM's calls."""

    def __init__(self, layerwise: VllmLayerwise) -> None:
        self.layerwise = layerwise

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.layerwise.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        self.layerwise.save_layer(layer_name)


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNpuDevice]:
    import torch

    device = FakeNpuDevice()
    monkeypatch.setattr(torch, "npu", npu_namespace(device), raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu_module())
    monkeypatch.syspath_prepend(str(FAKES_DIR))
    monkeypatch.setattr(ascend_runtime, "device", device)
    monkeypatch.setattr(ascend_runtime, "trace", [])
    yield device
    device.close()


class AscendModel:
    """Three attention layers through vllm-ascend's FA, SFA and DSA impls (the fakes)."""

    def __init__(
        self, new_event: Any, monkeypatch: pytest.MonkeyPatch, store: MemoryStore | None = None
    ) -> None:
        from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl
        from vllm_ascend.attention.dsa_v1 import AscendDSAImpl
        from vllm_ascend.attention.sfa_v1 import AscendSFAImpl

        self.rig = Rig(
            store=store,
            groups={0: (16, (0, 1, 2))},
            reporters={n: i for i, n in enumerate(NAMES)},
            new_event=new_event,
        )
        self.fa = AttentionLayer(NAMES[0], AscendAttentionBackendImpl())
        self.sfa = AscendSFAImpl(layer_name=NAMES[1])
        self.dsa = AscendDSAImpl(compress_ratio=4)
        static_forward_context = {
            NAMES[0]: self.fa,
            NAMES[1]: SimpleNamespace(impl=self.sfa),
            NAMES[2]: SimpleNamespace(impl=self.dsa),
        }
        plan = plan_vllm_layers(static_forward_context, set(NAMES), connector_windows=False)
        self.layerwise = VllmLayerwise(self.rig.strategy, plan)
        self.windows = install_ascend_windows(
            self.rig.strategy, static_forward_context, EAGER, window=self.layerwise.window
        )
        monkeypatch.setattr(ascend_runtime, "connector", Connector(self.layerwise))
        self._spy_on_step(monkeypatch)

    def _spy_on_step(self, monkeypatch: pytest.MonkeyPatch) -> None:
        save_layer, checkpoint = LayerwiseStep.save_layer, LayerwiseStep.checkpoint

        def traced_save(step: LayerwiseStep, layer: int, event: Event) -> None:
            ascend_runtime.trace.append(f"put:{NAMES[layer]}")
            save_layer(step, layer, event)

        def traced_checkpoint(step: LayerwiseStep) -> None:
            ascend_runtime.trace.append("checkpoint")
            checkpoint(step)

        monkeypatch.setattr(LayerwiseStep, "save_layer", traced_save)
        monkeypatch.setattr(LayerwiseStep, "checkpoint", traced_checkpoint)

    def forward(self, fill: int) -> None:
        def meta(layer: int) -> FakeAttnMetadata:
            return FakeAttnMetadata(write_blocks=BLOCKS, read_blocks=BLOCKS, fill=fill + layer)

        self.fa.forward(self.rig.caches[0, 0], meta(0))
        self.sfa.forward(NAMES[1], None, self.rig.caches[0, 1], meta(1), output=[])
        self.dsa.forward(NAMES[2], None, self.rig.caches[0, 2], meta(2), output=[])

    def stored_layers(self) -> list[int]:
        """Load the saved objects back into zeroed caches; the first byte of each layer.

        The device first runs every kernel queued: one still writing the caches could
        otherwise land between the load and the read (an ungated step waits for none)."""
        assert ascend_runtime.device is not None
        ascend_runtime.device.synchronize()
        for cache in self.rig.caches.values():
            cache[:] = 0
        self.rig.engine.load(self.rig.transfers(BLOCKS)).wait()
        return [int(self.rig.caches[0, layer][BLOCKS[0], 0]) for layer in range(3)]

    def close(self) -> None:
        self.windows.uninstall()
        self.rig.close()


@pytest.fixture
def model(npu: FakeNpuDevice, monkeypatch: pytest.MonkeyPatch) -> Iterator[AscendModel]:
    made = AscendModel(lambda: make_event("npu"), monkeypatch)
    yield made
    made.close()


def test_each_window_sits_between_the_cache_writes_and_the_attention_op(
    model: AscendModel,
) -> None:
    model.rig.strategy.begin_step([], model.rig.transfers(BLOCKS))
    model.forward(fill=30)
    model.layerwise.end_step()
    trace = ascend_runtime.trace
    for name in NAMES:
        write, put = trace.index(f"cache_write:{name}"), trace.index(f"put:{name}")
        attention, o_proj = trace.index(f"attention:{name}"), trace.index(f"o_proj:{name}")
        checkpoint = trace.index("checkpoint", attention)
        assert write < put < attention < checkpoint < o_proj, name
    dsa = NAMES[2]  # after the compressor too, and never around the whole layer
    assert trace.index(f"compressor:{dsa}") < trace.index(f"put:{dsa}")
    assert trace.index(f"connector_wait:{dsa}") < trace.index(f"cache_write:{dsa}")
    assert trace.count("checkpoint") == 3  # connector saves after o_proj add none


def test_puts_wait_for_the_npu_event_while_the_host_runs_ahead(
    model: AscendModel, npu: FakeNpuDevice
) -> None:
    model.rig.strategy.begin_step([], model.rig.transfers(BLOCKS))
    with npu.held():  # the device has not run a single kernel when the host is done
        model.forward(fill=40)
        assert not model.rig.readable(0, BLOCKS)
    model.layerwise.end_step()
    assert model.stored_layers() == [40, 41, 42]


class CountingStore(MemoryStore):
    """Counts ranged puts that completed, to know when ungated puts have read the caches."""

    def __init__(self) -> None:
        super().__init__()
        self.ranged_puts = 0

    def put_ranges(self, keys, ptrs, sizes, offsets):  # type: ignore[no-untyped-def]
        statuses = super().put_ranges(keys, ptrs, sizes, offsets)
        self.ranged_puts += 1
        return statuses


def test_negative_control_an_ungated_event_saves_stale_bytes(
    npu: FakeNpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CountingStore()
    model = AscendModel(CpuEvent, monkeypatch, store)
    try:
        model.rig.strategy.begin_step([], model.rig.transfers(BLOCKS))
        with npu.held():
            model.forward(fill=40)
            # every layer's ranges reached the store while no kernel had run
            assert wait_until(lambda: store.ranged_puts == len(NAMES))
        model.layerwise.end_step()
        assert model.stored_layers() == [0, 0, 0]  # read before the kernels wrote
    finally:
        model.close()


def test_layerwise_loads_land_before_each_attention_op(model: AscendModel) -> None:
    model.rig.strategy.begin_step([], model.rig.transfers(BLOCKS))
    model.forward(fill=50)
    model.layerwise.end_step()
    for cache in model.rig.caches.values():
        cache[:] = 0
    model.rig.strategy.begin_step(model.rig.transfers(BLOCKS), [])
    seen: dict[str, int] = {}
    for layer, name in enumerate(NAMES):  # a decode step reads the loaded blocks only
        metadata = FakeAttnMetadata(write_blocks=[0], read_blocks=BLOCKS, fill=0, seen=seen)
        if layer == 0:
            model.fa.forward(model.rig.caches[0, 0], metadata)
        elif layer == 1:
            model.sfa.forward(name, None, model.rig.caches[0, 1], metadata, output=[])
        else:
            model.dsa.forward(name, None, model.rig.caches[0, 2], metadata, output=[])
    model.layerwise.end_step()
    assert ascend_runtime.device is not None
    ascend_runtime.device.synchronize()  # the fake kernels run on their own stream
    block_bytes = model.rig.caches[0, 0].shape[1]
    assert seen == {name: (50 + i) * block_bytes * len(BLOCKS) for i, name in enumerate(NAMES)}


@pytest.mark.parametrize("num_prefills", [1, 0], ids=["with-prefill", "decodes-only"])
def test_mla_attention_reads_its_loaded_blocks_in_a_batch_without_a_prefill(
    npu: FakeNpuDevice, monkeypatch: pytest.MonkeyPatch, num_prefills: int
) -> None:
    """vLLM-Ascend's MLA asks the connector for a layer's loads only when the batch holds a
    prefill; a request whose pool hit leaves it a decode-sized query is not one. Its get
    is held back: the attention op must still read the loaded blocks."""
    from vllm_ascend.attention.mla_v1 import AscendMLAImpl

    name = "model.layers.0.self_attn.mla_attn"
    store = GatedStore()
    rig = Rig(
        store=store,
        groups={0: (16, (0,))},
        reporters={name: 0},
        new_event=lambda: make_event("npu"),
    )
    mla = AscendMLAImpl()
    context = {name: SimpleNamespace(impl=mla)}
    plan = plan_vllm_layers(context, {name}, connector_windows=False)
    layerwise = VllmLayerwise(rig.strategy, plan)
    windows = install_ascend_windows(
        rig.strategy, context, EAGER, load_gate=layerwise.wait_for_layer_load
    )
    monkeypatch.setattr(ascend_runtime, "connector", Connector(layerwise))
    try:
        layerwise.begin_step([], rig.transfers(BLOCKS))
        mla.forward(name, None, rig.caches[0, 0], FakeAttnMetadata(BLOCKS, BLOCKS, fill=70))
        layerwise.end_step()
        npu.synchronize()
        rig.caches[0, 0][:] = 0
        store.get_gate.clear()
        threading.Timer(0.3, store.get_gate.set).start()
        layerwise.begin_step(rig.transfers(BLOCKS), [])
        seen: dict[str, int] = {}
        decode = FakeAttnMetadata([0], BLOCKS, fill=0, num_prefills=num_prefills, seen=seen)
        mla.forward(name, None, rig.caches[0, 0], decode)
        layerwise.end_step()
        npu.synchronize()
        block_bytes = rig.caches[0, 0].shape[1]
        assert seen == {name: 70 * block_bytes * len(BLOCKS)}
    finally:
        store.get_gate.set()
        windows.uninstall()
        rig.close()


def test_a_load_raising_in_a_window_fails_the_loads_not_the_forward(
    npu: FakeNpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client error in the first window's get: the step drains, the other windows pass
    through, and every load of the step is reported failed (vLLM recomputes)."""
    store = ClientFailsReads()
    model = AscendModel(lambda: make_event("npu"), monkeypatch, store)
    try:
        model.rig.strategy.begin_step([], model.rig.transfers(BLOCKS))
        model.forward(fill=50)
        model.layerwise.end_step()
        store.broken = True
        model.layerwise.begin_step(model.rig.transfers(BLOCKS), [])
        model.forward(fill=60)  # raised out of the first attention op before
        assert model.layerwise.finish_loads().failed_blocks == {0: set(BLOCKS)}
        assert model.layerwise.end_step() is None
    finally:
        model.close()


def test_outside_a_step_the_patched_paths_run_unwindowed(
    model: AscendModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ascend_runtime, "connector", None)  # no connector metadata bound
    model.forward(fill=1)  # a profiling / dummy run: no step is open
    assert not any(entry.startswith(("put:", "checkpoint")) for entry in ascend_runtime.trace)


def test_install_is_idempotent_and_uninstall_restores_every_original(
    npu: FakeNpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_ascend.attention import attention_v1, dsa_v1, mla_v1, sfa_v1
    from vllm_ascend.device.device_op import BaseDeviceAdaptor

    originals = {
        (attention_v1.AscendAttentionBackendImpl, "forward_impl"),
        (sfa_v1.AscendSFAImpl, "_execute_sparse_flash_attention_process"),
        (dsa_v1.AscendDSAImpl, "_forward_attention"),
        (BaseDeviceAdaptor, "get_dsa_sparse_attn_op"),
        (mla_v1.AscendMLAImpl, "forward"),
    }
    before = {(owner, name): owner.__dict__[name] for owner, name in originals}
    model = AscendModel(CpuEvent, monkeypatch)
    again = install_ascend_windows(model.rig.strategy, {}, EAGER)
    assert again is model.windows
    patched = attention_v1.AscendAttentionBackendImpl.forward_impl
    assert patched.__wrapped__ is before[attention_v1.AscendAttentionBackendImpl, "forward_impl"]
    assert isinstance(BaseDeviceAdaptor.__dict__["get_dsa_sparse_attn_op"], staticmethod)
    other = Rig(groups={0: (16, (0,))}, reporters={NAMES[0]: 0})
    with pytest.raises(RuntimeError, match="already installed"):
        install_ascend_windows(other.strategy, {}, EAGER)
    other.close()
    model.close()
    assert {key: key[0].__dict__[key[1]] for key in originals} == before


def test_graph_mode_is_refused_with_the_switch_to_use() -> None:
    graph = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False))
    with pytest.raises(GraphModeNotSupportedError, match=r"enforce_eager=True.*use_layerwise"):
        require_eager(graph)
    require_eager(EAGER)


def test_npu_events_come_from_the_transport_with_the_fake_torch_npu(npu: FakeNpuDevice) -> None:
    event = make_event("npu:0")
    waiter = threading.Thread(target=event.synchronize)
    with npu.held():
        position = npu.launch(lambda: None)
        event.record()
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # the kernel has not run: the wait holds
    waiter.join(10)
    assert not waiter.is_alive()
    assert npu.passed(position)


def test_an_npu_event_is_waited_for_on_its_own_device_from_any_thread(
    npu: FakeNpuDevice,
) -> None:
    """NPU contexts are per thread: the transfer threads, which never chose a device,
    wait for an event of the worker's device (here npu:1) on that device."""
    import torch

    torch.npu.set_device(1)  # type: ignore[attr-defined]
    event = make_event("npu")
    event.record()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            event.synchronize()
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(10)
    assert errors == []


assert np.uint8  # numpy is what the fake caches are made of


def test_build_on_npu_installs_the_windows_and_shutdown_removes_them(
    npu: FakeNpuDevice,
) -> None:
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl

    from hybridkv.integration.layerwise.vllm_window import build_vllm_layerwise

    original = AscendAttentionBackendImpl.__dict__["forward_impl"]
    rig = Rig(groups={0: (16, (0,))}, reporters={})
    ctx = {"g0.l0": AttentionLayer("g0.l0", AscendAttentionBackendImpl())}
    graph = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False))
    with pytest.raises(GraphModeNotSupportedError):
        build_vllm_layerwise(rig.engine, ctx, "npu:0", graph)
    layerwise = build_vllm_layerwise(rig.engine, ctx, "npu:0", EAGER)
    assert AscendAttentionBackendImpl.__dict__["forward_impl"] is not original
    layerwise.begin_step([], rig.transfers(BLOCKS))
    ctx["g0.l0"].forward(rig.caches[0, 0], FakeAttnMetadata(BLOCKS, BLOCKS, fill=7))
    layerwise.save_layer("g0.l0")  # the window already saved it: no second put
    assert layerwise.strategy.stats.layers_saved == 1
    assert layerwise.end_step() is not None
    layerwise.close()
    assert AscendAttentionBackendImpl.__dict__["forward_impl"] is original
    rig.close()
