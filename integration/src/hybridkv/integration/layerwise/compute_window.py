"""The per-layer attention compute window: when a layer's KV moves, relative to its kernel.

One forward is one layerwise step of the transport. For every layer the forward thread
passes through the same three points, whatever framework drives it:

- entry (caches written, kernel not yet launched): wait for this layer's gets, record the
  cache-ready device event and submit this layer's put gated on it (the put reads the
  cache on the transfer threads while the kernel runs);
- checkpoint (kernel launched, before output projection / MoE communication): bound the
  sends still outstanding (the transport's backlog) and leave future-layer gets queued;
- post-compute (layers whose state the kernel itself updates, e.g. Mamba/GDN/conv, or
  attention paths where vLLM gives no window): record the event after the kernel and
  submit the put there, then apply the same send backpressure.

A physical layer's put goes out once every layer name that reports for it has reported;
any earlier layer still unsubmitted goes out first (it has finished computing), so a layer
whose hook never fired (a module hook traced away by torch.compile) still goes out in
order. Not one still waiting for a reporter that calls in at every forward (vLLM's
connector calls): that one may run later than its number says (a draft model's layer
numbered like an early target layer, as Qwen3-Next's `mtp.layers.0`). The step ends at
`wait_for_save`, which submits what is left and waits for every queued put. Any error, in
the forward or surfacing from the transfer threads, drains the step fully before it
propagates: nothing is left in flight or half-committed behind the caller's back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from hybridkv.integration.transfer_strategy import Transfers
from hybridkv.transport import Event, LayerwiseStep, TransferEngine, TransferResult

log = logging.getLogger(__name__)


@dataclass
class LayerwiseStats:
    """Forward time spent blocked on transfers, summed over steps since the last reset.

    `exposed_tail_s` is what layerwise transfer failed to hide behind compute: the
    benchmark compares it across prefetch depths and backlogs.
    """

    steps: int = 0
    load_wait_s: float = 0.0  # blocked at attention entry for this layer's gets
    backlog_wait_s: float = 0.0  # blocked at checkpoints bounding outstanding sends
    finish_wait_s: float = 0.0  # blocked at step end for the remaining puts
    layers_saved: int = 0

    @property
    def exposed_tail_s(self) -> float:
        return self.load_wait_s + self.backlog_wait_s + self.finish_wait_s

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "load_wait_s": self.load_wait_s,
            "backlog_wait_s": self.backlog_wait_s,
            "finish_wait_s": self.finish_wait_s,
            "exposed_tail_s": self.exposed_tail_s,
            "layers_saved": self.layers_saved,
        }


@dataclass
class _StepState:
    step: LayerwiseStep
    unreported: dict[int, set[str]]  # physical layer -> names that have not reported yet
    unsubmitted: list[int]  # layers whose put is not submitted, ascending
    loaded: set[int] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)
    failed_loads: dict[int, set[int]] = field(default_factory=dict)  # group -> local blocks
    hold: bool = False  # submit no put before the step end decides
    tainted: bool = False  # the loads are lost: submit no put at all
    moves: bool = True  # the step has gets or puts (counted in `LayerwiseStats.steps`)


class LayerwiseStrategy:
    """Drives one transport layerwise step per forward from the model's layer hooks.

    `reporters` maps each layer name that calls in (an attention window, or a
    post-compute hook) to its physical layer; `layers` are every physical layer that
    holds cache entries (a layer without a reporter is carried by the next one that
    reports, or by `wait_for_save`). `always_report`: the reporters that call in at every
    forward; a later layer never carries one still waiting for them. `new_event` makes the
    device event of the compute stream (`hybridkv.transport.make_event(device)` in
    production). Once a step waited `load_deadline_s` in all for its loads, those still
    running are given up: every one of them fails (vLLM recomputes them). Saves likewise
    at `save_deadline_s`: none of them is announced, and while their calls still run
    (`saves_in_background`), the worker issues no save.
    """

    def __init__(
        self,
        engine: TransferEngine,
        layers: Sequence[int],
        reporters: Mapping[str, int],
        new_event: Callable[[], Event],
        always_report: Collection[str] = (),
        load_deadline_s: float | None = None,
        save_deadline_s: float | None = None,
    ) -> None:
        unknown = sorted(name for name, layer in reporters.items() if layer not in set(layers))
        if unknown:
            raise ValueError(f"layer names report for layers that hold no cache: {unknown}")
        self._engine = engine
        self._layers = sorted(set(layers))
        self._reporters = dict(reporters)
        self._always_report = frozenset(always_report) & set(reporters)
        self._new_event = new_event
        self._load_deadline_s = load_deadline_s
        self._save_deadline_s = save_deadline_s
        self._given_up: list[LayerwiseStep] = []  # steps whose saves were given up
        self._state: _StepState | None = None
        # The keys whose reads the store failed in the step drained last (see `abort`).
        self._drained_blame: list[str] = []
        self.stats = LayerwiseStats()

    @property
    def active(self) -> bool:
        return self._state is not None

    def reports(self, name: str) -> bool:
        """Whether `name` is a layer that calls in (others ride with their layer)."""
        return name in self._reporters

    def has_reported(self, name: str) -> bool:
        """Whether `name` already reported in the open step (its window ran)."""
        return self._state is not None and name in self._state.reported

    def layer_of(self, name: str) -> int:
        try:
            return self._reporters[name]
        except KeyError:
            raise KeyError(
                f"{name!r} is not a layer that reports to the layerwise strategy"
            ) from None

    def begin_step(self, loads: Transfers, saves: Transfers, hold_saves: bool = False) -> None:
        """Open this forward's step (when the worker binds the step's metadata);
        `hold_saves`: every put waits for `wait_for_save` (see `TransferStrategy`)."""
        if self._state is not None:
            self.abort()  # the previous forward died before wait_for_save
        self._drained_blame = []
        unreported: dict[int, set[str]] = {layer: set() for layer in self._layers}
        for name, layer in self._reporters.items():
            unreported[layer].add(name)
        step = self._engine.begin_layerwise(
            loads,
            saves,
            load_deadline_s=self._load_deadline_s,
            save_deadline_s=self._save_deadline_s,
        )
        # A step with nothing to put submits no layer (a decode step, mostly).
        unsubmitted = list(self._layers) if saves else []
        self._state = _StepState(
            step, unreported, unsubmitted, hold=hold_saves, moves=bool(loads or saves)
        )

    def wait_for_layer_load(self, name: str) -> None:
        """Return once this layer's gets are in the cache (vLLM calls this before attention)."""
        self.wait_for_loads_through(self.layer_of(name))

    def wait_for_loads_through(self, layer: int) -> None:
        """Return once the gets of physical layer `layer` and every earlier one are in the
        cache."""
        state = self._require_step()
        if layer in state.loaded:
            return
        started = time.perf_counter()
        with self._draining_on_error():
            state.failed_loads = state.step.wait_layer_loaded(layer)
        self.stats.load_wait_s += time.perf_counter() - started
        state.loaded.add(layer)

    def wait_all_loads(self) -> dict[int, set[int]]:
        """Wait for every get of the open step; the local blocks (per group) that failed."""
        state = self._state
        if state is None or not self._layers:
            return {}
        started = time.perf_counter()
        with self._draining_on_error():
            state.failed_loads = state.step.wait_layer_loaded(self._layers[-1])
        self.stats.finish_wait_s += time.perf_counter() - started  # exposed at step end
        state.loaded.update(self._layers)
        return state.failed_loads

    @contextmanager
    def window(self, name: str) -> Iterator[None]:
        """Wrap an attention kernel whose caches are already written (see module doc)."""
        self.enter(name)
        try:
            yield
        except BaseException:
            self.abort()
            raise
        self.checkpoint()

    def enter(self, name: str) -> None:
        """Window entry, for frameworks that hand entry and exit to separate hooks."""
        self.wait_for_layer_load(name)
        self._report(name)

    def checkpoint(self) -> None:
        """Window exit: bound outstanding sends; future-layer gets stay queued."""
        state = self._require_step()
        started = time.perf_counter()
        with self._draining_on_error():
            state.step.checkpoint()
        self.stats.backlog_wait_s += time.perf_counter() - started

    def post_compute_save(self, name: str) -> None:
        """After a kernel that updated its own cache or state: put now, then backpressure."""
        self._report(name)
        self.checkpoint()

    def taint(self) -> None:
        """The open step's loads are lost: no put of it is submitted from now on."""
        if self._state is not None:
            self._state.tainted = True

    def wait_for_save(self, keep_saves: bool = True) -> TransferResult | None:
        """End the step: submit what is left (`keep_saves=False`: nothing, a load failed
        on some rank), wait for every queued put (and get)."""
        state = self._state
        if state is None:
            return None
        state.hold = False
        state.tainted |= not keep_saves
        self._submit(state, list(state.unsubmitted))
        self._state = None
        started = time.perf_counter()
        try:
            return state.step.finish()  # drains everything even when it raises
        finally:
            self.stats.finish_wait_s += time.perf_counter() - started
            self.stats.steps += state.moves
            if state.step.saves_running:
                self._given_up.append(state.step)

    def saves_in_background(self) -> bool:
        """Whether saves given up at their deadline still have calls running."""
        self._given_up = [step for step in self._given_up if step.saves_running]
        return bool(self._given_up)

    def abort(self) -> None:
        """Drain the open step fully (teardown or error): nothing stays in flight.

        Groups that got all their layers commit, the others are revoked; a transfer error
        met while draining is logged, not raised over the error that caused the abort.
        The keys whose reads the store failed stay in `blamed_loads` (not those a client
        error failed: no object is at fault there).
        """
        state, self._state = self._state, None
        if state is None:
            return
        try:
            state.step.finish()
        except Exception:
            log.warning("layerwise step drained after an error", exc_info=True)
        self._drained_blame = state.step.blamed_loads()
        if state.step.saves_running:
            self._given_up.append(state.step)

    def blamed_loads(self) -> list[str]:
        """Keys whose reads the store failed (a status about their objects) in the open
        step, or, with none open, in the step drained last: to quarantine."""
        return self._drained_blame if self._state is None else self._state.step.blamed_loads()

    def reset_stats(self) -> LayerwiseStats:
        stats, self.stats = self.stats, LayerwiseStats()
        return stats

    def _report(self, name: str) -> None:
        state = self._require_step()
        layer = self.layer_of(name)
        state.reported.add(name)
        pending = state.unreported[layer]
        pending.discard(name)
        if not pending:
            self._submit(
                state,
                [
                    earlier
                    for earlier in state.unsubmitted
                    if earlier <= layer and not state.unreported[earlier] & self._always_report
                ],
            )

    def _submit(self, state: _StepState, due: list[int]) -> None:
        """Submit the unsubmitted layers `due` (ascending), all gated on one fresh event.

        Once a get failed, nothing more is submitted: those layers computed over blocks
        without valid KV, and a group missing layers is dropped when the step finishes.
        """
        if not due or state.hold or state.tainted or any(state.failed_loads.values()):
            return
        event = self._new_event()
        event.record()
        started = time.perf_counter()  # save_layer blocks while the backlog is full
        with self._draining_on_error():
            for pending in due:
                state.step.save_layer(pending, event)
                state.unsubmitted.remove(pending)
                self.stats.layers_saved += 1
        self.stats.backlog_wait_s += time.perf_counter() - started

    def _require_step(self) -> _StepState:
        if self._state is None:
            raise RuntimeError(
                "layerwise hook called outside a step: the worker must call begin_step "
                "when it binds the step's connector metadata"
            )
        return self._state

    @contextmanager
    def _draining_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.abort()
            raise
