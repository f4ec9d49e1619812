"""Populating new anonymous mappings: found by before/after, mapped without a write."""

from __future__ import annotations

import mmap
import sys

import pytest
from _proc import resident_bytes

from hybridkv.transport.segment_prefault import new_regions, populate, writable_anonymous_regions

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux's /proc and madvise")


def test_a_new_mapping_is_found_and_populated_without_changing_its_bytes() -> None:
    size = 64 << 20
    before = writable_anonymous_regions()
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        found = new_regions(before, at_least=size)  # a fresh mmap may extend a neighbour
        assert len(found) == 1
        [(_, length)] = found
        assert length >= size
        resident = resident_bytes()
        assert populate(found) == length
        assert resident_bytes() - resident >= size * 9 // 10
        assert memory[:16] == bytes(16)
        assert memory[size - 16 :] == bytes(16)
    finally:
        memory.close()


def test_a_region_the_kernel_refuses_is_skipped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="hybridkv.transport.segment_prefault"):
        assert populate({(4096, 4096)}) == 0  # page 1: never mapped
    assert "could not populate 4096 B at 0x1000" in caplog.text
