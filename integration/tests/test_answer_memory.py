"""vLLM's repeated asks about a waiting request: its lookup answer, given again without a
pool query, and never past a failed load, a quarantine or a cache reset; its tokens,
hashed once."""

from __future__ import annotations

from typing import Any

from conftest import Clock, attention, groups, request
from scheduler_rig import TOKENS, Pool, block_keys, put_blocks

from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.scheduler import SchedulerSide
from hybridkv.keys import BlockHasher


def _side(vllm_specs: Any, **config: Any) -> tuple[SchedulerSide, Pool, Clock]:
    plan = plan_groups(groups(vllm_specs, (["a"], attention(vllm_specs))), [0], ModelShape(1, 2))
    pool, clock = Pool(), Clock()
    side = SchedulerSide(KeySpace(plan, "tiny"), ConnectorConfig(**config), pool.query, clock=clock)
    put_blocks(side, pool, TOKENS, [0], 160)
    return side, pool, clock


def test_a_waiting_request_asked_again_within_the_memory_time_queries_the_pool_once(
    vllm_specs: Any,
) -> None:
    side, pool, clock = _side(vllm_specs, lookup_memory_s=2.0)
    waiting = request("r", TOKENS)
    for step in range(5):  # vLLM asks each step while the request waits
        clock.now = step * 0.25
        assert side.num_new_matched_tokens(waiting, 0) == (160, False)
    assert pool.queries == 1
    stats = side.take_stats()
    assert (stats["lookups"], stats["remembered_lookups"]) == (1, 4)
    assert side.num_new_matched_tokens(waiting, 32) == (128, False)  # another ask: asked
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (160, False)  # a new object
    assert pool.queries == 3
    clock.now = 10.0  # past the memory time: asked again, and the pool's news seen
    pool.keys.clear()
    assert side.num_new_matched_tokens(waiting, 0) == (0, False)
    assert pool.queries == 4


def test_a_request_placed_then_preempted_is_looked_up_afresh(vllm_specs: Any) -> None:
    """Preempted within the memory time, it asks again while the pool now holds the
    blocks it saved: its remembered miss would make vLLM recompute them."""
    plan = plan_groups(groups(vllm_specs, (["a"], attention(vllm_specs))), [0], ModelShape(1, 2))
    pool, clock = Pool(), Clock()
    side = SchedulerSide(
        KeySpace(plan, "tiny"), ConnectorConfig(lookup_memory_s=2.0), pool.query, clock=clock
    )
    running = request("r", TOKENS)
    assert side.num_new_matched_tokens(running, 0) == (0, False)  # nothing stored yet
    side.after_alloc(running, ([1, 2, 3, 4, 5, 6, 7],), 0)
    put_blocks(side, pool, TOKENS, [0], 160)  # what it saved while running
    assert side.num_new_matched_tokens(running, 0) == (160, False)
    assert pool.queries == 2


def test_with_no_memory_time_every_ask_queries_the_pool(vllm_specs: Any) -> None:
    side, pool, _ = _side(vllm_specs, lookup_memory_s=0)
    waiting = request("r", TOKENS)
    for _ in range(3):
        assert side.num_new_matched_tokens(waiting, 0) == (160, False)
    assert pool.queries == 3
    assert side.take_stats()["remembered_lookups"] == 0


def test_a_quarantined_key_is_never_answered_from_memory(vllm_specs: Any) -> None:
    """Another request's failed load quarantines objects the remembered hit counts on:
    the next ask is a new lookup, whose hit stops before them."""
    side, pool, _ = _side(vllm_specs)
    waiting = request("r", TOKENS)
    assert side.num_new_matched_tokens(waiting, 0) == (160, False)
    side.loads_failed({"other"}, block_keys(side, TOKENS, 0, slice(2, 3)))
    assert side.num_new_matched_tokens(waiting, 0) == (64, False)
    assert pool.queries == 2


def test_a_failed_load_of_the_request_and_a_cache_reset_forget_its_answer(
    vllm_specs: Any,
) -> None:
    side, pool, _ = _side(vllm_specs)
    waiting = request("r", TOKENS)
    assert side.num_new_matched_tokens(waiting, 0) == (160, False)
    side.loads_failed({"r"}, [])  # read failed with no object to blame: asked afresh
    assert side.num_new_matched_tokens(waiting, 0) == (160, False)
    assert pool.queries == 2
    side.reset()  # new hashes: nothing stored before is found
    assert side.num_new_matched_tokens(waiting, 0) == (0, False)
    assert pool.queries == 3


def test_a_lookup_without_answer_is_not_remembered(vllm_specs: Any) -> None:
    side, pool, _ = _side(vllm_specs)
    waiting = request("r", TOKENS)
    pool.down = True
    assert side.num_new_matched_tokens(waiting, 0) == (0, False)
    pool.down = False
    assert side.num_new_matched_tokens(waiting, 0) == (160, False)
    assert pool.queries == 2


def test_a_waiting_request_asked_again_hashes_no_token_again(
    vllm_specs: Any, monkeypatch: Any
) -> None:
    side, pool, _ = _side(vllm_specs, lookup_memory_s=0)
    hashed: list[int] = []
    extend = BlockHasher.extend

    def counted(self: BlockHasher, token_ids: Any, extra: object = None) -> list[bytes]:
        token_ids = list(token_ids)
        hashed.append(len(token_ids))
        return extend(self, token_ids, extra)

    monkeypatch.setattr(BlockHasher, "extend", counted)
    waiting = request("r", TOKENS)
    for _ in range(3):
        assert side.num_new_matched_tokens(waiting, 0) == (160, False)
    assert pool.queries == 3
    assert side.take_stats()["remembered_lookups"] == 0
    assert hashed == [len(TOKENS)]
