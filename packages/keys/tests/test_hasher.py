from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hybridkv.keys import BlockHasher

TOKENS = st.integers(0, 2**32 - 1)


class _Position:
    """Stands in for `st.data()` in an explicit example: draws a fixed position."""

    def __init__(self, position: int) -> None:
        self.position = position

    def draw(self, _strategy: object) -> int:
        return self.position


_SCALARS = st.integers() | st.text(max_size=4)
EXTRAS = (
    st.none()
    | st.text(max_size=8)
    | st.lists(_SCALARS)
    | st.dictionaries(st.text(max_size=4), _SCALARS | st.lists(_SCALARS, max_size=3), max_size=3)
)


def reference_hashes(
    block_size: int, namespace: str, blocks: Sequence[tuple[Sequence[int], object]]
) -> list[bytes]:
    """The documented chain, block by block, straight from its definition."""
    previous = hashlib.sha256(
        b"hybridkv-block-hash-v1\0" + block_size.to_bytes(8, "little") + namespace.encode()
    ).digest()
    hashes = []
    for tokens, extra in blocks:
        assert len(tokens) == block_size
        salt = b""
        if extra is not None:
            salt = hashlib.sha256(
                json.dumps(extra, sort_keys=True, separators=(",", ":")).encode()
            ).digest()
        encoded = b"".join(token.to_bytes(4, "little") for token in tokens)
        previous = hashlib.sha256(previous + salt + encoded).digest()
        hashes.append(previous)
    return hashes


@st.composite
def split_calls(draw: st.DrawFn) -> tuple[int, list[tuple[list[int], object]]]:
    """A block size and tokens cut into extend calls at arbitrary points, each with an extra."""
    block_size = draw(st.integers(1, 8))
    calls: list[tuple[list[int], object]] = draw(
        st.lists(st.tuples(st.lists(TOKENS, max_size=20), EXTRAS), max_size=8)
    )
    return block_size, calls


@given(split_calls(), st.text(max_size=10))
def test_matches_the_documented_chain(
    case: tuple[int, list[tuple[list[int], object]]], namespace: str
) -> None:
    block_size, calls = case
    hasher = BlockHasher(block_size, namespace)
    returned: list[bytes] = []
    # Each block takes the extra of the call that completes it.
    blocks: list[tuple[Sequence[int], object]] = []
    fed: list[int] = []
    for tokens, extra in calls:
        returned += hasher.extend(tokens, extra=extra)
        fed += tokens
        while len(fed) - len(blocks) * block_size >= block_size:
            start = len(blocks) * block_size
            blocks.append((fed[start : start + block_size], extra))
    assert hasher.hashes == returned == reference_hashes(block_size, namespace, blocks)
    assert hasher.num_tokens == len(fed)


@given(
    st.integers(1, 8),
    st.lists(TOKENS, max_size=60),
    st.data(),
    st.lists(TOKENS, max_size=30),
    st.lists(st.integers(0, 60)),
    EXTRAS,
)
@example(4, list(range(6)), _Position(5), [9, 9, 9], [], None)  # inside the pending block
def test_rewinding_then_feeding_the_new_tokens_hashes_as_a_fresh_hasher(
    block_size: int,
    tokens: list[int],
    data: st.DataObject | _Position,
    replacement: list[int],
    cuts: list[int],
    extra: object,
) -> None:
    # Mostly inside what was fed, where rewinding has something to forget.
    position = data.draw(st.integers(0, len(tokens) + 2))
    hasher = BlockHasher(block_size, "ns")
    edges = [0, *sorted(min(cut, len(tokens)) for cut in cuts), len(tokens)]
    for start, end in itertools.pairwise(edges):  # a partial block may be pending anywhere
        hasher.extend(tokens[start:end], extra=extra)
    changed = tokens[:position] + replacement
    hasher.rewind(position)
    assert hasher.num_tokens <= min(position, len(tokens))
    assert hasher.num_tokens >= min(position, len(tokens)) // block_size * block_size
    hasher.extend(changed[hasher.num_tokens :], extra=extra)
    fresh = BlockHasher(block_size, "ns")
    fresh.extend(changed, extra=extra)
    assert hasher.hashes == fresh.hashes
    assert hasher.num_tokens == fresh.num_tokens == len(changed)
    if len(changed) % block_size:
        partial = len(changed)
        assert hasher.partial_hash(partial, changed, extra) == fresh.partial_hash(
            partial, changed, extra
        )


