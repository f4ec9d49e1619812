from __future__ import annotations

import itertools
import pickle
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from keys_strategies import block_keys, hybrid_keys, keys

from hybridkv.keys import BlockKey, HybridKey, KeyFormatError, model_name, parse_key

LAYOUT = "3f9a" * 16
HYBRID = f"Qwen3-Next@mooncake_hybrid_v1:{LAYOUT}@group:1@block:64@0aff@3"
HYBRID_PP = f"Qwen3-Next@mooncake_hybrid_v1:{LAYOUT}@pp_rank:2@group:1@block:64@0aff@3"


def test_single_group_format() -> None:
    key = BlockKey("Qwen3-8B", "00ff", 7)
    assert str(key) == "Qwen3-8B@00ff@7"
    assert parse_key("Qwen3-8B@00ff@7") == key


def test_hybrid_format_without_pp_rank() -> None:
    key = HybridKey("Qwen3-Next", LAYOUT, 1, 64, "0aff", 3)
    assert key.pp_rank is None
    assert str(key) == HYBRID
    assert parse_key(HYBRID) == key


def test_hybrid_format_with_pp_rank() -> None:
    key = HybridKey("Qwen3-Next", LAYOUT, 1, 64, "0aff", 3, pp_rank=2)
    assert str(key) == HYBRID_PP
    assert parse_key(HYBRID_PP) == key
    assert key != HybridKey("Qwen3-Next", LAYOUT, 1, 64, "0aff", 3)


def test_prefix_is_everything_before_the_hash() -> None:
    key = parse_key(HYBRID_PP)
    assert str(key) == f"{key.prefix}0aff@3"
    assert BlockKey("m", "00", 1).prefix == "m@"


@given(keys)
def test_round_trip(key: BlockKey | HybridKey) -> None:
    text = str(key)
    parsed = parse_key(text)
    assert parsed == key
    assert type(parsed) is type(key)
    assert str(parsed) == text


@given(keys, st.data())
def test_only_canonical_spellings_parse(key: BlockKey | HybridKey, data: st.DataObject) -> None:
    """Any edit of a valid key either fails to parse or is exactly another valid key."""
    text = str(key)
    position = data.draw(st.integers(0, len(text) - 1))
    replacement = data.draw(st.sampled_from("@:/-+ 0179afAF_xkpl\n") | st.characters())
    mutated = text[:position] + replacement + text[position + 1 :]
    try:
        parsed = parse_key(mutated)
    except KeyFormatError:
        return
    assert str(parsed) == mutated


@given(st.text(max_size=80))
def test_arbitrary_text_parses_only_to_itself(text: str) -> None:
    try:
        parsed = parse_key(text)
    except KeyFormatError:
        return
    assert str(parsed) == text


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("", "key"),
        ("m@00", "key"),
        ("m@00@1@2", "key"),
        ("@00@1", "model"),
        ("m@@1", "block_hash"),
        ("m@0g@1", "block_hash"),
        ("m@0A@1", "block_hash"),
        ("m@00@", "head"),
        ("m@00@-1", "head"),
        ("m@00@+1", "head"),
        ("m@00@01", "head"),
        ("m@00@ 1", "head"),
        ("m@00@1.0", "head"),
        ("m@00@\u0661", "head"),
        ("m@00@9223372036854775808", "head"),
        ("m@00@99999999999999999999", "head"),
        (HYBRID.replace("Qwen3-Next", "", 1), "model"),
        (HYBRID.replace("Qwen3-Next", "Qwen/Qwen3-Next", 1), "model"),
        (HYBRID.replace(LAYOUT, "", 1), "layout"),
        (HYBRID.replace(LAYOUT, "3f9a-1", 1), "layout"),
        (HYBRID.replace("mooncake_hybrid_v1", "mooncake_hybrid_v2", 1), "version"),
        (HYBRID_PP.replace("pp_rank:2", "pp_rank:x", 1), "pp_rank"),
        (HYBRID_PP.replace("pp_rank:2", "pp_rank:-1", 1), "pp_rank"),
        (HYBRID_PP.replace("pp_rank:2", "pp_rank2", 1), "pp_rank"),
        (HYBRID_PP.replace("pp_rank:2", "pp_rank:", 1), "pp_rank"),
        (HYBRID.replace("group:1", "grp:1", 1), "group"),
        (HYBRID.replace("group:1", "group:", 1), "group"),
        (HYBRID.replace("group:1", "group:01", 1), "group"),
        (HYBRID.replace("block:64", "blk:64", 1), "block_size"),
        (HYBRID.replace("block:64", "block:0", 1), "block_size"),
        (HYBRID.replace("block:64", "block:6x4", 1), "block_size"),
        (HYBRID.replace("0aff", "0AFF", 1), "block_hash"),
        (HYBRID.replace("@0aff@", "@@", 1), "block_hash"),
        (HYBRID.replace("@3", "@three", 1), "head"),
        (HYBRID.rpartition("@")[0], "key"),
        (HYBRID_PP.rpartition("@")[0], "key"),
        (HYBRID + "@4", "key"),
        (HYBRID_PP.replace("@group:1", "", 1), "key"),
    ],
)
def test_malformed_text_names_the_field(text: str, field: str) -> None:
    with pytest.raises(KeyFormatError) as caught:
        parse_key(text)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


