"""Mamba2 / KDA prefill checkpoints: a state block holding an inner state is never saved
as its block, and a prompt's last one is saved as the prompt tail at its position."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import attention, groups, mamba, request, scheduler_output
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.integration.checkpoints import prefill_checkpoints
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.metadata import HybridKVMetadata
from hybridkv.integration.scheduler import SchedulerSide

PROMPT = list(range(1000, 1230))  # 230 tokens: blocks of 64 end at 64, 128, 192
# vLLM's tables after one 230-token chunk: attention's four blocks; Mamba's checkpoint
# column (cdiv(230, 64) - 2 = 2) and the chunk end's state, the columns before them null.
TABLES = ([1, 2, 3, 4], [0, 0, 77, 78])


def _kv_cache_config(
    vllm_specs: Any,
    hash_unit: int,
    checkpoint_blocks: int = 1,
    conv: bool = False,
    block_size: int = 64,
    alignment: int | None = None,
) -> Any:
    """Attention and a Mamba2-like mixer; with `conv`, a third group of a Mamba-type layer
    without checkpoints (a short conv). Hits align to `alignment` tokens (the hash unit
    unless given)."""
    mixer = mamba(
        vllm_specs,
        block_size=block_size,
        num_prefill_checkpoint_blocks=checkpoint_blocks,
        prefill_checkpoint_alignment=1,
    )
    kinds = [(["attn"], attention(vllm_specs, block_size=block_size)), (["mixer"], mixer)]
    if conv:
        kinds.append((["conv"], mamba(vllm_specs, block_size=block_size)))
    return SimpleNamespace(
        kv_cache_groups=groups(vllm_specs, *kinds),
        hash_block_size=hash_unit,
        cache_hit_alignment_tokens=alignment or hash_unit,
    )


def _side(
    vllm_specs: Any,
    hash_unit: int,
    eagle: bool = False,
    checkpoint_blocks: int = 1,
    pool: set[str] | None = None,
    conv: bool = False,
    config: ConnectorConfig | None = None,
    block_size: int = 64,
    alignment: int | None = None,
) -> SchedulerSide:
    """The connector's scheduler side for attention beside a Mamba2-like layer (and a
    short conv with `conv`); with a `pool` (the keys it holds), prompt tails at multiples
    of the hash unit."""
    kv_cache_config = _kv_cache_config(
        vllm_specs, hash_unit, checkpoint_blocks, conv, block_size, alignment
    )
    vllm_groups = kv_cache_config.kv_cache_groups
    plan = plan_groups(vllm_groups, list(range(len(vllm_groups))), ModelShape(1, 2))
    speculative = SimpleNamespace(use_eagle_block_drop=lambda: eagle) if eagle else None
    vllm_config = SimpleNamespace(speculative_config=speculative)
    checkpoints = prefill_checkpoints(vllm_config, kv_cache_config, plan)
    assert (checkpoints is None) == (checkpoint_blocks == 0)
    held = pool if pool is not None else set()
    return SchedulerSide(
        KeySpace(plan, "tiny"), config or ConnectorConfig(), lambda keys: [k in held for k in keys],
        tail_unit=hash_unit if pool is not None else 0, checkpoints=checkpoints,
        use_eagle=eagle,
    )  # fmt: skip


def _prefill(
    side: SchedulerSide,
    prompt: list[int] = PROMPT,
    chunk: int | None = None,
    tables: tuple[list[int], ...] = TABLES,
) -> tuple[Any, list[Any]]:
    """Request r prefilled in one chunk (the whole prompt unless `chunk` tokens) with
    vLLM's block `tables`, and the saves planned for it."""
    r = request("r", prompt)
    side.num_new_matched_tokens(r, 0)
    side.after_alloc(r, tables, 0)
    scheduled = len(prompt) if chunk is None else chunk
    output = scheduler_output(new=[("r", tables, 0, scheduled)], tables={"r": tables})
    (transfers,) = side.build_meta(output).requests
    return r, list(transfers.saves)


def _put(side: SchedulerSide, pool: set[str], saves: list[Any]) -> None:
    for ref in saves:
        storing = range(side.plan.groups[ref.group].heads.storing)
        pool.update(side.keys.keys(ref.group, [ref.block_hash], storing))


def _tails(saves: list[Any]) -> list[tuple[int, int, int, int]]:
    """(plan group, block index, local block id, tokens) of the prompt tails saved."""
    return [(ref.group, ref.index, ref.block_id, ref.tail) for ref in saves if ref.tail]


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
    [(16, False), (32, False), (16, True)],
)
def test_a_checkpoint_inside_a_block_or_moved_back_by_eagle_is_not_saved(
    vllm_specs: Any, hash_unit: int, eagle: bool
) -> None:
    """Column 2 holds the state after 224 tokens (hash unit 16 or 32: the last unit
    multiple before 230), or, with EAGLE, a unit before that: saved as block 2, a
    reader asking for the state after 192 tokens would get another one."""
    assert _mamba_saves(vllm_specs, hash_unit, eagle) == []