def test_rewinding_inside_the_pending_block_keeps_the_tokens_before_the_position() -> None:
    hasher = BlockHasher(4, "ns")
    hasher.extend(range(10))  # blocks 0..7, tokens 8 and 9 pending
    hasher.rewind(9)
    assert hasher.num_tokens == 9  # token 8 stays: nothing to feed again
    hasher.extend([99])
    fresh = BlockHasher(4, "ns")
    fresh.extend([*range(9), 99])
    assert hasher.hashes == fresh.hashes
    assert hasher.partial_hash(10, [*range(9), 99]) == fresh.partial_hash(10, [*range(9), 99])


@pytest.mark.parametrize("tokens", [-1, True, 1.0])
def test_rewind_refuses_a_position_that_is_not_a_count(tokens: object) -> None:
    hasher = BlockHasher(4, "ns")
    hasher.extend(range(10))
    with pytest.raises((TypeError, ValueError), match="tokens must"):
        hasher.rewind(tokens)  # type: ignore[arg-type]
    assert hasher.num_tokens == 10
    assert len(hasher.hashes) == 2


@given(st.integers(1, 8), st.lists(TOKENS, max_size=60), st.lists(st.integers(0, 60)), EXTRAS)
def test_call_splitting_does_not_matter_with_request_extras(
    block_size: int, tokens: list[int], cuts: list[int], extra: object
) -> None:
    whole = BlockHasher(block_size, "ns")
    whole.extend(tokens, extra=extra)
    pieces = BlockHasher(block_size, "ns")
    edges = [0, *sorted(min(cut, len(tokens)) for cut in cuts), len(tokens)]
    for start, end in itertools.pairwise(edges):
        pieces.extend(tokens[start:end], extra=extra)
    assert pieces.hashes == whole.hashes
    assert len(whole.hashes) == len(tokens) // block_size


@given(st.integers(1, 8), st.lists(TOKENS, min_size=1, max_size=64), st.data())
def test_a_changed_token_changes_every_later_hash_and_no_earlier_one(
    block_size: int, tokens: list[int], data: st.DataObject
) -> None:
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = data.draw(TOKENS.filter(lambda token: token != tokens[position]))
    before = BlockHasher(block_size, "ns")
    before.extend(tokens)
    after = BlockHasher(block_size, "ns")
    after.extend(changed)
    first_changed = position // block_size
    assert after.hashes[:first_changed] == before.hashes[:first_changed]
    for old, new in zip(before.hashes[first_changed:], after.hashes[first_changed:], strict=True):
        assert old != new


@given(st.integers(1, 8), st.lists(TOKENS, max_size=64), st.lists(TOKENS, max_size=64))
def test_equal_prefixes_give_equal_hashes(
    block_size: int, prefix: list[int], suffix: list[int]
) -> None:
    short = BlockHasher(block_size, "ns")
    short.extend(prefix)
    long = BlockHasher(block_size, "ns")
    long.extend(prefix + suffix)
    full_prefix_blocks = len(prefix) // block_size
    assert long.hashes[:full_prefix_blocks] == short.hashes


def test_extra_changes_the_blocks_of_its_call_and_later_ones_only() -> None:
    plain = BlockHasher(4, "ns")
    plain.extend(range(8))
    plain.extend(range(8, 16))
    salted = BlockHasher(4, "ns")
    salted.extend(range(8))
    salted.extend(range(8, 16), extra={"lora": "a", "salt": None})
    assert salted.hashes[:2] == plain.hashes[:2]
    assert all(a != b for a, b in zip(salted.hashes[2:], plain.hashes[2:], strict=True))
    other = BlockHasher(4, "ns")
    other.extend(range(8))
    other.extend(range(8, 16), extra={"lora": "b", "salt": None})
    assert other.hashes[2:] != salted.hashes[2:]


