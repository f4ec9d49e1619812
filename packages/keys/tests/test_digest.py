from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.keys import HybridKey, layout_digest, scope_digest, topology_digest

SIGNATURE_A = {"kind": "full", "page_bytes": 65536, "dtype": "bfloat16"}
SIGNATURE_B = {"kind": "mamba", "page_bytes": [4096, 1024]}
GROUPS = [(["layers.0.attn", "layers.3.attn"], SIGNATURE_A), (["layers.1.mixer"], SIGNATURE_B)]


def test_digest_is_the_interoperable_definition() -> None:
    payload = (
        2,
        [(["layers.0.attn", "layers.3.attn"], SIGNATURE_A), (["layers.1.mixer"], SIGNATURE_B)],
    )
    expected = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    assert layout_digest(2, GROUPS) == expected
    namespaced = hashlib.sha256(json.dumps(("ns", *payload), sort_keys=True).encode()).hexdigest()
    assert layout_digest(2, GROUPS, namespace="ns") == namespaced


def test_pipeline_stages_follow_the_tp_size_in_the_payload() -> None:
    payload = (2, [[0, 3], [3, 4]], [(["layers.0.attn"], SIGNATURE_A)])
    expected = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    stages = [(0, 3), (3, 4)]
    assert layout_digest(2, [(["layers.0.attn"], SIGNATURE_A)], pp_stages=stages) == expected
    assert layout_digest(2, GROUPS, pp_stages=()) == layout_digest(2, GROUPS)
    partitions = ([], [(0, 2), (2, 4)], [(0, 1), (1, 4)], [(0, 1), (1, 2), (2, 4)])
    assert len({layout_digest(2, GROUPS, pp_stages=stages) for stages in partitions}) == 4


def test_digest_is_a_layout_token() -> None:
    digest = layout_digest(1, GROUPS)
    assert len(digest) == 64
    HybridKey("m", digest, 0, 16, "00", 0)


NAMES = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True)


@given(NAMES, st.randoms())
def test_layer_order_within_a_group_does_not_matter(names: list[str], random: object) -> None:
    shuffled = list(names)
    random.shuffle(shuffled)  # type: ignore[attr-defined]
    assert layout_digest(2, [(names, SIGNATURE_A)]) == layout_digest(2, [(shuffled, SIGNATURE_A)])
    assert layout_digest(2, [(tuple(names), SIGNATURE_A)]) == layout_digest(
        2, [(set(names), SIGNATURE_A)]
    )


def test_signature_dict_order_does_not_matter() -> None:
    reordered = dict(reversed(list(SIGNATURE_A.items())))
    assert layout_digest(1, [(["a"], SIGNATURE_A)]) == layout_digest(1, [(["a"], reordered)])


@pytest.mark.parametrize(
    ("tp_size", "groups", "namespace"),
    [
        (4, GROUPS, None),  # TP size
        (2, list(reversed(GROUPS)), None),  # group order
        (
            2,
            [(["layers.0.attn"], SIGNATURE_A), (["layers.1.mixer", "layers.3.attn"], SIGNATURE_B)],
            None,
        ),  # membership
        (2, [(["layers.0.attn", "layers.3.attn"], SIGNATURE_A)], None),  # a group fewer
        (
            2,
            [GROUPS[0], (["layers.1.mixer"], {**SIGNATURE_B, "page_bytes": [4096, 2048]})],
            None,
        ),  # signature
        (2, [GROUPS[0], (["layers.1.mixer"], SIGNATURE_A)], None),  # signature
        (2, GROUPS, ""),  # namespace
        (2, GROUPS, "tenant-a"),
    ],
)
def test_what_changes_the_digest(
    tp_size: int, groups: list[tuple[list[str], object]], namespace: str | None
) -> None:
    assert layout_digest(tp_size, groups, namespace) != layout_digest(2, GROUPS)