@pytest.mark.parametrize(("hash_unit", "eagle"), [(64, True), (128, False)])
def test_a_checkpoint_moved_back_onto_another_block_s_end_is_saved_as_that_block(
    vllm_specs: Any, hash_unit: int, eagle: bool
) -> None:
    """Column 2 holds the state after 128 tokens, block 1's end: EAGLE moved the checkpoint
    a unit (a block) back, or the unit is two blocks. vLLM keeps it there (its own column 1
    is null): saved as block 1, and a resend of the prompt resumes there (with EAGLE,
    block 2 is the dropped one)."""
    assert _mamba_saves(vllm_specs, hash_unit, eagle) == [(1, 77)]
    pool: set[str] = set()
    writer = _side(vllm_specs, hash_unit, eagle=eagle)
    _put(writer, pool, _prefill(writer)[1])
    reader = _side(vllm_specs, hash_unit, eagle=eagle, pool=pool)
    assert reader.num_new_matched_tokens(request("r", PROMPT), 0) == (128, False)


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


@pytest.mark.parametrize("hash_unit", [16, 32])
def test_a_prompt_s_last_checkpoint_is_stored_as_its_tail_and_resumed_there(
    vllm_specs: Any, hash_unit: int
) -> None:
    """One 230-token chunk leaves no state at any block end, only the state after 224
    tokens in column 2: stored as the tail at 224 (attention's block 3 beside it), so a
    resend resumes there, as vLLM's own cache does, not at 0."""
    pool: set[str] = set()
    side = _side(vllm_specs, hash_unit, pool=pool)
    _, saves = _prefill(side)
    assert _tails(saves) == [(0, 3, 4, 224), (1, 3, 77, 224)]
    assert [ref.index for ref in saves if ref.group == 1 and not ref.tail] == []
    _put(side, pool, saves)
    reader = _side(vllm_specs, hash_unit, pool=pool)
    again = request("again", PROMPT)
    assert reader.num_new_matched_tokens(again, 0) == (224, False)
    tables = ([11, 12, 13, 14], [0, 0, 0, 88])
    reader.after_alloc(again, tables, 224)
    output = scheduler_output(new=[("again", tables, 224, 6)], tables={"again": tables})
    (transfers,) = reader.build_meta(output).requests
    loads = {(ref.group, ref.index, ref.block_id, ref.tail) for ref in transfers.loads}
    assert loads == {(0, 0, 11, 0), (0, 1, 12, 0), (0, 2, 13, 0), (0, 3, 14, 224)} | {
        (1, 3, 88, 224)
    }
    # Without the state's tail the attention blocks alone give nothing.
    (state,) = [ref for ref in saves if ref.tail and ref.group == 1]
    pool -= set(side.keys.keys(1, [state.block_hash], [0]))
    assert reader.num_new_matched_tokens(request("third", PROMPT), 0) == (0, False)


def test_a_prompt_ending_on_a_unit_leaves_two_tails(vllm_specs: Any) -> None:
    """240 tokens: the checkpoint after 224 (a resend's hit, capped at 239) and the
    chunk's own end at 240, the state in the running block (a longer prompt's hit)."""
    pool: set[str] = set()
    side = _side(vllm_specs, 16, pool=pool)
    prompt = list(range(1000, 1240))
    _, saves = _prefill(side, prompt)
    assert _tails(saves) == [(0, 3, 4, 240), (1, 3, 78, 240), (0, 3, 4, 224), (1, 3, 77, 224)]
    _put(side, pool, saves)
    reader = _side(vllm_specs, 16, pool=pool)
    assert reader.num_new_matched_tokens(request("resent", prompt), 0) == (224, False)
    longer = request("longer", [*prompt, 5, 6, 7])
    assert reader.num_new_matched_tokens(longer, 0) == (240, False)


def test_a_checkpoint_of_a_chunk_before_the_prompt_s_last_is_no_tail(vllm_specs: Any) -> None:
    """vLLM ends a Mamba2 prompt's earlier chunks at block ends; their checkpoint (after
    176 tokens in a chunk ending at 192, column 1) is not where vLLM's own cache hits."""
    side = _side(vllm_specs, 16, pool=set())
    _, saves = _prefill(side, list(range(1000, 1300)), chunk=192)
    assert _tails(saves) == []
    assert [(ref.group, ref.index) for ref in saves if ref.group == 1] == [(1, 2)]