def test_extra_dict_key_order_does_not_matter() -> None:
    first = BlockHasher(2, "ns")
    first.extend([1, 2], extra={"a": 1, "b": [2, 3]})
    second = BlockHasher(2, "ns")
    second.extend([1, 2], extra={"b": [2, 3], "a": 1})
    assert first.hashes == second.hashes


def test_an_extra_with_a_non_str_dict_key_is_refused_not_merged_with_the_str_key() -> None:
    hasher = BlockHasher(2, "ns")
    hasher.extend([1, 2], extra={"1": "x"})
    with pytest.raises(TypeError, match=r"dict key 1 \(int\) is not a str"):
        hasher.extend([3, 4], extra={1: "x"})
    with pytest.raises(TypeError, match=r"dict key True \(bool\)"):
        hasher.partial_hash(3, [1, 2, 3], extra={True: "x"})
    assert hasher.num_tokens == 2


def test_a_tuple_extra_is_the_same_json_array_as_a_list() -> None:
    as_tuple = BlockHasher(2, "ns")
    as_tuple.extend([1, 2], extra={"mm": ("f1", 2)})
    as_list = BlockHasher(2, "ns")
    as_list.extend([1, 2], extra={"mm": ["f1", 2]})
    assert as_tuple.hashes == as_list.hashes


def test_a_circular_extra_is_refused_as_not_json() -> None:
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(ValueError, match="Circular"):
        BlockHasher(2, "ns").extend([1, 2], extra={"mm": looped})


def test_token_ids_from_a_memoryview_are_read_one_element_per_token() -> None:
    from_view = BlockHasher(2, "ns")
    from_view.extend(memoryview(bytes([1, 2, 3, 4])))
    from_list = BlockHasher(2, "ns")
    from_list.extend([1, 2, 3, 4])
    assert from_view.hashes == from_list.hashes
    assert from_view.num_tokens == 4


@pytest.mark.parametrize(("left", "right"), [((4, "a"), (4, "b")), ((4, ""), (2, ""))])
def test_namespace_and_block_size_separate_the_chains(
    left: tuple[int, str], right: tuple[int, str]
) -> None:
    one = BlockHasher(*left)
    one.extend(range(16))
    two = BlockHasher(*right)
    two.extend(range(16))
    assert not set(one.hashes) & set(two.hashes)


_CHILD = """
import sys
from hybridkv.keys import BlockHasher
hasher = BlockHasher(16, "Qwen3-8B|lora:none")
hasher.extend(range(0, 1000, 3), extra={"salt": "s", "mm": ["f1", 2]})
hasher.extend(range(5000, 5100), extra={"salt": "s", "mm": ["f1", 2]})
print(" ".join(h.hex() for h in hasher.hashes))
"""


