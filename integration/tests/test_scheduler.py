"""The scheduler side as a whole: each step's metadata, and the roles that load or save."""

from __future__ import annotations

from typing import Any

from conftest import attention, groups, request, scheduler_output
from scheduler_rig import (
    TOKENS,
    Pool,
    make_side,
    put_blocks,
)

from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.scheduler import SchedulerSide


def test_a_step_computing_nothing_is_marked_idle(vllm_specs: Any) -> None:
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    assert side.build_meta(scheduler_output()).idle
    busy = scheduler_output(new=[("r", ([1, 2],), 0, 64)])
    assert not side.build_meta(busy).idle


def test_a_finished_id_reused_in_the_same_step_keeps_the_new_request_s_loads(
    vllm_specs: Any,
) -> None:
    """vLLM passes the ids that finished since the last step with the step that may
    already schedule a new request under one of them (request ids kept as sent): its
    loads must go out, or vLLM waits for them forever."""
    side, pool = make_side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    put_blocks(side, pool, TOKENS, [0], 96)
    first = request("r", TOKENS)
    assert side.num_new_matched_tokens(first, 0) == (96, True)
    side.after_alloc(first, ([1, 2, 3, 4, 5, 6, 7],), 96)
    side.build_meta(scheduler_output())
    side.forget("r")  # vLLM's request_finished (aborted)
    again = request("r", TOKENS)
    assert side.num_new_matched_tokens(again, 0) == (96, True)
    side.after_alloc(again, ([11, 12, 13, 14, 15, 16, 17],), 96)
    meta = side.build_meta(scheduler_output(finished={"r"}))
    assert meta.finished == {"r"}  # the workers release the old one's keys first
    (transfers,) = meta.requests
    assert transfers.request_id == "r"
    assert [(ref.index, ref.block_id) for ref in transfers.loads] == [(0, 11), (1, 12), (2, 13)]


def test_consumer_role_neither_loads_nor_saves_unless_told(vllm_specs: Any) -> None:
    kinds = [(["a"], attention(vllm_specs))]
    plan = plan_groups(groups(vllm_specs, *kinds), [0], ModelShape(1, 2))
    pool = Pool()
    put_blocks(
        SchedulerSide(KeySpace(plan, "tiny"), ConnectorConfig(), pool.query),
        pool,
        TOKENS,
        [0, 1],
        192,
    )
    for config, expect_load, expect_save in [
        (ConnectorConfig(), False, False),
        (ConnectorConfig(consumer_is_to_load=True, consumer_is_to_put=True), True, True),
        (ConnectorConfig(consumer_is_to_put=True), False, True),
        (ConnectorConfig(consumer_is_to_load=True), True, False),
    ]:
        side = SchedulerSide(KeySpace(plan, "tiny"), config, pool.query, "kv_consumer")
        hit = side.num_new_matched_tokens(request("r", TOKENS), 0)
        assert hit == ((192, False) if expect_load else (0, False))
        side.forget("r")
        fresh = request("s", TOKENS[:100])
        side.num_new_matched_tokens(fresh, 0)
        side.after_alloc(fresh, ([1, 2, 3, 4],), 0)  # as vLLM calls it, hit or not
        meta = side.build_meta(scheduler_output(new=[("s", ([1, 2, 3, 4],), 0, 100)]))
        assert bool(meta.requests) == expect_save