def test_no_checkpoint_tail_while_another_state_group_keeps_no_checkpoint(
    vllm_specs: Any,
) -> None:
    """Beside a layer without checkpoints (a short conv), whose block 3 holds the state
    after the chunk's 230 tokens, no state after 224 exists for every group."""
    side = _side(vllm_specs, 16, pool=set(), conv=True)
    assert len(side.plan.groups) == 3
    _, saves = _prefill(side, tables=([1, 2, 3, 4], [0, 0, 77, 78], [0, 0, 0, 99]))
    assert _tails(saves) == []


@pytest.mark.parametrize("from_pool", [True, False])
def test_a_block_a_chunk_resumed_inside_and_ran_past_is_not_saved(
    vllm_specs: Any, from_pool: bool
) -> None:
    """A reader resumes at the 224-token tail (from the pool, or vLLM's own cache), inside
    state block 3, and runs [224, 400) as one chunk: vLLM writes the state after 400
    tokens into column 6 and its checkpoint (after 384, block 5's end) into column 5;
    column 3 keeps the state after 224. Saved as block 3 (the state after 256), a reader
    hitting at 256 would resume from the wrong state."""
    pool: set[str] = set()
    side = _side(vllm_specs, 16, pool=pool)
    _, saves = _prefill(side)  # tails at 224
    _put(side, pool, saves)
    reader = _side(vllm_specs, 16, pool=pool if from_pool else set())
    longer = request("longer", [*PROMPT, *range(5000, 5170)])  # 400 tokens
    external = 224 if from_pool else 0
    assert reader.num_new_matched_tokens(longer, 224 - external) == (external, False)
    tables = ([11, 12, 13, 14, 15, 16, 17], [0, 0, 0, 88, 0, 89, 90])
    reader.after_alloc(longer, tables, external)
    output = scheduler_output(new=[("longer", tables, 224, 400 - 224)], tables={"longer": tables})
    (transfers,) = reader.build_meta(output).requests
    states = [(ref.index, ref.block_id, ref.tail) for ref in transfers.saves if ref.group == 1]
    assert states == [(5, 89, 0), (6, 90, 400)]


def _decoding(vllm_specs: Any) -> tuple[SchedulerSide, Any, list[int], Any]:
    """A 60-token prompt computed in one step, blocks of 64 beside a Mamba2-like layer,
    `save_decode_cache` on: (side, request, prompt, block tables)."""
    side = _side(
        vllm_specs, 64, checkpoint_blocks=0, config=ConnectorConfig(save_decode_cache=True)
    )
    prompt = list(range(1000, 1060))
    tables = ([1, 2], [77, 78])
    r = request("r", prompt)
    side.num_new_matched_tokens(r, 0)
    side.after_alloc(r, tables, 0)
    side.build_meta(scheduler_output(new=[("r", tables, 0, 60)], tables={"r": tables}))
    return side, r, prompt, tables


def _decode_step(
    side: SchedulerSide, r: Any, prompt: list[int], tables: Any, computed: int, scheduled: int
) -> HybridKVMetadata:
    """A decode step from `computed` tokens (all known: the last one just sampled) with
    `scheduled - 1` draft tokens."""
    r.all_token_ids = [*prompt, *range(computed + 1 - len(prompt))]
    r.num_tokens = computed + 1
    output = scheduler_output(cached=[("r", computed, scheduled)], tables={"r": tables})
    return side.build_meta(output)


def test_a_decode_step_with_draft_tokens_crossing_a_block_end_saves_the_state(
    vllm_specs: Any,
) -> None:
    """Not a resumed prefill chunk: with speculative decoding a step [62, 66) crosses the
    end of block 0, and vLLM copies the state after 64 tokens into block 0 once the
    tokens are accepted; with `save_decode_cache` block 0 is saved, state and all, in
    the next step (the token sampled last is known only then)."""
    side, r, prompt, tables = _decoding(vllm_specs)
    saved = []
    for computed, scheduled in ((60, 2), (62, 4), (66, 1)):  # the drafts all accepted
        meta = _decode_step(side, r, prompt, tables, computed, scheduled)
        saved += [(ref.group, ref.index) for t in meta.requests for ref in t.saves]
        assert not meta.hold_saves  # the copy ran in the step before
    assert saved == [(0, 0), (1, 0)]