@pytest.mark.parametrize("signature", [object(), {1, 2}, b"bytes", {"page": complex(1, 2)}])
def test_non_json_signature_is_a_type_error(signature: object) -> None:
    with pytest.raises(TypeError, match="JSON"):
        layout_digest(1, [(["a"], signature)])


def test_a_signature_with_a_non_str_dict_key_is_refused_not_merged_with_the_str_key() -> None:
    with pytest.raises(TypeError, match=r"groups\[0\] signature\['page'\]: dict key 1 \(int\)"):
        layout_digest(1, [(["a"], {"page": {1: 16}})])
    assert layout_digest(1, [(["a"], {"page": {"1": 16}})])


@pytest.mark.parametrize(
    ("tp_size", "groups", "namespace", "error", "match"),
    [
        (0, GROUPS, None, ValueError, "tp_size"),
        (True, GROUPS, None, TypeError, "tp_size"),
        (1, [("layers.0", SIGNATURE_A)], None, TypeError, r"groups\[0\]"),
        (1, [GROUPS[0], ([1, 2], SIGNATURE_A)], None, TypeError, r"groups\[1\]"),
        (1, GROUPS, 3, TypeError, "namespace"),
    ],
)
def test_bad_arguments(
    tp_size: object, groups: object, namespace: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        layout_digest(tp_size, groups, namespace)  # type: ignore[arg-type]


def test_a_stage_may_hold_no_layer() -> None:
    """(start, end) with start == end: a stage of the partition holding none of the layers
    the groups name is still a stage, and changes the digest."""
    one = layout_digest(1, GROUPS, pp_stages=[(0, 2)])
    assert layout_digest(1, GROUPS, pp_stages=[(0, 2), (2, 2)]) != one


@pytest.mark.parametrize("stage", [(2, 1), (-1, 2), (0, True), (0,), "02", (0, 2.0)])
def test_bad_stage_range(stage: object) -> None:
    with pytest.raises(ValueError, match=r"pp_stages\[1\] must be a \(start, end\) layer range"):
        layout_digest(1, GROUPS, pp_stages=[(0, 1), stage])  # type: ignore[list-item]


SCOPE_GROUPS = [(0, SIGNATURE_A), (1, SIGNATURE_B)]


def test_scope_digest_is_sha256_of_its_json_payload() -> None:
    payload = {"layers": 8, "namespace": "ns", "scope": [[0, SIGNATURE_A], [1, SIGNATURE_B]]}
    expected = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    assert scope_digest(SCOPE_GROUPS, 8, "ns") == expected


def test_scope_digest_separates_what_changes_the_kv() -> None:
    variants = {
        scope_digest(SCOPE_GROUPS, 8),
        scope_digest(SCOPE_GROUPS, 8, "ns"),
        scope_digest(SCOPE_GROUPS, 9),
        scope_digest([(1, SIGNATURE_A), (0, SIGNATURE_B)], 8),
        scope_digest([(0, SIGNATURE_A)], 8),
    }
    assert len(variants) == 5


def test_topology_digest_separates_tp_sizes_and_stage_ranges() -> None:
    scope = scope_digest(SCOPE_GROUPS, 8)
    cuts = [(1, ()), (2, ()), (1, [(0, 4), (4, 8)]), (1, [(0, 3), (3, 8)]), (2, [(0, 4), (4, 8)])]
    digests = {topology_digest(scope, tp, stages) for tp, stages in cuts}
    assert len(digests) == len(cuts)
    assert topology_digest(scope_digest(SCOPE_GROUPS, 8, "ns"), 1) != topology_digest(scope, 1)
    HybridKey("m", topology_digest(scope, 2), 0, 16, "00", 0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: scope_digest(SCOPE_GROUPS, 0), "num_layers must be positive"),
        (lambda: scope_digest([(-1, SIGNATURE_A)], 2), r"groups\[0\]: group id"),
        (lambda: topology_digest("s", 0), "tp_size must be positive"),
        (lambda: topology_digest("s", 1, [(2, 1)]), r"pp_stages\[0\]"),
    ],
)
def test_digests_refuse_bad_input_by_name(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
