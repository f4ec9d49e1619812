"""What is installed, from package metadata (nothing imported): for the start-up log line
and `hybridkv doctor`, so a report names the versions that ran."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata

from hybridkv.transport.mooncake_client import mooncake_version

HYBRIDKV_DISTRIBUTIONS = (
    "hybridkv-keys",
    "hybridkv-coordinator",
    "hybridkv-transport",
    "hybridkv-integration",
)


def installed(distributions: Iterable[str]) -> dict[str, str]:
    """Version of each distribution installed; absent ones left out."""
    found = {}
    for name in distributions:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def startup_line(master: str) -> str:
    """hybridkv's four packages, Mooncake's client and the master the pool uses."""
    ours = installed(HYBRIDKV_DISTRIBUTIONS)
    packages = ", ".join(
        f"{name} {ours.get(name, 'not installed')}" for name in HYBRIDKV_DISTRIBUTIONS
    )
    return f"hybridkv: {packages}; {mooncake_version()}; master {master}"
