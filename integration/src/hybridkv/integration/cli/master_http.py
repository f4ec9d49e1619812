"""The Mooncake master's HTTP admin endpoint: which keys, how big, which segments.

The master serves these on its metrics port (`--metrics_port`, 9003 unless set); its RPC
port answers only clients. Reading the pool this way needs no Mooncake client (no
segment, no registered memory), so listing works from any host that reaches the port.
The CLI, the demo and the end-to-end tests all read the pool through this one class.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

DEFAULT_METRICS_PORT = 9003  # mooncake_master's --metrics_port default
TIMEOUT_S = 5.0
# Keys per /batch_query_keys request: keeps each URL well below servers' line limits.
_QUERY_BATCH = 64


class MasterUnreachableError(ConnectionError):
    """The admin endpoint did not answer (refused, timed out, or not a Mooncake master)."""


class SegmentUse(msgspec.Struct, frozen=True):
    """One segment lent to the pool (a holder's or an instance's memory)."""

    name: str
    capacity_bytes: int
    used_bytes: int
    status: str


class MasterHttp:
    """Reads one master's admin endpoint at `address` ("host:port" of its metrics port)."""

    def __init__(self, address: str, timeout_s: float = TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def _get(self, path: str) -> str:
        url = f"http://{self.address}/{path}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
                text: str = reply.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise MasterUnreachableError(
                f"Mooncake master admin endpoint {self.address} did not answer /"
                f"{path.partition('?')[0]}: {reason}"
            ) from exc
        return text

    def _json(self, path: str) -> Any:
        text = self._get(path)
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise MasterUnreachableError(
                f"{self.address} answered /{path.partition('?')[0]} with no JSON: is it a "
                f"Mooncake master's metrics port? ({text[:80]!r})"
            ) from exc

    def health(self) -> dict[str, Any]:
        """The master's own account: role, HA state, whether it serves."""
        answer = self._json("health")
        if not isinstance(answer, dict):
            raise MasterUnreachableError(f"{self.address}/health answered {answer!r}")
        return answer

    def list_keys(self) -> list[str]:
        """Every key the master knows, sorted."""
        return sorted(line for line in self._get("get_all_keys").splitlines() if line)

    def segments(self) -> list[SegmentUse]:
        """Every mounted segment with its capacity and the bytes allocated in it."""
        answer = self._json("get_segments_detail")
        return [
            SegmentUse(
                name=str(segment["segment_name"]),
                capacity_bytes=int(segment["allocator_capacity_bytes"]),
                used_bytes=int(segment["allocator_used_bytes"]),
                status=str(segment.get("status", "")),
            )
            for segment in answer.get("segments", [])
        ]

    def object_size(self, key: str) -> int:
        """Size of one stored object; LookupError if the master does not know it."""
        sizes = self.object_sizes([key])
        if key not in sizes:
            raise LookupError(f"master does not know {key!r}")
        return sizes[key]

    def object_sizes(self, keys: Iterable[str]) -> dict[str, int]:
        """Sizes of the objects among `keys` that the master knows (gone ones are left out).

        An object's size is its replicas' (they are copies); keys holding a comma, the
        batch query's separator, are asked one by one.
        """
        keys = list(keys)
        sizes: dict[str, int] = {}
        batchable = [key for key in keys if "," not in key]
        for start in range(0, len(batchable), _QUERY_BATCH):
            part = batchable[start : start + _QUERY_BATCH]
            query = urllib.parse.quote(",".join(part), safe="@:~")
            answer = self._json(f"batch_query_keys?keys={query}")
            for key, entry in (answer.get("data") or {}).items():
                size = _replica_size(entry.get("values") if entry.get("ok") else None)
                if size is not None:
                    sizes[key] = size
        for key in keys:
            if "," in key:
                answer = self._json(f"query_key?key={urllib.parse.quote(key, safe='@:~')}")
                size = _replica_size(answer.get("data") if answer.get("success") else None)
                if size is not None:
                    sizes[key] = size
        return sizes


def _replica_size(replicas: Sequence[dict[str, Any]] | None) -> int | None:
    if not replicas:
        return None
    return max(int(replica["size_"]) for replica in replicas)


def default_address(master_server_address: str) -> str:
    """The admin endpoint of a master started with the default metrics port."""
    host = master_server_address.rpartition(":")[0]
    return f"{host}:{DEFAULT_METRICS_PORT}"
