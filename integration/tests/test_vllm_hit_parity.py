"""Pool hits land where vLLM's own prefix cache does.

vLLM's real hybrid coordinator caches a writer's blocks; a reader sharing part of its
prompt then asks both vLLM and the coordinator the connector builds (`KVPlan`) for its
hit, the latter told which blocks vLLM holds, and then which the connector saved of the
writer. Random layouts of attention and Mamba groups, with EAGLE's block drop on every
group or only on the groups vLLM marks as the draft head's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import attention, mamba, require
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.coordinator import RecurrentState, SlidingWindow
from hybridkv.integration.groups import ModelShape, plan_groups

# (kind, sliding window) per group, in 16-, 32- or 64-token blocks.
SPEC_SHAPES = st.tuples(
    st.sampled_from([16, 32, 64]),
    st.sampled_from([("full", 0), ("window", 16), ("window", 33), ("window", 100), ("state", 0)]),
)


@dataclass(frozen=True)
class Layout:
    """Per group: (block size, (kind, window)) and whether vLLM marks it."""

    shapes: list[tuple[int, tuple[str, int]]]
    marked: list[bool]
    use_eagle: bool


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    # Few distinct shapes, so groups of equal specs (which vLLM looks up together) occur.
    shapes = draw(st.lists(SPEC_SHAPES, min_size=2, max_size=4))
    use_eagle = draw(st.booleans())
    marked = [use_eagle and draw(st.booleans()) for _ in shapes]
    return Layout(shapes, marked, use_eagle)


@pytest.fixture(scope="module")
def vllm_core() -> Any:
    require("vllm")
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_coordinator, kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    return kv_cache_coordinator, kv_cache_utils, sha256


def _vllm_request(request_id: str, tokens: list[int], block_hasher: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=block_hasher,
    )


@settings(
    max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(layouts(), st.integers(1, 500), st.integers(0, 500), st.integers(0, 200))
def test_pool_hit_is_vllm_s_own(
    vllm_specs: Any, vllm_core: Any, layout: Layout, written: int, shared: int, more: int
) -> None:
    specs = vllm_specs
    coordinators, utils, sha256 = vllm_core
    groups = []
    shapes = zip(layout.shapes, layout.marked, strict=True)
    for index, ((block_size, (kind, window)), marked) in enumerate(shapes):
        if kind == "state":
            spec = mamba(specs, block_size)
        else:
            spec = attention(specs, block_size, heads=1, window=window or None)
        groups.append(specs.KVCacheGroupSpec([f"l{index}"], spec, is_eagle_group=marked))
    config = specs.KVCacheConfig(num_blocks=512, kv_cache_tensors=[], kv_cache_groups=groups)
    block_sizes = [block_size for block_size, _ in layout.shapes]
    hash_block_size = math.gcd(*block_sizes)
    vllm = coordinators.get_kv_cache_coordinator(
        config,
        max_model_len=4096,
        max_in_flight_tokens=4096,
        use_eagle=layout.use_eagle,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=math.lcm(*block_sizes),
        hash_block_size=hash_block_size,
    )
    hasher = utils.get_request_block_hasher(hash_block_size, sha256)
    writer = list(range(written))
    shared = min(shared, written)
    reader = writer[:shared] + list(range(10_000, 10_000 + more))
    if not reader:
        return
    vllm.allocate_new_blocks("w", written, written)
    vllm.cache_blocks(_vllm_request("w", writer, hasher), written)
    _, vllm_hit, _ = vllm.find_longest_cache_hit(
        _vllm_request("r", reader, hasher).block_hashes, len(reader) - 1
    )

    plan = plan_groups(groups, list(range(len(groups))), ModelShape(tp_size=1, total_kv_heads=1))
    ours = plan.coordinator(layout.use_eagle)

    def hit_on(kept: list[list[bool]]) -> int:
        """The pool's hit where `kept` blocks of the writer's are stored (those both
        prompts share: a block past them hashes apart)."""
        readable = [
            [held and (index + 1) * group.block_size <= shared for index, held in enumerate(mask)]
            for mask, group in zip(kept, plan.groups, strict=True)
        ]
        return ours.find_hit(len(reader) - 1, readable, known_tokens=len(reader)).tokens

    cached = [
        [block.block_hash is not None for block in manager.req_to_blocks["w"]]
        for manager in vllm.single_type_managers
    ]
    hit = hit_on(cached)
    # What the connector saves of the writer serves the same hit as what vLLM caches (the
    # states of Mamba groups: where the writer's chunks left one, see test_save_planner.py).
    if not any(isinstance(group.kind, RecurrentState) for group in plan.groups):
        assert hit_on([list(mask) for mask in ours.store_mask(written)]) == hit
    if hit != vllm_hit:
        # vLLM trims a window's matched run that reaches the prompt's start (shorter than a
        # window) to the alignment before dropping EAGLE's block, then trims again: it
        # loses a step the pool keeps (its blocks are readable; the drop is still made).
        assert hit - vllm_hit == plan.alignment
        assert any(
            group.drafted
            and isinstance(group.kind, SlidingWindow)
            and -(-(group.kind.window - 1) // group.block_size) > hit // group.block_size
            for group in plan.groups
        )
