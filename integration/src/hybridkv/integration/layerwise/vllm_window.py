"""Layerwise transfer on upstream vLLM: its connector calls mapped onto the window.

vLLM 0.32 brackets every attention kernel with the connector: `wait_for_layer_load` after
the layer's cache update (for backends with `forward_includes_kv_cache_update = False`,
and always for MLA) and `save_kv_layer` after the kernel, before the output projection.
Those two calls are the window's entry and checkpoint. Backends that write the cache
inside the kernel get no window: their put goes out from `save_kv_layer`, after the
kernel. Mamba-type layers (Mamba, GDN, Kimi KDA, LFM2 short conv: every `MambaBase`)
never call the connector; a forward hook on each module is their post-compute save.

vLLM may call `start_load_kv` after the forward (steps without synchronous loads), so the
step must begin when the worker binds the step's connector metadata, not there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridkv.integration.layerwise.compute_window import LayerwiseStrategy
from hybridkv.integration.transfer_strategy import (
    PendingSave,
    SettledSave,
    Transfers,
    all_failed,
)
from hybridkv.transport import BlockTransfer, TransferEngine, TransferResult, make_event

log = logging.getLogger(__name__)

_Result = TypeVar("_Result")


@dataclass(frozen=True)
class VllmLayerPlan:
    """How each cache-holding layer of a vLLM model reports to the strategy.

    `windows`: attention layers whose cache is written before `wait_for_layer_load`;
    `after_kernel`: attention layers whose kernel writes the cache (put at `save_kv_layer`);
    `state`: Mamba-type layers saved from a forward hook. `riders`: cache names that never
    call in (indexer keys, compressor state written before the attention op): saved with
    their layer, but read before its attention's `wait_for_layer_load` (vLLM's MLA layer
    runs its indexer first), so their loads land before the forward starts.
    """

    windows: frozenset[str]
    after_kernel: frozenset[str]
    state: frozenset[str]
    riders: frozenset[str] = frozenset()

    @property
    def reporters(self) -> frozenset[str]:
        return self.windows | self.after_kernel | self.state


def plan_vllm_layers(
    static_forward_context: Mapping[str, Any], names: set[str], connector_windows: bool = True
) -> VllmLayerPlan:
    """Classify the cache-holding layer `names` by how vLLM lets the connector in.

    `connector_windows=False` (vLLM-Ascend, whose attention paths call the connector
    before their cache writes) turns every window into an after-kernel save; the
    Ascend installer then opens the real windows around the attention ops.
    """
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    windows: set[str] = set()
    after_kernel: set[str] = set()
    state: set[str] = set()
    for name in names:
        module = static_forward_context.get(name)
        if isinstance(module, MambaBase):
            state.add(name)
        elif isinstance(module, MLAAttention):
            # MLA always updates its cache before the attention op
            (windows if connector_windows else after_kernel).add(name)
        elif isinstance(module, Attention):
            writes_in_kernel = module.attn_backend.forward_includes_kv_cache_update
            (windows if connector_windows and not writes_in_kernel else after_kernel).add(name)
        elif hasattr(module, "impl") and not connector_windows:
            after_kernel.add(name)  # an attention layer class of vLLM-Ascend's own
    riders = names - windows - after_kernel - state
    return VllmLayerPlan(
        frozenset(windows), frozenset(after_kernel), frozenset(state), frozenset(riders)
    )


class VllmLayerwise:
    """The layerwise `TransferStrategy`: one method per vLLM connector hook, plus module hooks.

    `object_sizes` (group -> bytes of one object) turns loaded blocks into loaded bytes for
    the counters. `hooks_fire=False` (a compiled model, where module hooks are traced away)
    makes `begin_step` wait for the Mamba-type layers' loads before the forward starts;
    `riders_through`, the last physical layer holding one of the plan's riders, does the
    same for the loads of every layer up to it.
    """

    def __init__(
        self,
        strategy: LayerwiseStrategy,
        plan: VllmLayerPlan,
        object_sizes: Mapping[int, int] | None = None,
        hooks_fire: bool = True,
        riders_through: int | None = None,
    ) -> None:
        self.strategy = strategy
        self._plan = plan
        self._riders_through = riders_through
        self._object_sizes = dict(object_sizes or {})
        self._hooks_fire = hooks_fire
        self._loads: list[BlockTransfer] = []
        self._loaded: TransferResult | None = None  # the step's loads, once waited for
        # A hook of this step raised (an error of the client, not a store failure, which
        # the transport reports per block): the step was drained, the rest of the forward
        # passes through, every load counts as failed; those whose reads the store failed
        # are blamed (quarantined).
        self._step_raised = False
        self._blamed_in_drain: set[str] = set()
        self._open_windows: set[str] = set()
        self._hook_handles: list[Any] = []
        self._uninstall: list[Callable[[], None]] = []

    def install_state_hooks(self, static_forward_context: Mapping[str, Any]) -> None:
        """Mamba-type layers never call the connector: a pre-hook waits for their loads,
        a post-compute hook saves their state."""
        for name in sorted(self._plan.state):
            module = static_forward_context[name]
            self._hook_handles.append(module.register_forward_pre_hook(self._load_hook(name)))
            self._hook_handles.append(module.register_forward_hook(self._state_hook(name)))

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def begin_step(self, loads: Transfers, saves: Transfers, hold_saves: bool = False) -> None:
        """Raises what the transport raised (the worker reports every load failed); the
        forward's hooks then pass through."""
        self._open_windows.clear()
        self._loads = list(loads)
        self._loaded = None
        self._step_raised = False
        self._blamed_in_drain = set()
        with self._failing_the_step():
            self.strategy.begin_step(loads, saves, hold_saves)
            if loads and self._riders_through is not None:
                self.strategy.wait_for_loads_through(self._riders_through)
            if loads and not self._hooks_fire and self._plan.state:
                last_state = max(self._plan.state, key=self.strategy.layer_of)
                self.strategy.wait_for_layer_load(last_state)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._guarded(lambda: self._enter(layer_name), None)

    def save_layer(self, layer_name: str) -> None:
        """vLLM's `save_kv_layer`."""
        self._guarded(lambda: self._leave(layer_name), None)

    @contextmanager
    def window(self, name: str) -> Iterator[None]:
        """An attention op wrapped where vLLM gives no window (vLLM-Ascend's installer):
        its entry and checkpoint pass through an error of ours as the connector hooks do;
        the op's own error drains the step and propagates."""
        self._guarded(lambda: self.strategy.enter(name), None)
        with self._failing_the_step():
            yield
        self._guarded(self.strategy.checkpoint, None)

    def _enter(self, layer_name: str) -> None:
        if layer_name in self._plan.windows:
            self.strategy.enter(layer_name)
            self._open_windows.add(layer_name)
        elif layer_name in self._plan.after_kernel:
            self.strategy.wait_for_layer_load(layer_name)

    def _leave(self, layer_name: str) -> None:
        if layer_name in self._open_windows:
            self._open_windows.discard(layer_name)
            self.strategy.checkpoint()
        elif layer_name in self._plan.after_kernel and not self.strategy.has_reported(layer_name):
            self.strategy.post_compute_save(layer_name)  # no window ran for it this step

    def discard_saves(self) -> None:
        self.strategy.taint()

    def finish_loads(self) -> TransferResult:
        """Wait for every get of the step; an error (now or earlier in the step) counts as
        every load failing, and blames the reads the store failed (before it or while the
        step drained)."""
        if self._loaded is None:
            loads = self._loads
            failed = self._guarded(self.strategy.wait_all_loads, None)
            if failed is None:  # the step was drained when it raised
                self._loaded = all_failed(loads, self._blamed_in_drain)
            else:
                lost = {(group, block) for group, blocks in failed.items() for block in blocks}
                keys = [t.key for t in loads if (t.group, t.local_block) in lost]
                blamed = set(self.strategy.blamed_loads())
                self._loaded = TransferResult(
                    failed_blocks=failed,
                    failed_keys=keys,
                    unblamed_keys=[key for key in keys if key not in blamed],
                    bytes=sum(
                        self._object_sizes.get(t.group, 0)
                        for t in loads
                        if (t.group, t.local_block) not in lost
                    ),
                )
        return self._loaded

    def end_step(self, keep_saves: bool = True) -> PendingSave | None:
        """vLLM's `wait_for_save`: every get and put of the step completes here."""
        self._open_windows.clear()
        loaded = self.finish_loads()
        result = self._guarded(lambda: self.strategy.wait_for_save(keep_saves), None)
        if result is None:  # no step, or it was drained when it raised (perhaps a put)
            return None
        # No seconds: the transport's clock spans the whole forward; the exposed tail
        # (take_stats) is what layerwise transfer costs.
        saved = TransferResult(
            failed_keys=result.failed_keys,
            contended_keys=result.contended_keys,
            bytes=max(result.bytes - loaded.bytes, 0),
        )
        return SettledSave(saved)

    def saves_in_background(self) -> bool:
        return self.strategy.saves_in_background()

    def take_stats(self) -> dict[str, float]:
        stats = self.strategy.reset_stats().as_dict()
        stats["layerwise_steps"] = stats.pop("steps")
        return stats

    def _guarded(self, call: Callable[[], _Result], fallback: _Result) -> _Result:
        """`call()`, unless the step already raised (then `fallback`); an exception is
        logged and drains the step instead of stopping vLLM's forward."""
        if self._step_raised:
            return fallback
        try:
            with self._failing_the_step():
                return call()
        except Exception:
            log.exception("hybridkv: layerwise step failed; its loads are recomputed")
            return fallback

    @contextmanager
    def _failing_the_step(self) -> Iterator[None]:
        """An exception drains the step and lets the rest of the forward pass through."""
        try:
            yield
        except BaseException:
            self._step_raised = True
            self.strategy.abort()  # unless the strategy drained the step already
            self._blamed_in_drain = set(self.strategy.blamed_loads())
            raise

    def close(self) -> None:
        """Teardown: drain the open step, remove every hook and patch installed."""
        self._open_windows.clear()
        self.strategy.abort()
        self.remove_hooks()
        while self._uninstall:
            self._uninstall.pop()()

    def _load_hook(self, name: str) -> Callable[..., None]:
        import torch

        strategy = self.strategy

        def before_forward(_module: Any, _args: Any) -> None:
            if torch.compiler.is_compiling() or not strategy.active:
                return  # compiled: begin_step already waited (hooks_fire=False)
            self._guarded(lambda: strategy.wait_for_layer_load(name), None)

        return before_forward

    def _state_hook(self, name: str) -> Callable[..., None]:
        import torch

        strategy = self.strategy

        def after_forward(_module: Any, _args: Any, _output: Any) -> None:
            # Under torch.compile this traces to nothing; `wait_for_save` (or the next
            # reporting layer) then submits the layer, still in order and after its kernel.
            if torch.compiler.is_compiling() or not strategy.active:
                return
            self._guarded(lambda: strategy.post_compute_save(name), None)

        return after_forward


