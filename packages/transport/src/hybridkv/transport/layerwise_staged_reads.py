"""Staged loads layer by layer: whole objects fetched into staging slabs at a step's start,
each layer scattered into the caches when it is due.

The first layer waits for the whole fetch; then a second thread scatters layers from the
last one down while the layer reads go up from the first (`LayerClaims` says who copies
which layer, each once), so the copies take about half as long and still come in the order
the forward pass needs them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from functools import cached_property

from hybridkv.transport.batches import GroupBatch
from hybridkv.transport.reads import StagedReads

log = logging.getLogger(__name__)


class LayerwiseStagedReads(StagedReads):
    """Whole objects fetched into staging slabs at the step's start, in the background;
    each layer is scattered into the caches when it is due (prefetched a few layers ahead).

    An object holds every layer, so the first layer waits for the whole fetch, but only
    for its own scatter. Once the fetch is in, a second thread scatters layers from the
    last one down while the layer reads go up from the first, so the copies take about
    half the time they would on one thread and still come in the order the forward pass
    needs them. A group's slabs are freed once all of its layers are scattered. A batch
    larger than the pool's free room is loaded whole at the start, in waves.
    """

    _fetch: Future[list[tuple[GroupBatch, int]]] | None = None
    _fetched = False
    _back: Future[None] | None = None  # the second thread's scatter
    _back_tried = False

    def scheduled_layers(self) -> set[int]:
        return {layer for batch in self.batches.values() for layer in batch.layout.layers}

    def start(self) -> None:
        """Fetch in the background (if this raises, every block fails: no fetch fills the
        slabs, and later layers must not scatter them into the caches)."""
        assert self.pool is not None
        self.stage()
        if not all(batch.fully_staged() for batch in self.batches.values()):
            self.unstage()  # more than the free room: every layer now, in waves
            super().start()
            return
        call = self.whole_call(self.batches.values())
        if not call.keys:
            return
        if any(batch.layout.contiguous and batch.alive.any() for batch in self.batches.values()):
            self.caches_writable()  # contiguous objects are fetched straight into the caches
        parts = self.options.split(call.nbytes, call.pieces)
        self._fetch = self.pool.gets.submit(
            self.issue_serially, call, parts, "batch_get_whole", self._get_whole(call)
        )

    def read_layer(self, layer: int) -> None:
        self._await_fetch()
        claims = self._claims
        if claims is None:
            return  # nothing staged: every object came straight into the caches
        mine = claims.claim_front(layer)
        if not self._back_tried and self._fetch is not None and self.pool is not None:
            # Started once the fetch is in (its failed rows failed, none copied) and the
            # first due layer is claimed here: the second thread never holds that one up.
            self._back_tried = True
            try:
                self._back = self.pool.scatters.submit(self._scatter_back, claims)
            except RuntimeError:  # shut down (interpreter exit): every layer is read here
                log.debug("no second thread to scatter layers: the reads scatter them all")
        if mine:
            self._scatter(claims, layer)
        else:
            claims.wait(layer)

    def end(self) -> None:
        try:
            self._await_fetch()
        finally:
            try:
                # Not started (queued behind another step's): it has claimed nothing, and
                # the reads scattered every layer. Started: no slab is freed under it.
                if self._back is not None and not self._back.cancel():
                    self._back.result()
            finally:
                self.unstage()

    @cached_property
    def _staged(self) -> list[GroupBatch]:
        """The batches fetched into slabs (fixed once the fetch started)."""
        return [batch for batch in self.batches.values() if batch.segments]

    @cached_property
    def _claims(self) -> LayerClaims | None:
        """Who scatters which layer (None: nothing staged, nothing to scatter)."""
        if not self._staged:
            return None
        groups = {batch.layout.group_id: batch.layout.layers for batch in self._staged}
        return LayerClaims(self.layers, groups)

    def _scatter(self, claims: LayerClaims, layer: int) -> None:
        """Copy one layer of every staged group into the caches; free the slabs of the
        groups whose last layer this was."""
        self.caches_writable()
        with self.outcome.cache_access.touching() as allowed:
            if not allowed:  # given up: the caches' blocks may hold other KV by now
                self.fail_all(self._staged, blamed=False)
            for batch in self._staged:
                entries = batch.layout.entries_of_layer(layer)
                if entries:
                    batch.copy_rows(batch.live(), into_staging=False, entries=entries)
        completed = claims.scattered(layer)
        self.unstage([batch for batch in self._staged if batch.layout.group_id in completed])

    def _scatter_back(self, claims: LayerClaims) -> None:
        """The second thread: claim layers from the last one down until the reads meet it."""
        try:
            while (layer := claims.claim_back()) is not None:
                self._scatter(claims, layer)
        except BaseException as exc:
            claims.abandon(exc)
            raise

    def _await_fetch(self) -> None:
        """Wait for the fetch once; its failed keys are failed before any layer is copied."""
        if self._fetch is None or self._fetched:
            return
        self._fetched = True
        try:
            failed = self._fetch.result()
        except BaseException:  # the slabs' contents are unknown
            self.fail_all(self.batches.values(), blamed=False)
            raise
        self.fail(failed)


class LayerClaims:
    """Which of two threads scatters each layer of a staged load, each layer once: one
    claims layers from the first up (the order they are due), the other from the last
    down, until they meet. Also which groups have had all of their layers scattered."""

    def __init__(self, layers: Sequence[int], group_layers: Mapping[int, Iterable[int]]) -> None:
        self._layers = list(layers)
        self._index = {layer: index for index, layer in enumerate(self._layers)}
        self._front = 0  # the first thread claimed every index below this
        self._back = len(self._layers)  # the second thread claimed every index from here on
        self._left = {group: set(layers) for group, layers in group_layers.items()}
        self._scattered: set[int] = set()
        self._done = {layer: threading.Event() for layer in self._layers}
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def claim_front(self, layer: int) -> bool:
        """Whether the caller scatters `layer` (False: the second thread claimed it)."""
        index = self._index[layer]
        with self._lock:
            if index >= self._back:
                return False
            self._front = max(self._front, index + 1)
            return True

    def claim_back(self) -> int | None:
        """The second thread's next layer, from the last down; None once they met."""
        with self._lock:
            if self._back <= self._front:
                return None
            self._back -= 1
            return self._layers[self._back]

    def scattered(self, layer: int) -> set[int]:
        """Record `layer` as scattered; returns the groups whose last layer it was."""
        completed = set()
        with self._lock:
            self._scattered.add(layer)
            for group, left in self._left.items():
                if layer in left:
                    left.discard(layer)
                    if not left:
                        completed.add(group)
        self._done[layer].set()
        return completed

    def wait(self, layer: int) -> None:
        """Until the second thread scattered `layer`; raises if it stopped before."""
        self._done[layer].wait()
        with self._lock:
            if layer not in self._scattered:
                raise RuntimeError(f"layer {layer} was not scattered") from self._error

    def abandon(self, error: BaseException) -> None:
        """The second thread failed: wake whoever waits on a layer it claimed."""
        with self._lock:
            self._error = error
            claimed = self._layers[self._back :]
        for layer in claimed:
            self._done[layer].set()