def test_hashes_are_equal_across_processes_with_different_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "4242", "random"):
        result = subprocess.run(
            [sys.executable, "-c", _CHILD],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1
    (output,) = outputs
    assert len(output.split()) == (334 + 100) // 16


def test_boundary_hash_and_group_hashes() -> None:
    hasher = BlockHasher(16, "ns")
    hasher.extend(range(16 * 12 + 5))
    hashes = hasher.hashes
    assert len(hashes) == 12
    assert hasher.boundary_hash(16) == hashes[0]
    assert hasher.boundary_hash(16 * 12) == hashes[11]
    assert hasher.hashes_for(16) == hashes
    assert hasher.hashes_for(64) == [hashes[3], hashes[7], hashes[11]]
    assert hasher.hashes_for(16 * 5) == [hashes[4], hashes[9]]
    assert hasher.hashes_for(16 * 13) == []


@pytest.mark.parametrize(
    ("tokens", "error"),
    [(0, ValueError), (8, ValueError), (-16, ValueError), (16 * 13, ValueError), (16.0, TypeError)],
)
def test_boundary_hash_rejects(tokens: object, error: type) -> None:
    hasher = BlockHasher(16, "ns")
    hasher.extend(range(16 * 12))
    with pytest.raises(error, match="tokens"):
        hasher.boundary_hash(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(("size", "error"), [(0, ValueError), (24, ValueError), (True, TypeError)])
def test_hashes_for_rejects(size: object, error: type) -> None:
    with pytest.raises(error, match="group_block_size"):
        BlockHasher(16, "ns").hashes_for(size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("block_size", "namespace", "error"),
    [
        (0, "", ValueError),
        (-1, "", ValueError),
        (1 << 32, "", ValueError),
        (True, "", TypeError),
        (16, b"ns", TypeError),
    ],
)
def test_constructor_rejects(block_size: object, namespace: object, error: type) -> None:
    with pytest.raises(error):
        BlockHasher(block_size, namespace)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "extra", "error", "match"),
    [
        ([1, -1], None, ValueError, "token"),
        ([1, 2**32], None, ValueError, "token"),
        ([1.5], None, TypeError, "float"),
        ([1, 2], object(), TypeError, "extra"),
        ([1, 2], {1, 2}, TypeError, "extra"),
        ([1, 2], {1: "x"}, TypeError, r"extra: dict key 1 \(int\) is not a str"),
        ([1, 2], {"mm": [{None: "x"}]}, TypeError, r"extra\['mm'\]\[0\]: dict key None"),
        (bytes([1, 2, 3, 4]), None, TypeError, "token_ids must be ints, got bytes"),
        (bytearray([1, 2, 3, 4]), None, TypeError, "token_ids must be ints, got bytearray"),
    ],
)
def test_bad_input_is_rejected_and_leaves_the_state_alone(
    tokens: list[object], extra: object, error: type, match: str
) -> None:
    hasher = BlockHasher(2, "ns")
    hasher.extend([7, 8, 9])
    before = (hasher.hashes, hasher.num_tokens)
    with pytest.raises(error, match=match):
        hasher.extend(tokens, extra=extra)  # type: ignore[arg-type]
    assert (hasher.hashes, hasher.num_tokens) == before
    hasher.extend([10])
    reference = BlockHasher(2, "ns")
    reference.extend([7, 8, 9, 10])
    assert hasher.hashes == reference.hashes


def test_hashes_is_a_copy() -> None:
    hasher = BlockHasher(2, "ns")
    hasher.extend([1, 2, 3, 4])
    hasher.hashes.clear()
    assert len(hasher.hashes) == 2
    assert hasher.block_size == 2


def reference_partial_hash(
    block_size: int, namespace: str, token_ids: Sequence[int], tokens: int, extra: object
) -> bytes:
    """The documented partial hash, straight from its definition."""
    full = tokens // block_size
    blocks = [(token_ids[i * block_size : (i + 1) * block_size], extra) for i in range(full)]
    chain = reference_hashes(block_size, namespace, blocks)
    previous = (
        chain[-1]
        if chain
        else hashlib.sha256(
            b"hybridkv-block-hash-v1\0" + block_size.to_bytes(8, "little") + namespace.encode()
        ).digest()
    )
    salt = b""
    if extra is not None:
        salt = hashlib.sha256(
            json.dumps(extra, sort_keys=True, separators=(",", ":")).encode()
        ).digest()
    tail = token_ids[full * block_size : tokens]
    encoded = b"".join(token.to_bytes(4, "little") for token in tail)
    return hashlib.sha256(
        b"hybridkv-partial-hash-v1\0" + previous + len(tail).to_bytes(4, "little") + salt + encoded
    ).digest()


@st.composite
def partial_prefix(draw: st.DrawFn) -> tuple[int, list[int], int, object]:
    """A block size, tokens and a prefix length inside a block."""
    block_size = draw(st.integers(2, 8))
    token_ids = draw(st.lists(TOKENS, min_size=1, max_size=40))
    tokens = draw(
        st.sampled_from([n for n in range(1, len(token_ids) + 1) if n % block_size] or [0])
    )
    return block_size, token_ids, tokens, draw(EXTRAS)