@pytest.mark.parametrize("drafts", [0, 3])
def test_a_state_saved_in_the_step_whose_draft_tokens_cross_its_end_is_held_for_sampling(
    vllm_specs: Any, drafts: int
) -> None:
    """Step [63, 64 + drafts) completes block 0 with the token sampled last. With draft
    tokens the kernel writes its state into block 1, and vLLM copies the state after 64
    tokens into block 0 only after sampling: the step's puts wait for `wait_for_save`
    (layerwise puts would go out when the Mamba layer reports). Without drafts the
    kernel writes block 0 itself."""
    side, r, prompt, tables = _decoding(vllm_specs)
    for computed in range(60, 63):  # plain decode steps up to 63 tokens
        assert not _decode_step(side, r, prompt, tables, computed, 1).hold_saves
    meta = _decode_step(side, r, prompt, tables, 63, 1 + drafts)
    assert [(ref.group, ref.index) for t in meta.requests for ref in t.saves] == [(0, 0), (1, 0)]
    assert meta.hold_saves == bool(drafts)


def test_a_checkpoint_at_the_resumed_block_s_end_in_a_later_column_is_saved_as_it(
    vllm_specs: Any,
) -> None:
    """Blocks of 96 tokens, hits aligned to 64, EAGLE: a chunk resuming at vLLM's own hit
    of 128 (inside block 1) and running to 300 writes its checkpoint, the state after 192
    tokens (block 1's end: a unit before the last multiple of 64), into column 2.
    Column 1 keeps the state after 128 and is never saved as block 1; column 2 is, as the
    checkpoint at a block end always is."""
    side = _side(vllm_specs, 16, eagle=True, block_size=96, alignment=64)
    long = request("long", list(range(1000, 1300)))
    assert side.num_new_matched_tokens(long, 128) == (0, False)
    tables = ([11, 12, 13, 14], [0, 88, 89, 90])
    side.after_alloc(long, tables, 0)
    output = scheduler_output(new=[("long", tables, 128, 300 - 128)], tables={"long": tables})
    (transfers,) = side.build_meta(output).requests
    assert [(ref.index, ref.block_id) for ref in transfers.saves if ref.group == 1] == [(1, 89)]
    # A later rescan (a failed load moving the scan back) saves neither column as its block.
    side.loads_failed([], [], [("long", 1, 1), ("long", 1, 2)])
    long.all_token_ids = [*long.all_token_ids, 5]
    meta = side.build_meta(scheduler_output(cached=[("long", 300, 1)], tables={"long": tables}))
    assert [ref for t in meta.requests for ref in t.saves if ref.group == 1] == []


@given(
    st.integers(0, 5000),
    st.integers(1, 64),
    st.sampled_from([16, 32, 64]),
    st.sampled_from([64, 128]),
    st.booleans(),
)
def test_vllm_s_rule_puts_no_checkpoint_in_a_chunk_of_a_unit_or_less(
    start: int, length: int, unit: int, block_size: int, eagle: bool
) -> None:
    """The premise of `inner` skipping vLLM's rule for such chunks (decode steps)."""
    from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

    length = min(length, unit)
    _, (column,) = compute_mamba_prefill_checkpoints(
        [start + length], [length], unit, block_size, 1, eagle, unit
    )
    assert column == -1


def test_decode_steps_do_not_ask_vllm_s_rule(vllm_specs: Any, monkeypatch: Any) -> None:
    from vllm.model_executor.layers.mamba import checkpoint

    side = _side(vllm_specs, 16, pool=set())
    r, _ = _prefill(side)
    asked = []
    real = checkpoint.compute_mamba_prefill_checkpoints
    monkeypatch.setattr(
        checkpoint,
        "compute_mamba_prefill_checkpoints",
        lambda *args: asked.append(args) or real(*args),
    )
    r.all_token_ids = [*PROMPT, 5]
    side.build_meta(scheduler_output(cached=[("r", 230, 1)], tables={"r": TABLES}))
    assert asked == []
    side.build_meta(scheduler_output(cached=[("r", 231, 17)], tables={"r": TABLES}))
    assert len(asked) == 1


def test_a_tail_below_the_end_of_a_longer_sibling_s_blocks_is_found(vllm_specs: Any) -> None:
    """A longer prompt sharing the written one's start (a chat whose last turn was
    edited) makes attention blocks readable past the tail's block: the tail at 224 is
    still asked about, and found."""
    pool: set[str] = set()
    side = _side(vllm_specs, 16, pool=pool)
    _, saves = _prefill(side)  # tails at 224
    _put(side, pool, saves)
    longer = [*PROMPT, *range(5000, 5370)]  # 600 tokens in one chunk: a tail at 592
    tables = (list(range(1, 11)), [0] * 8 + [77, 78])
    sibling = _side(vllm_specs, 16, pool=pool)
    _, sibling_saves = _prefill(sibling, longer, tables=tables)
    assert [tail for *_, tail in _tails(sibling_saves)] == [592, 592]
    _put(sibling, pool, sibling_saves)
    reader = _side(vllm_specs, 16, pool=pool)
    edited = request("edited", [*longer[:400], *range(9000, 9100)])  # blocks 0..5 shared
    assert reader.num_new_matched_tokens(edited, 0) == (224, False)
