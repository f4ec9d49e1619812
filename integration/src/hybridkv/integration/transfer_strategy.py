"""How one step's transfers are issued: the interface both transfer modes implement.

The worker calls the same points every step, whatever the mode:

- `begin_step(loads, saves)` when vLLM binds the step's connector metadata, before the
  forward (vLLM calls `start_load_kv` after the forward in steps without synchronous
  loads, so that hook is too late for anything the forward needs);
- `wait_for_layer_load(name)` / `save_layer(name)` from vLLM's per-layer connector calls;
- `finish_loads()` once the forward is done with the step's loads (from `wait_for_save`,
  or earlier when vLLM asks for failed blocks before it), then `end_step()` from
  `wait_for_save`;
- `close()` at shutdown.

`WholeBlocks` (here) moves each object in one piece: loads land before the forward,
saves start after it and finish in the background.
`hybridkv.integration.layerwise.vllm_window.VllmLayerwise` moves them layer by layer
while the model computes. Either way a step's saves have completed before the worker
lets vLLM reuse a block (what `end_step` returns, waited for by the worker's barrier: at
the next step's first hook where vLLM calls that before it writes any block, else before
`wait_for_save` returns).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from hybridkv.transport import BlockTransfer, Event, TransferEngine, TransferResult

logger = logging.getLogger(__name__)

# One step's loads or saves.
Transfers = Sequence[BlockTransfer]


class PendingSave(Protocol):
    """A step's saves, perhaps still running: the worker waits for them before vLLM can
    reuse a block they read (a `Ticket` of the transfer engine is one)."""

    @property
    def done(self) -> bool:
        """Whether nothing of them runs any more."""

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Their result; TimeoutError if they are not done within `timeout`."""

    def call_off(self) -> None:
        """Given up on: once this returns they read the caches no more, and what they
        have not read yet is never stored."""


class SettledSave:
    """Saves that completed within their step (layer by layer): nothing left to wait for."""

    done = True

    def __init__(self, result: TransferResult) -> None:
        self._result = result

    def wait(self, timeout: float | None = None) -> TransferResult:
        return self._result

    def call_off(self) -> None:
        return None


class TransferStrategy(Protocol):
    """One step's transfers, driven by vLLM's connector calls (see the module doc)."""

    def begin_step(self, loads: Transfers, saves: Transfers, hold_saves: bool = False) -> None:
        """Before the forward: the loads it needs, the saves it completes.

        Once a load failed, no layer computed after it is saved: a block the step
        completes was computed over the failed one (or over a block sharing it) and holds
        wrong KV. Layers computed before the failure was known did not read it.
        `hold_saves`: save nothing before `end_step` decides (another TP rank's failed
        load reaches this rank's KV through the model's all-reduces)."""

    def discard_saves(self) -> None:
        """The step's loads are lost (they raised): save nothing it computes."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_layer(self, layer_name: str) -> None: ...

    def finish_loads(self) -> TransferResult:
        """After the forward: wait for the step's loads; their result, the same on every
        call of the step (`failed_blocks` hold no valid KV: vLLM recomputes them)."""

    def end_step(self, keep_saves: bool = True) -> PendingSave | None:
        """After `finish_loads` (vLLM's `wait_for_save`); `keep_saves=False`: a load failed
        on some rank, save nothing more. Returns what waits for the step's saves (None:
        nothing to wait for); the worker waits for it before vLLM can reuse a saved block."""

    def saves_in_background(self) -> bool:
        """Whether saves the strategy gave up at their deadline still have calls running
        (a later save would queue behind them)."""

    def take_stats(self) -> dict[str, float]:
        """Mode-specific counters since the last call (summed into the connector stats)."""

    def close(self) -> None:
        """Drain whatever is open; nothing stays in flight or hooked into the model."""


def all_failed(transfers: Sequence[BlockTransfer], blamed: Collection[str] = ()) -> TransferResult:
    """The result of transfers that raised instead of reporting per block: every block
    failed (vLLM recomputes it). Only `blamed`, the keys whose reads the store failed
    before (or while a step drained), are their objects' fault (quarantined)."""
    failed: dict[int, set[int]] = {}
    for transfer in transfers:
        failed.setdefault(transfer.group, set()).add(transfer.local_block)
    keys, blamed = [t.key for t in transfers], set(blamed)
    unblamed = [key for key in keys if key not in blamed]
    return TransferResult(failed_blocks=failed, failed_keys=keys, unblamed_keys=unblamed)


def given_up(transfers: Sequence[BlockTransfer]) -> TransferResult:
    """The result of a load given up at its deadline: every block failed, every key to
    blame (quarantined: read again, it would wait on the same stalled holder)."""
    return all_failed(transfers, [transfer.key for transfer in transfers])


class WholeBlocks:
    """Each object in one piece: loads complete before the forward (or are given up at
    `load_deadline_s`), saves start after it."""

    def __init__(
        self,
        engine: TransferEngine,
        new_event: Callable[[], Event],
        load_deadline_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self._new_event = new_event
        self._load_deadline_s = load_deadline_s
        self._loaded = TransferResult()
        self._saves: list[BlockTransfer] = []

    def begin_step(self, loads: Transfers, saves: Transfers, hold_saves: bool = False) -> None:
        self._saves = list(saves)  # held anyway: they go out at `end_step`
        self._loaded = TransferResult()
        if loads:
            ticket = self.engine.load(loads)
            try:
                self._loaded = ticket.wait(self._load_deadline_s)
            except TimeoutError:  # given up: it writes the caches no more once called off
                ticket.call_off()
                logger.warning(
                    "hybridkv: a load of %d blocks still running after load_deadline_s "
                    "(%g s): given up, vLLM recomputes them",
                    len(loads),
                    self._load_deadline_s,
                )
                self._loaded = given_up(loads)
            except Exception:  # what the store failed before is still to blame
                self._loaded = all_failed(loads, ticket.blamed_keys())
                raise

    def discard_saves(self) -> None:
        self._saves = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_layer(self, layer_name: str) -> None:
        return None

    def finish_loads(self) -> TransferResult:
        return self._loaded  # begin_step waited for them

    def end_step(self, keep_saves: bool = True) -> PendingSave | None:
        saves, self._saves = self._saves, []
        if not saves or not keep_saves:
            return None
        ready = self._new_event()
        ready.record()  # the forward's cache writes
        return self.engine.save(saves, ready)

    def saves_in_background(self) -> bool:
        return False  # its saves are waited for (and given up) by the worker's barrier

    def take_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._saves = []
