"""Lookups by block hashes over the lookup socket: the server renders the keys with its
key space, answers per hash, and refuses what its caps or its plan do not allow."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from conftest import attention, groups
from test_lookup import _raw_request

from hybridkv.integration.block_query import RenderingQuery, render
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.lookup import MAX_REQUEST_KEYS, LookupClient, LookupServer, wire


def _key_space(vllm_specs: Any, stages: Sequence[tuple[int, int]] = ()) -> KeySpace:
    """Two full-attention groups, two storing heads each (TP 2)."""
    kinds = [(["a"], attention(vllm_specs, heads=2)), (["b"], attention(vllm_specs, heads=2))]
    plan = plan_groups(groups(vllm_specs, *kinds), [0, 1], ModelShape(2, 2), pp_stages=stages)
    return KeySpace(plan, "tiny")


def _hashes(count: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(count)]


class Store:
    """Readability from a set of keys; counts the keys it was asked."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.keys = set(keys)
        self.asked: list[int] = []

    def __call__(self, keys: Sequence[str]) -> list[bool]:
        self.asked.append(len(keys))
        return [key in self.keys for key in keys]


def test_a_lookup_by_hashes_answers_as_the_keys_rendered_here_do(vllm_specs: Any) -> None:
    keys = _key_space(vllm_specs, [(0, 1), (1, 2)])
    held, missing = _hashes(6), _hashes(3, "x")
    # Every head and stage of the held blocks, but block 4 lacks head 1 in group 1.
    stored = set(render(keys, [(0, held, [0, 1]), (1, held[:4] + held[5:], [0, 1])]))
    stored |= set(render(keys, [(1, held[4:5], [0])]))
    store = Store(stored)
    batches = [(0, held + missing, [0, 1]), (1, held, [0, 1]), (1, held[4:5], [0])]
    server = LookupServer(store, keys=keys)
    client = LookupClient(server.address, timeout_ms=5000)
    try:
        answers = client.query_blocks(batches)
    finally:
        client.close()
        server.close()
    here = RenderingQuery(keys, Store(stored))(batches)
    assert answers == here
    assert answers == [True] * 6 + [False] * 3 + [True] * 4 + [False, True] + [True]
    assert store.asked == [(9 + 6) * 4 + 1 * 2]  # hash x head x stage keys, rendered there


def test_a_long_lookup_by_hashes_goes_out_in_parts_within_the_key_cap(vllm_specs: Any) -> None:
    keys = _key_space(vllm_specs)
    hashes = _hashes(MAX_REQUEST_KEYS // 2 + 7)  # two heads: one request's pairs, and 14
    store = Store(render(keys, [(0, hashes[::2], [0, 1])]))
    server = LookupServer(store, keys=keys)
    client = LookupClient(server.address, timeout_ms=10_000)
    try:
        answers = client.query_blocks([(0, hashes, [0, 1]), (1, hashes[:3], [0])])
    finally:
        client.close()
        server.close()
    assert answers == [i % 2 == 0 for i in range(len(hashes))] + [False] * 3
    assert store.asked == [MAX_REQUEST_KEYS, 14 + 3]


def test_hashes_cost_a_fraction_of_the_keys_bytes(vllm_specs: Any) -> None:
    keys = _key_space(vllm_specs)
    batches = [(group, _hashes(4096), [0, 1]) for group in (0, 1)]
    by_keys = sum(len(payload) for _, payload in wire.lookup_payloads(render(keys, batches)))
    by_hashes = sum(len(payload) for _, payload in wire.blocks_payloads(batches))
    assert by_hashes * 5 < by_keys


@pytest.mark.parametrize(
    ("batch", "error"),
    [
        ([2, [0], [b"h" * 32]], "group 2 is not one of the plan's 2 groups"),
        ([0, [0, 2], [b"h" * 32]], "heads [2] of group 0: it stores heads 0..1"),
        ([0, [0], [b"h" * 31]], "Expected `bytes` of length >= 32"),
        ([0, [-1], [b"h" * 32]], "Expected `int` >= 0"),
    ],
)
def test_a_request_naming_what_the_plan_has_not_is_refused_naming_it(
    vllm_specs: Any, batch: list[Any], error: str
) -> None:
    store = Store()
    server = LookupServer(store, keys=_key_space(vllm_specs))
    try:
        payload = msgspec.msgpack.encode({"type": "blocks", "batches": [batch]})
        reply = wire.decode_reply(_raw_request(server.address, payload) or b"")
    finally:
        server.close()
    assert reply.readable is None
    assert reply.error is not None
    assert "malformed lookup request" in reply.error
    assert error in reply.error
    assert store.asked == []


def test_a_request_over_the_pair_cap_is_refused_before_any_key_is_rendered(
    vllm_specs: Any,
) -> None:
    """Under the hash cap of one batch, but over the cap of (hash, head) pairs asked."""
    store = Store()
    server = LookupServer(store, keys=_key_space(vllm_specs))
    hashes = [b"h" * 32] * (MAX_REQUEST_KEYS // 2 + 1)
    try:
        payload = msgspec.msgpack.encode({"type": "blocks", "batches": [[0, [0, 1], hashes]]})
        reply = wire.decode_reply(_raw_request(server.address, payload, timeout_ms=5000) or b"")
        no_keys = LookupServer(store)
        try:
            refused = wire.decode_reply(_raw_request(no_keys.address, payload) or b"")
        finally:
            no_keys.close()
    finally:
        server.close()
    assert reply.error is not None
    assert f"{MAX_REQUEST_KEYS + 2} (hash, head) pairs, over the {MAX_REQUEST_KEYS}" in reply.error
    assert refused.error == "this lookup server renders no keys: ask by keys"
    assert store.asked == []
