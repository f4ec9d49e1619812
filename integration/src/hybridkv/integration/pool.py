"""Opening the pool a worker stores into: Mooncake (configured or embedded) or memory.

With `MOONCAKE_CONFIG_PATH` unset, worker rank 0 starts its own `mooncake_master` on
loopback and tells the other ranks its address over the tensor-parallel group (no file
to leave behind if the instance is killed); every rank on its host joins it, and a rank
on another host (which loopback cannot reach) refuses to start, saying so. The embedded default
needs no setup but its data dies with the instance. Cross-instance reuse needs a shared
master and a segment holder that outlives the instances (see the README).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from hybridkv.integration.config import ConnectorConfig, mooncake_config_from_env
from hybridkv.integration.versions import startup_line
from hybridkv.transport import MasterProcess, MemoryStore, MooncakeConfig, MooncakeStore, Store
from hybridkv.transport.integrity import IntegrityKey, TaggedStore

logger = logging.getLogger(__name__)

_memory_store: MemoryStore | None = None
_memory_lock = threading.Lock()


def process_memory_store() -> MemoryStore:
    """One in-memory pool per process, so in-process test instances share it."""
    global _memory_store
    with _memory_lock:
        if _memory_store is None:
            _memory_store = MemoryStore()
        return _memory_store


class EmbeddedMaster(NamedTuple):
    """Where rank 0's embedded master listens: loopback of `host`."""

    host: str
    address: str


class SharedMaster(NamedTuple):
    """The master rank 0 was configured with (`MOONCAKE_CONFIG_PATH`)."""

    address: str


# Rank 0 sends what it has to every rank and returns it; the others return what it sent.
# All ranks call it once, together (vLLM's tensor-parallel group broadcast).
Broadcast = Callable[[EmbeddedMaster | SharedMaster | None], EmbeddedMaster | SharedMaster | None]


@dataclass
class Pool:
    """The opened store, plus what must be stopped with it."""

    store: Store
    master: MasterProcess | None = None
    master_address: str = ""  # "" for the memory store
    # The process's memory store, which in-process instances share: never closed.
    shared: bool = False
    # Pieces are cheap over RDMA (they cost ~30-40 us each over TCP): see
    # `transfer_mode.granularity`.
    rdma: bool = False

    def close(self, store_idle: bool = True) -> None:
        """`store_idle=False`: a call of ours may still run in the store, which is then
        left open to the process's exit (closing it under a call crashes Mooncake)."""
        try:
            if store_idle and not self.shared:
                self.store.close()
        finally:
            if self.master is not None:
                self.master.stop()


def _refuse_stages(pp_size: int, store: str) -> None:
    if pp_size > 1:
        raise RuntimeError(
            f"hybridkv: {store} serves one pipeline stage only; with {pp_size} stages set "
            "MOONCAKE_CONFIG_PATH to a master every stage reaches"
        )


def open_pool(
    config: ConnectorConfig, tp_rank: int, broadcast: Broadcast, pp_size: int = 1
) -> Pool:
    """The store this worker uses, its objects tagged where `integrity_secret_env` asks it;
    TP rank 0 logs the versions that run and the master it uses."""
    pool = _open_store_pool(config, tp_rank, broadcast, pp_size)
    if config.integrity_secret_env:
        try:
            pool.store = TaggedStore(pool.store, IntegrityKey.from_env(config.integrity_secret_env))
        except BaseException:
            pool.close()
            raise
    if tp_rank == 0:
        logger.info(startup_line(pool.master_address or "none (memory store)"))
    return pool


def _open_store_pool(
    config: ConnectorConfig, tp_rank: int, broadcast: Broadcast, pp_size: int
) -> Pool:
    """The store this worker uses, started as the configuration asks.

    Every rank meets the others in `broadcast` once: rank 0 sends the master it uses,
    configured or embedded (None when it could not start one, so that the others fail
    instead of waiting), and a rank whose environment names another refuses to start
    (an executor may not pass `MOONCAKE_CONFIG_PATH` to every worker). Pipeline stages
    must share one pool: each would start a master of its own.
    """
    if config.store == "memory":
        _refuse_stages(pp_size, "the memory store")
        return Pool(process_memory_store(), shared=True)
    mooncake = mooncake_config_from_env()
    if mooncake is None:
        _refuse_stages(pp_size, "an embedded master")
    mine = None if mooncake is None else SharedMaster(mooncake.master_server_address)
    chosen = None
    if tp_rank == 0:
        if mine is not None:
            broadcast(mine)
    else:
        chosen = broadcast(None)
        theirs = chosen if isinstance(chosen, SharedMaster) else None
        if theirs != mine:
            raise RuntimeError(
                f"hybridkv: TP rank 0 uses {theirs.address if theirs else 'an embedded master'}"
                f" but TP rank {tp_rank} is configured with {mine.address if mine else 'none'}"
                " (MOONCAKE_CONFIG_PATH): every worker must see the same file"
            )
    if mooncake is not None:
        return Pool(
            MooncakeStore.connect(mooncake),
            master_address=mooncake.master_server_address,
            rdma=mooncake.protocol == "rdma",
        )
    if tp_rank != 0:
        embedded = chosen
        if not isinstance(embedded, EmbeddedMaster):
            raise RuntimeError(
                "hybridkv: worker rank 0 could not start the embedded mooncake_master "
                "(see its log); set MOONCAKE_CONFIG_PATH to use a shared master"
            )
        host = socket.gethostname()
        if embedded.host != host:
            raise RuntimeError(
                "hybridkv: the embedded mooncake_master listens on the loopback of "
                f"{embedded.host}, which TP rank {tp_rank} on {host} cannot reach; with ranks "
                "on several hosts set MOONCAKE_CONFIG_PATH to a master every host reaches"
            )
        joined = MooncakeConfig(master_server_address=embedded.address)
        return Pool(MooncakeStore.connect(joined), master_address=embedded.address)
    try:
        master = MasterProcess.start()
    except BaseException:
        broadcast(None)
        raise
    logger.warning(
        "hybridkv: MOONCAKE_CONFIG_PATH is unset; started an embedded mooncake_master at %s. "
        "Its KV dies with this instance: share a master and a segment holder for reuse "
        "across instances.",
        master.address,
    )
    try:
        store = MooncakeStore.connect(MooncakeConfig(master_server_address=master.address))
    except BaseException:
        master.stop()
        broadcast(None)
        raise
    broadcast(EmbeddedMaster(socket.gethostname(), master.address))
    return Pool(store, master, master.address)
