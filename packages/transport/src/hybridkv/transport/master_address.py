"""Where a client finds its Mooncake master: one fixed master, or the leader of several.

`master_server_address` is either `host:port` (one `mooncake_master`) or
`etcd://host:port[;host:port...]`, Mooncake's high-availability form: the masters elect a
leader in etcd, and the client reads there which one serves and follows it when it changes.
Either way the client can tell up front whether the first hop answers: the master itself,
or one of the etcd endpoints.
"""

from __future__ import annotations

from hybridkv.transport.master import is_listening, split_address

ETCD_SCHEME = "etcd://"


class FixedMaster:
    """One master at `host:port`."""

    def __init__(self, address: str) -> None:
        self.host, self.port = split_address(address)

    def reachable(self, timeout_s: float) -> bool:
        return is_listening(self.host, self.port, timeout_s)

    def describe(self) -> str:
        return f"Mooncake master {self.host}:{self.port}"


class ElectedMaster:
    """Whichever master leads, as etcd at `endpoints` says (masters run with `--enable_ha`)."""

    def __init__(self, endpoints: str) -> None:
        listed = [item.strip() for item in endpoints.split(";")]
        self.endpoints = [split_address(item) for item in listed if item]
        if not self.endpoints:
            raise ValueError("etcd:// names no etcd endpoint (expected etcd://host:port)")

    def reachable(self, timeout_s: float) -> bool:
        """Whether etcd answers: the leader itself may be changing hands."""
        return any(is_listening(host, port, timeout_s) for host, port in self.endpoints)

    def describe(self) -> str:
        listed = ";".join(f"{host}:{port}" for host, port in self.endpoints)
        return f"etcd {listed} (where the Mooncake masters elect their leader)"


def parse_master_address(address: str) -> FixedMaster | ElectedMaster:
    """The master (or masters) `address` names; ValueError naming what is wrong."""
    if address.startswith(ETCD_SCHEME):
        return ElectedMaster(address.removeprefix(ETCD_SCHEME))
    try:
        return FixedMaster(address)
    except ValueError:
        raise ValueError(
            f"master_server_address must be 'host:port' or 'etcd://host:port[;host:port...]', "
            f"got {address!r}"
        ) from None
