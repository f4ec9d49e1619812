"""Mamba2 / KDA prefill checkpoints: a state block holding an inner state is never saved."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import attention, groups, mamba, request, scheduler_output

from hybridkv.integration.checkpoints import prefill_checkpoints
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.scheduler import SchedulerSide

PROMPT = list(range(1000, 1230))  # 230 tokens: blocks of 64 end at 64, 128, 192
# vLLM's tables after one 230-token chunk: attention's four blocks; Mamba's checkpoint
# column (cdiv(230, 64) - 2 = 2) and the chunk end's state, the columns before them null.
TABLES = ([1, 2, 3, 4], [0, 0, 77, 78])


def _kv_cache_config(vllm_specs: Any, hash_unit: int, checkpoint_blocks: int = 1) -> Any:
    mixer = mamba(
        vllm_specs,
        block_size=64,
        num_prefill_checkpoint_blocks=checkpoint_blocks,
        prefill_checkpoint_alignment=1,
    )
    kinds = [(["attn"], attention(vllm_specs, block_size=64)), (["mixer"], mixer)]
    return SimpleNamespace(
        kv_cache_groups=groups(vllm_specs, *kinds),
        hash_block_size=hash_unit,
        cache_hit_alignment_tokens=hash_unit,
    )


def _side(
    vllm_specs: Any, hash_unit: int, eagle: bool = False, checkpoint_blocks: int = 1
) -> SchedulerSide:
    """The connector's scheduler side for attention beside a Mamba2-like layer."""
    kv_cache_config = _kv_cache_config(vllm_specs, hash_unit, checkpoint_blocks)
    plan = plan_groups(kv_cache_config.kv_cache_groups, [0, 1], ModelShape(1, 2))
    speculative = SimpleNamespace(use_eagle_block_drop=lambda: eagle) if eagle else None
    vllm_config = SimpleNamespace(speculative_config=speculative)
    checkpoints = prefill_checkpoints(vllm_config, kv_cache_config, plan)
    assert (checkpoints is None) == (checkpoint_blocks == 0)
    return SchedulerSide(
        KeySpace(plan, "tiny"), ConnectorConfig(), lambda keys: [False] * len(keys),
        checkpoints=checkpoints,
    )  # fmt: skip


def _prefill(side: SchedulerSide) -> tuple[Any, list[Any]]:
    """Request r prefilled in one 230-token chunk, and the saves planned for it."""
    r = request("r", PROMPT)
    side.num_new_matched_tokens(r, 0)
    side.after_alloc(r, TABLES, 0)
    output = scheduler_output(new=[("r", TABLES, 0, len(PROMPT))], tables={"r": TABLES})
    (transfers,) = side.build_meta(output).requests
    return r, list(transfers.saves)


def _mamba_saves(vllm_specs: Any, hash_unit: int, eagle: bool, checkpoint_blocks: int = 1) -> Any:
    """The Mamba blocks (index, block id) planned for saving after the 230-token chunk."""
    _, saves = _prefill(_side(vllm_specs, hash_unit, eagle, checkpoint_blocks))
    return [(ref.index, ref.block_id) for ref in saves if ref.group == 1]


def test_a_checkpoint_at_the_block_end_is_saved(vllm_specs: Any) -> None:
    """Hash unit = block size: vLLM writes the state after 192 tokens into column 2,
    the state block 2 stands for."""
    assert _mamba_saves(vllm_specs, hash_unit=64, eagle=False) == [(2, 77)]


@pytest.mark.parametrize(
    ("hash_unit", "eagle"),
    [(16, False), (32, False), (64, True), (16, True)],
)
def test_a_checkpoint_inside_a_block_or_moved_back_by_eagle_is_not_saved(
    vllm_specs: Any, hash_unit: int, eagle: bool
) -> None:
    """Column 2 holds the state after 224 tokens (hash unit 16 or 32: the last unit
    multiple before 230), or after 128 (EAGLE drops a unit more): saved as block 2, a
    reader asking for the state after 192 tokens would get another one."""
    assert _mamba_saves(vllm_specs, hash_unit, eagle) == []


def test_mamba_layers_without_checkpoints_save_their_blocks_as_before(vllm_specs: Any) -> None:
    """LFM2's short conv and other Mamba-type layers keep no checkpoint column."""
    assert _mamba_saves(vllm_specs, hash_unit=16, eagle=False, checkpoint_blocks=0) == [(2, 77)]


def test_a_skipped_checkpoint_block_stays_unsaved_when_planned_again(vllm_specs: Any) -> None:
    """A failed load hands blocks back (`scanned` moves below the checkpoint column): a
    later step, which writes no checkpoint, must not save the column it skipped."""
    side = _side(vllm_specs, hash_unit=16)
    r, _ = _prefill(side)
    side.loads_failed((), (), {("r", 1, 1)})
    r.all_token_ids = [*PROMPT, 5]
    meta = side.build_meta(scheduler_output(cached=[("r", 230, 1)], tables={"r": TABLES}))
    assert [(ref.group, ref.index) for t in meta.requests for ref in t.saves] == []
