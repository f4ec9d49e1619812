from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from keys_strategies import block_sizes, counters, layouts, models

from hybridkv.keys import BlockKey, HybridKey, KeyFormatError, KeyRenderer, parse_key

HASHES = st.lists(st.binary(min_size=1, max_size=32), max_size=6)
HEADS = st.lists(counters, max_size=4)


@given(models, layouts, counters, block_sizes, st.none() | counters, HASHES, HEADS)
def test_hybrid_bulk_rendering_equals_the_keys(
    model: str,
    layout: str,
    group: int,
    block_size: int,
    pp_rank: int | None,
    hashes: list[bytes],
    heads: list[int],
) -> None:
    renderer = KeyRenderer.hybrid(model, layout, group, block_size, pp_rank)
    expected = [
        HybridKey(model, layout, group, block_size, block_hash.hex(), head, pp_rank)
        for block_hash in hashes
        for head in heads
    ]
    rendered = renderer.render_all(hashes, heads)
    assert rendered == [str(key) for key in expected]
    assert [parse_key(text) for text in rendered] == expected


@given(models, HASHES, HEADS)
def test_single_group_bulk_rendering_equals_the_keys(
    model: str, hashes: list[bytes], heads: list[int]
) -> None:
    renderer = KeyRenderer.single_group(model)
    expected = [str(BlockKey(model, h.hex(), head)) for h in hashes for head in heads]
    assert renderer.render_all(hashes, heads) == expected
    if hashes and heads:
        assert renderer.render(hashes[-1], heads[-1]) == expected[-1]


def test_bulk_rendering_reads_iterators_and_generators_once() -> None:
    renderer = KeyRenderer.single_group("m")
    expected = ["m@01@0", "m@01@1", "m@02@0", "m@02@1"]
    assert renderer.render_all([b"\x01", b"\x02"], iter([0, 1])) == expected
    assert renderer.render_all((h for h in [b"\x01", b"\x02"]), range(2)) == expected


def test_prefix() -> None:
    renderer = KeyRenderer.hybrid("m", "abc", 2, 64, pp_rank=1)
    assert renderer.prefix == "m@mooncake_hybrid_v1:abc@pp_rank:1@group:2@block:64@"


@pytest.mark.parametrize(
    ("hashes", "heads", "error", "match"),
    [
        ([b"\x01"], [-1], KeyFormatError, "head"),
        ([b"\x01"], [True], TypeError, "head"),
        ([b"\x01", b""], [0], KeyFormatError, "block_hash"),
        (["01"], [0], TypeError, "bytes"),
        ([bytearray(b"\x01")], [0], TypeError, "bytes"),
    ],
)
def test_bulk_rendering_rejects(
    hashes: list[object], heads: list[object], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        KeyRenderer.single_group("m").render_all(hashes, heads)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        (("", "abc", 0, 16), "model"),
        (("m", "a-b", 0, 16), "layout"),
        (("m", "abc", -1, 16), "group"),
        (("m", "abc", 0, 0), "block_size"),
    ],
)
def test_renderer_validates_its_prefix(arguments: tuple[str, str, int, int], field: str) -> None:
    with pytest.raises(KeyFormatError) as caught:
        KeyRenderer.hybrid(*arguments)
    assert caught.value.field == field
    with pytest.raises(KeyFormatError, match="pp_rank"):
        KeyRenderer.hybrid("m", "abc", 0, 16, pp_rank=-1)
