"""Opening the pool a worker stores into: Mooncake (configured or embedded) or memory.

With `MOONCAKE_CONFIG_PATH` unset, worker rank 0 starts its own `mooncake_master` on
loopback and every rank of the instance joins it: the embedded default needs no setup but
its data dies with the instance. Cross-instance reuse needs a shared master and a
segment holder that outlives the instances (see the README).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridkv.integration.config import ConnectorConfig, mooncake_config_from_env
from hybridkv.integration.lookup import publish_port
from hybridkv.transport import MasterProcess, MemoryStore, MooncakeConfig, MooncakeStore, Store

logger = logging.getLogger(__name__)

_RENDEZVOUS_TIMEOUT_S = 120.0
_memory_store: MemoryStore | None = None
_memory_lock = threading.Lock()


def process_memory_store() -> MemoryStore:
    """One in-memory pool per process, so in-process test instances share it."""
    global _memory_store
    with _memory_lock:
        if _memory_store is None:
            _memory_store = MemoryStore()
        return _memory_store


def master_rendezvous(instance: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)
    return Path(tempfile.gettempdir()) / f"hybridkv-master-{safe}.port"


@dataclass
class Pool:
    """The opened store, plus what must be stopped with it."""

    store: Store
    master: MasterProcess | None = None
    files: list[Path] = field(default_factory=list)
    # Pieces are cheap over RDMA (they cost ~30-40 us each over TCP): see `granularity_for`.
    rdma: bool = False

    def close(self) -> None:
        if not isinstance(self.store, MemoryStore):
            self.store.close()
        if self.master is not None:
            self.master.stop()
        for path in self.files:
            path.unlink(missing_ok=True)


def _wait_for_master(path: Path) -> str:
    deadline = time.monotonic() + _RENDEZVOUS_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return f"127.0.0.1:{int(path.read_text())}"
        except (FileNotFoundError, ValueError):
            time.sleep(0.1)
    raise TimeoutError(f"rank 0 did not publish its embedded Mooncake master in {path}")


def open_pool(config: ConnectorConfig, instance: str, tp_rank: int) -> Pool:
    """The store this worker uses, started as the configuration asks."""
    if config.store == "memory":
        return Pool(process_memory_store())
    mooncake = mooncake_config_from_env()
    if mooncake is not None:
        return Pool(MooncakeStore.connect(mooncake), rdma=mooncake.protocol == "rdma")
    path = master_rendezvous(instance)
    if tp_rank != 0:
        address = _wait_for_master(path)
        return Pool(MooncakeStore.connect(MooncakeConfig(master_server_address=address)))
    master = MasterProcess.start()
    logger.warning(
        "hybridkv: MOONCAKE_CONFIG_PATH is unset; started an embedded mooncake_master at %s. "
        "Its KV dies with this instance: share a master and a segment holder for reuse "
        "across instances.",
        master.address,
    )
    try:
        store = MooncakeStore.connect(MooncakeConfig(master_server_address=master.address))
    except Exception:
        master.stop()
        raise
    publish_port(path, master.rpc_port)
    return Pool(store, master, [path])