@given(partial_prefix(), st.text(max_size=6), st.integers(0, 40))
def test_partial_hash_matches_its_definition(
    case: tuple[int, list[int], int, object], namespace: str, cut: int
) -> None:
    block_size, token_ids, tokens, extra = case
    if not tokens:
        return  # every prefix is whole blocks
    hasher = BlockHasher(block_size, namespace)
    # Hashed in two calls cut anywhere: the partial hash does not depend on it.
    hasher.extend(token_ids[:cut], extra)
    hasher.extend(token_ids[cut:], extra)
    got = hasher.partial_hash(tokens, token_ids, extra)
    assert got == reference_partial_hash(block_size, namespace, token_ids, tokens, extra)
    assert got not in hasher.hashes


@given(partial_prefix(), st.integers(0, 39), TOKENS)
def test_partial_hash_names_exactly_its_prefix(
    case: tuple[int, list[int], int, object], position: int, replacement: int
) -> None:
    block_size, token_ids, tokens, extra = case
    if not tokens:
        return
    changed = list(token_ids)
    position %= len(changed)
    changed[position] = replacement

    def hashed(ids: list[int]) -> bytes:
        hasher = BlockHasher(block_size, "ns")
        hasher.extend(ids, extra)
        return hasher.partial_hash(tokens, ids, extra)

    # Tokens past the prefix do not matter; a changed token inside it does.
    same = position >= tokens or replacement == token_ids[position]
    assert (hashed(changed) == hashed(token_ids)) == same


def test_partial_hashes_differ_from_block_hashes_and_from_each_other() -> None:
    hasher = BlockHasher(4, "ns")
    token_ids = list(range(12))
    hasher.extend(token_ids)
    partials = [hasher.partial_hash(n, token_ids) for n in range(1, 12) if n % 4]
    assert len(set(partials)) == len(partials) == 9
    assert not set(partials) & set(hasher.hashes)
    # An extra changes it, as it changes block hashes.
    assert hasher.partial_hash(5, token_ids, "lora") != hasher.partial_hash(5, token_ids)


@given(st.integers(1, 8), st.lists(TOKENS, min_size=1, max_size=40), st.data())
def test_partial_hash_refuses_token_ids_that_differ_from_the_tokens_fed_in_its_block(
    block_size: int, fed: list[int], data: st.DataObject
) -> None:
    """Past the last full block the hasher still holds the tokens fed: a tail given
    otherwise there would name a state computed over other tokens."""
    tokens = data.draw(
        st.sampled_from([n for n in range(1, len(fed) + 1) if n % block_size] or [0])
    )
    if not tokens:
        return
    hasher = BlockHasher(block_size, "ns")
    hasher.extend(fed)
    position = data.draw(st.integers(tokens // block_size * block_size, tokens - 1))
    changed = list(fed)
    changed[position] = data.draw(TOKENS.filter(lambda token: token != fed[position]))
    # fed past `tokens` only: in the partial block (the hasher still holds it) or not
    pending = len(fed) // block_size == tokens // block_size
    if pending:
        with pytest.raises(ValueError, match="differ from the tokens fed at those positions"):
            hasher.partial_hash(tokens, changed)
    else:  # that block was hashed whole: its tokens are gone, nothing to compare
        hasher.partial_hash(tokens, changed)
    assert hasher.partial_hash(tokens, fed) == hasher.partial_hash(tokens, [*fed, 1, 2])


@pytest.mark.parametrize(
    ("tokens", "token_count", "error", "match"),
    [
        (8, 12, ValueError, "not a multiple"),
        (0, 12, ValueError, "positive"),
        (-3, 12, ValueError, "positive"),
        (13, 16, ValueError, "3 full blocks hashed, only 2"),
        (7, 6, ValueError, "holds 6 tokens"),
        (5.0, 12, TypeError, "tokens must be an int"),
        (True, 12, TypeError, "tokens must be an int"),
    ],
)
def test_partial_hash_rejects(tokens: object, token_count: int, error: type, match: str) -> None:
    hasher = BlockHasher(4, "ns")
    hasher.extend(range(8))
    with pytest.raises(error, match=match):
        hasher.partial_hash(tokens, list(range(token_count)))  # type: ignore[arg-type]
