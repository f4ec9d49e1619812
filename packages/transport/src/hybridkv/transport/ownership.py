"""Who writes which object, and when each request's transfers are all done.

A save is owned by (request_id, group_id, logical block index): block 0 of one group is a
different object from block 0 of another, and two requests sharing a prefix must not both
write the same key. The first claimant writes; later claimants of a key being written ride
on that write (they finish when it settles). A request's owned blocks survive across
chunked-prefill steps: once committed they are skipped, with their local block id updated
to the one the current step uses.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Protocol

import msgspec

Direction = Literal["save", "load"]
OwnerId = tuple[str, int, int]  # (request_id, group_id, logical block index)


class BlockTransfer(msgspec.Struct, frozen=True):
    """Move one object: `key` <-> local block `local_block` of group `group`."""

    key: str
    group: int
    local_block: int
    request_id: str = ""
    block_index: int = 0

    @property
    def owner(self) -> OwnerId:
        return (self.request_id, self.group, self.block_index)


class OwnedBlock(msgspec.Struct):
    key: str
    local_block: int
    committed: bool = False


class Claim(msgspec.Struct, frozen=True):
    """How a batch of saves splits: write now, ride on another write, or already stored."""

    write: list[BlockTransfer]
    ride: list[BlockTransfer]
    done: list[BlockTransfer]


class Rider:
    """A save waiting on another transfer's write of the same key, and where to report."""

    __slots__ = ("outcome", "transfer")

    def __init__(self, transfer: BlockTransfer, outcome: RideOutcome) -> None:
        self.transfer, self.outcome = transfer, outcome


class RideOutcome(Protocol):
    def ride(self, count: int) -> None: ...

    def rode(
        self, group: int, key: str, block: int, committed: bool, contended: bool = False
    ) -> None: ...


class Ownership:
    """The owners of keys written by this engine, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owned: dict[OwnerId, OwnedBlock] = {}
        self._owners_of: dict[str, set[OwnerId]] = {}
        self._riders: dict[str, list[Rider]] = {}  # key being written -> saves waiting on it

    def claim(
        self,
        transfers: Sequence[BlockTransfer],
        outcome: RideOutcome,
        accepted: Callable[[], None] | None = None,
    ) -> Claim:
        """Split saves; riders are registered to learn the fate of the write into `outcome`.

        A batch naming another key for an owner is refused before anything is claimed:
        a half-claimed batch would leave keys marked as being written with no job to settle
        them, and every later save of those keys would ride on nothing forever.

        `accepted` runs once the batch is accepted, before any of its riders can be settled
        (`settle` takes the same lock): the caller counts the saves there, or the write a
        rider waits on could settle and end the rider's count before it was begun.
        """
        write: list[BlockTransfer] = []
        ride: list[BlockTransfer] = []
        done: list[BlockTransfer] = []
        with self._lock:
            self._check_keys(transfers)
            if accepted is not None:
                accepted()
            for transfer in transfers:
                owned = self._owned.get(transfer.owner)
                if owned is not None and owned.committed:
                    owned.local_block = transfer.local_block
                    done.append(transfer)
                    continue
                if owned is None:
                    self._owned[transfer.owner] = OwnedBlock(transfer.key, transfer.local_block)
                    self._owners_of.setdefault(transfer.key, set()).add(transfer.owner)
                else:
                    owned.local_block = transfer.local_block
                if transfer.key in self._riders:
                    self._riders[transfer.key].append(Rider(transfer, outcome))
                    ride.append(transfer)
                else:
                    self._riders[transfer.key] = []
                    write.append(transfer)
            outcome.ride(len(ride))
        return Claim(write=write, ride=ride, done=done)

    def _check_keys(self, transfers: Sequence[BlockTransfer]) -> None:
        """Each owner keeps one key, within the batch too (held: `self._lock`)."""
        keys: dict[OwnerId, str] = {}
        for transfer in transfers:
            owned = self._owned.get(transfer.owner)
            key = keys.setdefault(transfer.owner, transfer.key if owned is None else owned.key)
            if key != transfer.key:
                raise ValueError(
                    f"request {transfer.request_id!r} group {transfer.group} block "
                    f"{transfer.block_index} already owns key {key!r}, not {transfer.key!r}"
                )

    def settle(self, key: str, committed: bool) -> list[Rider]:
        """Record the fate of a write; returns the saves that rode on it.

        A failed write forgets its owners that had not committed the key, so that a later
        step may try again; an owner that committed it earlier (another request's re-save
        failed, e.g. at its existence query) still owns what is stored.
        """
        with self._lock:
            riders = self._riders.pop(key, [])
            owners = self._owners_of.get(key, set())
            for owner in list(owners):
                owned = self._owned[owner]
                if committed:
                    owned.committed = True
                elif not owned.committed:
                    del self._owned[owner]
                    owners.discard(owner)
            if not owners:
                self._owners_of.pop(key, None)
            return riders

    def owned(self, request_id: str) -> dict[tuple[int, int], OwnedBlock]:
        """(group, block index) -> owned block of one request (a copy)."""
        with self._lock:
            return {
                (group, index): msgspec.structs.replace(block)
                for (owner_request, group, index), block in self._owned.items()
                if owner_request == request_id
            }

    def release_all(self) -> None:
        """Forget every request (their keys changed: a reset moved hashes elsewhere)."""
        with self._lock:
            requests = {owner[0] for owner in self._owned}
        self.release(requests)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests; keys they are still writing keep their riders."""
        gone = set(request_ids)
        with self._lock:
            for owner in [owner for owner in self._owned if owner[0] in gone]:
                key = self._owned.pop(owner).key
                owners = self._owners_of.get(key)
                if owners is not None:
                    owners.discard(owner)
                    if not owners:
                        del self._owners_of[key]


class RequestTracker:
    """Outstanding transfers per request and direction, for vLLM's `get_transfer_results`.

    A request is reported once each time all of its transfers issued so far completed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Direction, Counter[str]] = {"save": Counter(), "load": Counter()}
        self._finished: dict[Direction, set[str]] = {"save": set(), "load": set()}
        # Forgotten while transfers were still in flight: not reported when they end.
        self._forgotten: dict[Direction, set[str]] = {"save": set(), "load": set()}

    def begin(self, direction: Direction, request_ids: Iterable[str]) -> None:
        with self._lock:
            request_ids = list(request_ids)
            self._pending[direction].update(request_ids)
            self._forgotten[direction].difference_update(request_ids)

    def end(self, direction: Direction, request_ids: Iterable[str]) -> None:
        with self._lock:
            pending = self._pending[direction]
            for request_id in request_ids:
                pending[request_id] -= 1
                if pending[request_id] <= 0:
                    del pending[request_id]
                    if request_id in self._forgotten[direction]:
                        self._forgotten[direction].discard(request_id)
                    else:
                        self._finished[direction].add(request_id)

    def outstanding(self, direction: Direction) -> int:
        with self._lock:
            return sum(self._pending[direction].values())

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished requests not polled yet, and the completion of those still in
        flight (vLLM frees a request aborted while it loads in the background): an engine
        whose caller never polls (it waits on tickets instead) must not keep every request
        id it ever saw."""
        request_ids = set(request_ids)
        with self._lock:
            for direction, finished in self._finished.items():
                finished.difference_update(request_ids)
                self._forgotten[direction].update(request_ids & self._pending[direction].keys())

    def poll(self) -> tuple[set[str], set[str]]:
        with self._lock:
            saved, loaded = self._finished["save"], self._finished["load"]
            self._finished = {"save": set(), "load": set()}
            return saved, loaded
