"""Install the layerwise window into vLLM-Ascend's attention paths, at their real names.

vLLM-Ascend calls the connector at the edges of the whole attention layer (before the
cache writes, after the output projection), too wide for a window: a put submitted
there would either precede the cache writes or give the transfer nothing to hide behind.
So the window wraps the attention op itself, where vLLM-Ascend records its own
attention fence (`record_attention_compute_start`):

- FA  `AscendAttentionBackendImpl.forward_impl` (paged / FIA attention; `forward` has
  already run `reshape_and_cache`);
- SFA `AscendSFAImpl._execute_sparse_flash_attention_process` (the sparse attention op,
  after the indexer and cache scatters);
- DSA the op returned by `DeviceOperator.get_dsa_sparse_attn_op()` while
  `AscendDSAImpl._forward_attention` runs (after the prolog, compressor and indexer
  cache updates, before the sparse attention op).

Paths without a window (MLA, C8 quantized attention) still save correctly: their put goes
out from `save_kv_layer`, after the kernel. MLA's `AscendMLAImpl.forward` asks the
connector for the layer's loads only when the batch holds a prefill, and vLLM-Ascend counts
a short query as a decode: a request whose pool hit leaves it one token (or one plus the
speculative ones) to compute is not a prefill, and its attention would read blocks still
being fetched. So that method waits for the layer's loads on entry (a load gate; a second
wait for the same layer returns at once). Patching is idempotent and reversible, and only
eager mode is accepted until graph capture is validated on NPU hardware.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from hybridkv.integration.layerwise.compute_window import LayerwiseStrategy

# Opens the window of one attention layer around its op.
Window = Callable[[str], AbstractContextManager[None]]
# Returns once one attention layer's loads of the step are in its cache.
LoadGate = Callable[[str], None]


class GraphModeNotSupportedError(RuntimeError):
    """Layerwise windows under ACL graph capture are not validated yet."""


def require_eager(vllm_config: Any) -> None:
    """Refuse graph mode with the exact switch the user needs."""
    if not vllm_config.model_config.enforce_eager:
        raise GraphModeNotSupportedError(
            "hybridkv use_layerwise=true on vLLM-Ascend runs in eager mode only until graph "
            "mode is validated on NPU hardware: start vLLM with enforce_eager=True "
            "(--enforce-eager), or set use_layerwise: false in kv_connector_extra_config"
        )


class _Installation(Protocol):
    """What a patched method asks of the installation that owns it."""

    def window_for(self, name: str | None) -> Any: ...

    def wait_for_loads(self, name: str) -> None: ...

    def layer_name_of(self, impl: object) -> str | None: ...

    @property
    def current_dsa_layer(self) -> str | None: ...

    def dsa_scope(self, name: str) -> Any: ...


@dataclass(frozen=True)
class WindowTarget:
    """One vLLM-Ascend callable to patch: `module.owner.method`, wrapped by `kind`."""

    module: str
    owner: str
    method: str
    kind: str  # "kernel" | "layer_scope" | "op_factory" | "load_gate"

    def resolve(self) -> type | None:
        """The class to patch; None when this vLLM-Ascend has no such module at all."""
        try:
            module = importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and self.module.startswith(exc.name):
                return None
            raise
        owner = getattr(module, self.owner)
        if not isinstance(owner, type):
            raise TypeError(f"{self.module}.{self.owner} is not a class")
        if not hasattr(owner, self.method):
            raise AttributeError(
                f"{self.module}.{self.owner} has no {self.method}: this vLLM-Ascend version "
                "does not match the attention paths hybridkv knows"
            )
        return owner

    def wrap(self, original: Callable[..., Any], installation: _Installation) -> Any:
        return _WRAPPERS[self.kind](original, installation)


def _kernel(original: Callable[..., Any], installation: _Installation) -> Callable[..., Any]:
    """The attention kernel method of a per-layer impl object runs inside the window."""

    @functools.wraps(original)
    def windowed(self: object, *args: Any, **kwargs: Any) -> Any:
        with installation.window_for(installation.layer_name_of(self)):
            return original(self, *args, **kwargs)

    return windowed


def _layer_scope(original: Callable[..., Any], installation: _Installation) -> Callable[..., Any]:
    """Remember which DSA layer runs, for the op factory below (it is not told)."""

    @functools.wraps(original)
    def scoped(self: object, layer_name: str, *args: Any, **kwargs: Any) -> Any:
        with installation.dsa_scope(layer_name):
            return original(self, layer_name, *args, **kwargs)

    return scoped


def _op_factory(original: Callable[..., Any], installation: _Installation) -> Callable[..., Any]:
    """The DSA sparse attention op, returned windowed while a DSA layer is running."""

    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        op = original(*args, **kwargs)
        name = installation.current_dsa_layer
        if name is None:
            return op

        def windowed_op(*op_args: Any, **op_kwargs: Any) -> Any:
            with installation.window_for(name):
                return op(*op_args, **op_kwargs)

        return windowed_op

    return factory


def _load_gate(original: Callable[..., Any], installation: _Installation) -> Callable[..., Any]:
    """A layer method that may reach its attention op without asking the connector for the
    layer's loads first waits for them."""

    @functools.wraps(original)
    def gated(self: object, layer_name: str, *args: Any, **kwargs: Any) -> Any:
        installation.wait_for_loads(layer_name)
        return original(self, layer_name, *args, **kwargs)

    return gated