def build_vllm_layerwise(
    engine: TransferEngine,
    static_forward_context: Mapping[str, Any],
    device: str,
    vllm_config: Any = None,
    load_deadline_s: float | None = None,
    save_deadline_s: float | None = None,
) -> VllmLayerwise:
    """Everything the worker needs, from its engine and the model's layer modules.

    Physical layers come from the engine's layouts (the numbering of the objects' byte
    offsets; an entry `name#k` belongs to layer name `name`). Mamba-type modules get their
    post-compute hook here; on an NPU the windows are installed into vLLM-Ascend's
    attention paths instead of vLLM's connector calls (eager mode only).
    """
    layer_of = {
        entry.name.split("#", 1)[0]: entry.layer
        for layout in engine.layouts.values()
        for entry in layout.entries
    }
    on_npu = device.split(":", 1)[0] == "npu"
    plan = plan_vllm_layers(static_forward_context, set(layer_of), connector_windows=not on_npu)
    strategy = LayerwiseStrategy(
        engine,
        layers=sorted(set(layer_of.values())),
        reporters={name: layer_of[name] for name in plan.reporters},
        new_event=lambda: make_event(device),
        always_report=plan.windows | plan.after_kernel,
        load_deadline_s=load_deadline_s,
        save_deadline_s=save_deadline_s,
    )
    sizes = {group: layout.object_size for group, layout in engine.layouts.items()}
    layerwise = VllmLayerwise(
        strategy,
        plan,
        sizes,
        hooks_fire=_runs_eagerly(vllm_config),
        riders_through=max((layer_of[name] for name in plan.riders), default=None),
    )
    if on_npu:
        from hybridkv.integration.layerwise.ascend_window import install_ascend_windows

        windows = install_ascend_windows(
            strategy,
            static_forward_context,
            vllm_config,
            window=layerwise.window,
            load_gate=layerwise.wait_for_layer_load,
        )
        layerwise._uninstall.append(windows.uninstall)
    layerwise.install_state_hooks(static_forward_context)
    return layerwise


def _runs_eagerly(vllm_config: Any) -> bool:
    """Whether module hooks run: not under torch.compile (enforce_eager, or no config)."""
    model_config = getattr(vllm_config, "model_config", None)
    return model_config is None or bool(getattr(model_config, "enforce_eager", False))
