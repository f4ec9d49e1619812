"""The start-up log line names what runs: hybridkv's four packages, Mooncake's client and
the master."""

from __future__ import annotations

from importlib import metadata

import pytest

from hybridkv.integration import versions
from hybridkv.integration.versions import HYBRIDKV_DISTRIBUTIONS, installed, startup_line


def test_the_line_names_every_package_mooncake_and_the_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(versions, "mooncake_version", lambda: "mooncake-transfer-engine 9.9")
    line = startup_line("10.0.0.7:50051")
    for name in HYBRIDKV_DISTRIBUTIONS:
        assert f"{name} " in line
    assert "mooncake-transfer-engine 9.9" in line
    assert line.endswith("master 10.0.0.7:50051")


def test_installed_versions_come_from_package_metadata() -> None:
    found = installed(["pytest", "no-such-distribution-hybridkv"])
    assert found == {"pytest": metadata.version("pytest")}


def test_a_package_missing_is_named_not_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed", lambda names: {})
    assert "hybridkv-transport not installed" in startup_line("h:1")
