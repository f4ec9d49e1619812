"""KV events: BlockStored for pool blocks, with vLLM's own hashes, released once all heads
stored them; the real vLLM event stream is checked in test_vllm_reuse.py."""

from __future__ import annotations

from typing import Any

from conftest import attention, groups, mamba, scheduler_output

from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.kv_events import EventBuilder, HeadStored, PoolAnnouncer, StoredEvents
from hybridkv.integration.scheduler import SchedulerSide

TOKENS = list(range(100, 100 + 200))


def _vllm_request(request_id: str, tokens: list[int], block_size: int) -> Any:
    """A real vLLM request, hashed by vLLM's own request block hasher."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def test_saves_carry_block_stored_with_vllm_hashes_per_group(vllm_specs: Any) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    kinds = [(["a"], attention(vllm_specs, block_size=64)), (["m"], mamba(vllm_specs))]
    plan = plan_groups(groups(vllm_specs, *kinds), [0, 1], ModelShape(1, 2))
    specs = {0: kinds[0][1], 1: kinds[1][1]}
    side = SchedulerSide(
        KeySpace(plan, "tiny"), ConnectorConfig(), lambda keys: None, None, EventBuilder(32, specs)
    )
    req = _vllm_request("r", TOKENS, 32)
    side.num_new_matched_tokens(req, 0)
    tables = ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10])
    side.after_alloc(req, tables, 0)
    (transfers,) = side.build_meta(scheduler_output(new=[("r", tables, 0, 200)])).requests
    by_group = {
        group: [ref.stored for ref in transfers.saves if ref.group == group] for group in (0, 1)
    }
    assert [e.block_size for e in by_group[0] if e] == [64, 64, 64]
    # a 64-token block is named by vLLM's hash at its end (every second 32-token hash)
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    assert [e.block_hashes for e in by_group[0] if e] == [[hashes[1]], [hashes[3]], [hashes[5]]]
    assert [e.parent_block_hash for e in by_group[0] if e] == [None, hashes[1], hashes[3]]
    assert by_group[0][1] is not None
    assert by_group[0][1].token_ids == TOKENS[64:128]
    mamba_events = [e for e in by_group[1] if e]
    assert mamba_events
    assert all(e.group_idx == 1 for e in mamba_events)
    assert {e.kv_cache_spec_kind for e in by_group[0] if e} != {
        e.kv_cache_spec_kind for e in mamba_events
    }
    assert all(e and e.medium == "CPU" for events in by_group.values() for e in events)


def test_a_block_is_announced_once_every_storing_head_stored_it() -> None:
    announcer = PoolAnnouncer({0: 2, 1: 1})
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    def stored(group: int, name: int) -> BlockStored:
        return BlockStored(
            block_hashes=[name],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=group,
        )

    report = StoredEvents([HeadStored(head=0, event=stored(0, 7))])
    report.add_events([HeadStored(head=0, event=stored(1, 8))])  # vLLM merging a 2nd worker
    report.increment_workers()
    announcer.add(report.get_all_events())
    assert announcer.take() == [stored(1, 8)]  # group 1 has one storing head
    announcer.add([HeadStored(head=0, event=stored(0, 7))])  # the same head again
    assert announcer.take() == []
    announcer.add([HeadStored(head=1, event=stored(0, 7))])
    assert announcer.take() == [stored(0, 7)]
    assert announcer.take() == []
    # Saved again (a repeated prompt, found in the pool): announced once only.
    announcer.add([HeadStored(head=0, event=stored(0, 7)), HeadStored(1, stored(0, 7))])
    announcer.add([HeadStored(head=0, event=stored(1, 8))])
    assert announcer.take() == []

    # A cache reset: what a worker reports of a save planned before it is not announced.
    announcer.add([HeadStored(head=0, event=stored(0, 9))])  # waits for head 1
    announcer.add([HeadStored(head=0, event=stored(1, 10))])  # ready, not yet taken
    announcer.reset(1)
    announcer.add([HeadStored(head=1, event=stored(0, 9)), HeadStored(0, stored(1, 11))])
    removed = [
        BlockRemoved(block_hashes=[name], medium="CPU", group_idx=group)
        for group, name in [(0, 7), (1, 8)]
    ]
    assert announcer.take() == removed  # what was published (10 was not yet), now gone
    announcer.add([HeadStored(0, stored(1, 12), generation=1)])
    assert announcer.take() == [stored(1, 12)]
    announcer.add([HeadStored(0, stored(1, 8), generation=1)])  # stored anew after the reset
    assert announcer.take() == [stored(1, 8)]
    announcer.add([HeadStored(0, stored(1, 13), generation=1)])
    assert announcer.take() == [stored(1, 13)]
    announcer.reset(2)
    announcer.reset(3)  # before vLLM took the first reset's removals: they stay
    assert announcer.take() == [
        BlockRemoved(block_hashes=[name], medium="CPU", group_idx=1) for name in [12, 8, 13]
    ]
