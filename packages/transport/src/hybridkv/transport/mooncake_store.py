"""`Store` over the real Mooncake client (`mooncake.store.MooncakeDistributedStore`).

What this wrapper adds to the raw client:
- a call after `close()` raises `StoreClosed` instead of crashing the process, and `close()`
  waits for calls in flight (several threads share one store);
- setup fails within seconds, as `StoreUnavailable`, when the master is down (the client
  alone retries for about 90 s);
- after a call gets no answer from the master (it is gone, or stalled past
  `store_timeout_s`), master calls answer RPC_FAILED at once until a background probe gets
  an answer again (`MasterHealth`; the client alone spends ~4 s in each call while it
  reconnects, and the whole timeout in each call to a stalled master); with elected masters
  (`etcd://`), the probe asks once etcd answers, and the client itself finds the new leader;
- integer codes become `Status` members.
Mooncake is imported in `connect`, so importing hybridkv.transport never needs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hybridkv.transport.config import MooncakeConfig
from hybridkv.transport.errors import (
    InvalidRequestError,
    Status,
    StoreClosed,
    StoreError,
    StoreUnavailable,
    error_for,
)
from hybridkv.transport.master_address import parse_master_address
from hybridkv.transport.master_health import MasterHealth
from hybridkv.transport.mooncake_client import load_client_class, prepare_environment, put_placement
from hybridkv.transport.store import (
    Offsets,
    Pointers,
    Sizes,
    check_prefix,
    check_ranges,
    check_whole,
)

# Mooncake 0.3.13 over TCP fails (-800) the keys of one call beyond about 2000 pieces
# (buffers or ranges) in all: data calls are split so no caller can hit it.
MAX_PIECES_PER_CALL = 1024
MASTER_PROBE_TIMEOUT_S = 2.0
# The key the master probe asks about: any answer, even "no such key", is an answer.
PROBE_KEY = "hybridkv-master-probe"
# Characters Mooncake's (ECMAScript) regex treats specially: escaped to match a prefix.
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/")
_RPC_FAILED = Status.RPC_FAILED.value
# Protocols whose transfers need no registered memory on this side: registering there
# would only open the memory to every peer that reaches the transfer port.
UNREGISTERED_PROTOCOLS = frozenset({"tcp"})


class MooncakeStore:
    """A connected Mooncake client; build it with `MooncakeStore.connect(config)`."""

    def __init__(self, client: Any, config: MooncakeConfig, placement: Any = None) -> None:
        self._client = client
        self.config = config
        # Mooncake's ReplicateConfig for new objects; None: Mooncake's default placement.
        self._placement = placement
        self._master = parse_master_address(config.master_server_address)
        self._state = threading.Condition()
        self._closed = False
        self._in_flight = 0
        self._health = MasterHealth(
            lambda: self._master.reachable(MASTER_PROBE_TIMEOUT_S), self._master_answers
        )
        self._registering = threading.Lock()
        self._registered: dict[int, list[int]] = {}  # address -> [size, registrations]
        self._registers = config.protocol not in UNREGISTERED_PROTOCOLS

    @classmethod
    def connect(cls, config: MooncakeConfig) -> MooncakeStore:
        """Join the pool; `StoreUnavailable` in seconds when the master cannot be reached.

        (A port that accepts connections but is no master costs Mooncake's RPC timeout,
        about 30 s: setup holds the GIL, so it cannot be abandoned earlier from Python.)
        """
        master = parse_master_address(config.master_server_address)
        if not master.reachable(MASTER_PROBE_TIMEOUT_S):
            raise StoreUnavailable(f"{master.describe()} does not accept connections")
        client_class = load_client_class()
        prepare_environment(config)
        client = client_class()
        started = time.monotonic()
        code = client.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_server_address,
            None,
            config.enable_ssd_offload,
            config.ssd_offload_path,
            config.tenant_id,
            config.enable_client_http_server,
            config.client_http_port,
        )
        if code != 0:
            raise StoreUnavailable(
                f"Mooncake client setup against {config.master_server_address} failed with "
                f"{Status.from_code(code).name} ({code}) after "
                f"{time.monotonic() - started:.1f} s (segment {config.global_segment_size} B, "
                f"buffer {config.local_buffer_size} B, protocol {config.protocol})"
            )
        return cls(client, config, put_placement(client, config))

    # -- Store protocol ---------------------------------------------------------------

    def register_buffer(self, ptr: int, size: int) -> None:
        """Register once per region: Mooncake refuses a region it already has (-600), but
        two engines over the same caches each register them, so repeats are counted.

        Over TCP nothing is registered: this client's own puts and gets need no
        registration there, and registered memory is what any process reaching the
        transfer port may write into (docs/security.md). RDMA needs it (memory regions)."""
        if not self._registers:
            self._refuse_if_closed()
            return
        with self._registering:
            held = self._registered.get(ptr)
            if held is not None and size <= held[0]:
                held[1] += 1
                return
            with self._call() as client:
                code = client.register_buffer(ptr, size)
            if code != 0:
                raise StoreError(f"register_buffer({ptr:#x}, {size}) failed with code {code}")
            self._registered[ptr] = [size, 1]

    def unregister_buffer(self, ptr: int) -> None:
        """Release one registration; the region leaves Mooncake with its last one."""
        if not self._registers:
            return
        with self._registering:
            held = self._registered.get(ptr)
            if held is not None and held[1] > 1:
                held[1] -= 1
                return
            with self._call() as client:
                code = client.unregister_buffer(ptr)
            if code != 0:
                raise StoreError(f"unregister_buffer({ptr:#x}) failed with code {code}")
            self._registered.pop(ptr, None)

    def batch_is_readable(self, keys: Sequence[str]) -> list[bool]:
        unanswered = Status.RPC_FAILED.value
        codes = self._master_call(
            keys, lambda client: client.batch_is_exist(list(keys)), failed=unanswered
        )
        if unanswered in codes:  # the master is down: no answer, not a miss
            key = keys[codes.index(unanswered)]
            raise error_for(Status.RPC_FAILED, key, "batch_is_readable")
        return [code == 1 for code in codes]

    def batch_put_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        return self._whole(
            "batch_put_whole", keys, ptrs, sizes,
            lambda client, *columns: client.batch_put_from_multi_buffers(
                *columns, *self._placed()
            ),
        )  # fmt: skip

    def batch_get_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        return self._whole(
            "batch_get_whole", keys, ptrs, sizes,
            lambda client, *columns: client.batch_get_into_multi_buffers(*columns),
        )  # fmt: skip

    def put_session_start(self, keys: Sequence[str], object_sizes: Sequence[int]) -> list[Status]:
        if len(object_sizes) != len(keys):
            raise InvalidRequestError(
                f"put_session_start: {len(keys)} keys but {len(object_sizes)} sizes"
            )
        return self._statuses(
            keys,
            lambda client: client.batch_put_session_start(
                list(keys), list(object_sizes), *self._placed()
            ),
        )

    def put_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        # segment traffic only: no master round trip
        return self._ranges(
            "put_ranges", keys, ptrs, sizes, offsets,
            lambda client, *columns: client.batch_put_from_multi_buffer_ranges(*columns),
        )  # fmt: skip

    def put_session_end(self, keys: Sequence[str]) -> list[Status]:
        return self._statuses(keys, lambda client: client.batch_put_session_end(list(keys)))

    def put_session_revoke(self, keys: Sequence[str]) -> list[Status]:
        return self._statuses(keys, lambda client: client.batch_put_session_revoke(list(keys)))

    def get_session_start(self, keys: Sequence[str]) -> list[Status]:
        return self._statuses(keys, lambda client: client.batch_get_session_start(list(keys)))

    def get_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        # replicas were cached by get_session_start: no master round trip
        return self._ranges(
            "get_ranges", keys, ptrs, sizes, offsets,
            lambda client, *columns: client.batch_get_into_multi_buffer_ranges(*columns),
        )  # fmt: skip

    def get_session_end(self, keys: Sequence[str]) -> None:
        with self._call() as client:
            client.batch_get_session_end(list(keys))

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[Status]:
        return self._statuses(keys, lambda client: client.batch_remove(list(keys), force))

    def remove_by_prefix(self, prefix: str, force: bool = False) -> int:
        pattern = "^" + "".join(
            f"\\{c}" if c in _REGEX_SPECIAL else c for c in check_prefix(prefix)
        )
        [code] = self._master_call(
            [prefix],
            lambda client: [int(client.remove_by_regex(pattern, force))],
            failed=Status.RPC_FAILED.value,
        )
        if code < 0:
            raise error_for(Status.from_code(code), prefix, "remove_by_prefix")
        return code

    def close(self) -> None:
        """Wait for calls in flight, then release the client; idempotent."""
        self._health.close()
        with self._state:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:
                self._state.wait()
        self._client.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals --------------------------------------------------------------------

    def _refuse_if_closed(self) -> None:
        with self._state:
            if self._closed:
                raise StoreClosed("MooncakeStore is closed")

    @contextmanager
    def _call(self) -> Iterator[Any]:
        """Admit one client call unless closed; `close` waits until all have left."""
        with self._state:
            self._refuse_if_closed()
            self._in_flight += 1
        try:
            yield self._client
        finally:
            with self._state:
                self._in_flight -= 1
                if not self._in_flight:
                    self._state.notify_all()

    def _whole(
        self,
        operation: str,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        transfer: Callable[..., list[int]],
    ) -> list[Status]:
        """A multi-buffer call, `transfer(client, keys, ptrs, sizes)`, in parts."""
        check_whole(operation, keys, ptrs, sizes)
        return self._in_parts(
            sizes,
            lambda part: self._statuses(
                keys[part],
                lambda client: transfer(
                    client, list(keys[part]), _lists(ptrs[part]), _lists(sizes[part])
                ),
            ),
        )

    def _ranges(
        self,
        operation: str,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
        transfer: Callable[..., list[int]],
    ) -> list[Status]:
        """A range call, `transfer(client, keys, ptrs, sizes, offsets)`, in parts; it moves
        segment bytes only, so it skips the master-down shortcut."""
        check_ranges(operation, keys, ptrs, sizes, offsets)

        def send(part: slice) -> list[Status]:
            with self._call() as client:
                codes = transfer(
                    client, list(keys[part]), _lists(ptrs[part]), _lists(sizes[part]),
                    _lists(offsets[part]),
                )  # fmt: skip
            return [Status.from_code(code) for code in codes]

        return self._in_parts(sizes, send)

    @staticmethod
    def _in_parts(sizes: Sequence[Sizes], send: Callable[[slice], list[Status]]) -> list[Status]:
        """Run `send` over consecutive key slices of at most MAX_PIECES_PER_CALL pieces."""
        statuses: list[Status] = []
        for part in split_by_pieces([len(pieces) for pieces in sizes], MAX_PIECES_PER_CALL):
            statuses.extend(send(part))
        return statuses

    def _placed(self) -> tuple[Any, ...]:
        """The placement argument of a put call, if the configuration chose one."""
        return () if self._placement is None else (self._placement,)

    def _statuses(self, keys: Sequence[str], call: Callable[[Any], list[int]]) -> list[Status]:
        codes = self._master_call(keys, call, failed=Status.RPC_FAILED.value)
        return [Status.from_code(code) for code in codes]

    def _master_call(
        self, keys: Sequence[str], call: Callable[[Any], list[int]], failed: int
    ) -> list[int]:
        """Run a call that needs the master, answering `failed` at once while it is down."""
        with self._call() as client:
            if not keys:
                return []
            if self._health.down:
                return [failed] * len(keys)
            codes = _answered(call(client))
        if _RPC_FAILED in codes:
            self._health.failed()
        return codes

    def _master_answers(self) -> bool:
        """The master probe's call: whether the master answered one question."""
        with self._call() as client:
            return _RPC_FAILED not in _answered(client.batch_is_exist([PROBE_KEY]))


def split_by_pieces(pieces: Sequence[int], limit: int) -> list[slice]:
    """Consecutive slices of keys, each within `limit` pieces (a bigger key goes alone)."""
    slices: list[slice] = []
    start, used = 0, 0
    for index, count in enumerate(pieces):
        if index > start and used + count > limit:
            slices.append(slice(start, index))
            start, used = index, 0
        used += count
    if start < len(pieces):
        slices.append(slice(start, len(pieces)))
    return slices


def _lists(columns: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(column) for column in columns]


def _answered(codes: list[int]) -> list[int]:
    """Every code meaning no answer (a master that timed out too) as RPC_FAILED."""
    return [_RPC_FAILED if Status.from_code(code) is Status.RPC_FAILED else code for code in codes]