GOOD_HYBRID: dict[str, Any] = {
    "model": "m",
    "layout": "abc",
    "group": 0,
    "block_size": 16,
    "block_hash": "00",
    "head": 0,
    "pp_rank": None,
}


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("model", "", KeyFormatError),
        ("model", "a@b", KeyFormatError),
        ("model", "org/name", KeyFormatError),
        ("model", "a\nb", KeyFormatError),
        ("model", b"m", TypeError),
        ("layout", "", KeyFormatError),
        ("layout", "ab:c", KeyFormatError),
        ("layout", "ab\u00e9", KeyFormatError),
        ("layout", 1, TypeError),
        ("group", -1, KeyFormatError),
        ("group", 2**63, KeyFormatError),
        ("group", "1", TypeError),
        ("group", True, TypeError),
        ("block_size", 0, KeyFormatError),
        ("block_size", 16.0, TypeError),
        ("block_hash", "", KeyFormatError),
        ("block_hash", "ABCD", KeyFormatError),
        ("block_hash", "0x12", KeyFormatError),
        ("block_hash", b"\x00", TypeError),
        ("head", -1, KeyFormatError),
        ("head", None, TypeError),
        ("pp_rank", -1, KeyFormatError),
        ("pp_rank", "0", TypeError),
    ],
)
def test_constructor_rejects_each_bad_field(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=field):
        HybridKey(**{**GOOD_HYBRID, field: value})
    if field in ("model", "block_hash", "head"):
        single: dict[str, Any] = {"model": "m", "block_hash": "00", "head": 0, field: value}
        with pytest.raises(error, match=field):
            BlockKey(**single)


def test_keys_are_immutable_and_hashable() -> None:
    key = parse_key(HYBRID)
    with pytest.raises(AttributeError):
        key.head = 4  # type: ignore[misc]
    assert len({key, parse_key(HYBRID), parse_key(HYBRID_PP)}) == 2


@given(st.lists(hybrid_keys, max_size=8), st.lists(block_keys, max_size=8))
def test_ordering_is_total_within_a_type(hybrids: list[HybridKey], singles: list[BlockKey]) -> None:
    for group in (hybrids, singles):
        ordered = sorted(group)
        for smaller, larger in itertools.pairwise(ordered):
            assert smaller <= larger
            assert not larger < smaller
            assert (smaller < larger) == (smaller != larger)


def test_keys_sort_by_their_fields_in_rendering_order() -> None:
    """The pipeline stage is rendered before the group, so it sorts first."""
    first_stage = HybridKey("m", LAYOUT, 1, 64, "0aff", 3, pp_rank=0)
    second_stage = HybridKey("m", LAYOUT, 0, 64, "0aff", 3, pp_rank=1)
    assert str(first_stage) < str(second_stage)
    assert first_stage < second_stage


def test_absent_pp_rank_sorts_first() -> None:
    assert parse_key(HYBRID) < parse_key(HYBRID_PP)
    assert parse_key(HYBRID_PP) > parse_key(HYBRID)


def test_key_types_do_not_compare_with_each_other() -> None:
    with pytest.raises(TypeError):
        _ = parse_key(HYBRID) < BlockKey("m", "00", 0)
    assert parse_key(HYBRID) != BlockKey("Qwen3-Next", "0aff", 3)


def test_decoding_a_wire_message_validates() -> None:
    good = msgspec.json.decode(msgspec.json.encode(parse_key(HYBRID_PP)), type=HybridKey)
    assert good == parse_key(HYBRID_PP)
    with pytest.raises(msgspec.ValidationError, match="block_hash"):
        msgspec.json.decode(b'{"model":"m","block_hash":"XY","head":0}', type=BlockKey)


def test_key_format_error_is_a_value_error_that_pickles() -> None:
    with pytest.raises(ValueError, match="head") as caught:
        parse_key("m@00@x")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(copy, KeyFormatError)
    assert (copy.field, str(copy)) == ("head", str(caught.value))


@pytest.mark.parametrize(
    ("given_name", "expected"),
    [
        ("Qwen/Qwen3-8B", "Qwen3-8B"),
        ("/models/gemma-2-9b-it/", "gemma-2-9b-it"),
        ("/models/gemma-2-9b-it///", "gemma-2-9b-it"),
        ("gemma", "gemma"),
        ("odd@dir/model", "model"),
        ("my model", "my model"),
        ("/models/Qwen3-8B/.", "Qwen3-8B"),
        ("/models/Qwen3-8B/./", "Qwen3-8B"),
        ("/runs/a/checkpoint-500/../final", "final"),
    ],
)
def test_model_name_keeps_the_last_path_component(given_name: str, expected: str) -> None:
    assert model_name(given_name) == expected


@pytest.mark.parametrize(
    "bad", ["", "/", "///", "org/a@b", "a@b", "org/a\tb", ".", "./", "..", "a/.."]
)
def test_model_name_rejects(bad: str) -> None:
    with pytest.raises(KeyFormatError) as caught:
        model_name(bad)
    assert caught.value.field == "model"


def test_model_name_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="model"):
        model_name(None)  # type: ignore[arg-type]