_WRAPPERS: dict[str, Callable[[Callable[..., Any], _Installation], Callable[..., Any]]] = {
    "kernel": _kernel,
    "layer_scope": _layer_scope,
    "op_factory": _op_factory,
    "load_gate": _load_gate,
}

ASCEND_WINDOW_TARGETS: tuple[WindowTarget, ...] = (
    WindowTarget("vllm_ascend.attention.attention_v1", "AscendAttentionBackendImpl",
                 "forward_impl", "kernel"),
    WindowTarget("vllm_ascend.attention.sfa_v1", "AscendSFAImpl",
                 "_execute_sparse_flash_attention_process", "kernel"),
    WindowTarget("vllm_ascend.attention.dsa_v1", "AscendDSAImpl", "_forward_attention",
                 "layer_scope"),
    WindowTarget("vllm_ascend.attention.dsa_v1", "DeviceOperator", "get_dsa_sparse_attn_op",
                 "op_factory"),
    WindowTarget("vllm_ascend.attention.mla_v1", "AscendMLAImpl", "forward", "load_gate"),
)  # fmt: skip

_MISSING = object()
_lock = threading.Lock()
_installed: AscendWindows | None = None


class AscendWindows:
    """The patches of one installation; `uninstall()` puts every original back."""

    def __init__(
        self,
        strategy: LayerwiseStrategy,
        impl_names: Mapping[int, str],
        window: Window | None = None,
        load_gate: LoadGate | None = None,
    ) -> None:
        self.strategy = strategy
        self._window = window or strategy.window
        self._load_gate = load_gate or strategy.wait_for_layer_load
        self._impl_names = dict(impl_names)
        self._originals: list[tuple[type, str, object]] = []
        self._dsa = threading.local()

    def window_for(self, name: str | None) -> Any:
        """The window, or nothing outside a step / for a layer that never reports."""
        if name is None or not self.strategy.active or not self.strategy.reports(name):
            return nullcontext()
        return self._window(name)

    def wait_for_loads(self, name: str) -> None:
        """The layer's loads in its cache; nothing outside a step or for a layer that never
        reports."""
        if self.strategy.active and self.strategy.reports(name):
            self._load_gate(name)

    def layer_name_of(self, impl: object) -> str | None:
        name = getattr(impl, "layer_name", None)
        if isinstance(name, str) and name:
            return name
        return self._impl_names.get(id(impl))

    @property
    def current_dsa_layer(self) -> str | None:
        name: str | None = getattr(self._dsa, "name", None)
        return name

    @contextmanager
    def dsa_scope(self, name: str) -> Iterator[None]:
        outer = self.current_dsa_layer
        self._dsa.name = name
        try:
            yield
        finally:
            self._dsa.name = outer

    def _patch(self, targets: tuple[WindowTarget, ...]) -> None:
        resolved = [(target, target.resolve()) for target in targets]  # all or nothing
        for target, owner in resolved:
            if owner is None:
                continue
            descriptor = owner.__dict__.get(target.method, _MISSING)
            is_static = isinstance(descriptor, staticmethod) or (
                descriptor is _MISSING
                and isinstance(_lookup_descriptor(owner, target.method), staticmethod)
            )
            wrapped = target.wrap(getattr(owner, target.method), self)
            setattr(owner, target.method, staticmethod(wrapped) if is_static else wrapped)
            self._originals.append((owner, target.method, descriptor))

    def uninstall(self) -> None:
        global _installed
        with _lock:
            for owner, method, descriptor in reversed(self._originals):
                if descriptor is _MISSING:
                    delattr(owner, method)
                else:
                    setattr(owner, method, descriptor)
            self._originals.clear()
            if _installed is self:
                _installed = None


def _lookup_descriptor(owner: type, name: str) -> object:
    for klass in owner.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return _MISSING


def install_ascend_windows(
    strategy: LayerwiseStrategy,
    static_forward_context: Mapping[str, Any],
    vllm_config: Any,
    targets: tuple[WindowTarget, ...] = ASCEND_WINDOW_TARGETS,
    window: Window | None = None,
    load_gate: LoadGate | None = None,
) -> AscendWindows:
    """Patch vLLM-Ascend's attention paths to run inside `strategy`'s windows (opened by
    `window(name)`, `strategy.window` by default: the worker passes its `VllmLayerwise`'s,
    through which an error of ours never stops the forward) and behind its load gates
    (`load_gate(name)`, `strategy.wait_for_layer_load` by default; the worker passes its
    connector hook).

    Installing again for the same strategy returns the live installation; a different
    strategy must uninstall the first (the patches are process-wide class attributes).
    """
    global _installed
    require_eager(vllm_config)
    with _lock:
        if _installed is not None:
            if _installed.strategy is strategy:
                return _installed
            raise RuntimeError(
                "vLLM-Ascend layerwise windows are already installed for another connector "
                "in this process; uninstall() that one first"
            )
        impl_names = {
            id(module.impl): name
            for name, module in static_forward_context.items()
            if getattr(module, "impl", None) is not None
        }
        installation = AscendWindows(strategy, impl_names, window, load_gate)
        installation._patch(targets)
        _installed = installation
        return installation
