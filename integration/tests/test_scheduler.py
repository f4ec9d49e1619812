"""Scheduler-side decisions against synthetic vLLM configs and a dict-backed pool."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Clock, attention, groups, mamba, request, scheduler_output
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hybridkv.integration import scheduler
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.connector import background_loads_reason
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace, RequestHashes
from hybridkv.integration.scheduler import SchedulerSide

TOKENS = list(range(100, 100 + 200))  # 6 full blocks of 32, plus 8 tokens


class Pool:
    """Readability from a set of keys; counts the batched queries it answers."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.queries = 0
        self.down = False

    def query(self, keys: Sequence[str]) -> list[bool] | None:
        self.queries += 1
        return None if self.down else [key in self.keys for key in keys]


def _side(specs: Any, kinds: Any, shape: ModelShape, **config: Any) -> tuple[SchedulerSide, Pool]:
    plan = plan_groups(groups(specs, *kinds), list(range(len(kinds))), shape)
    pool = Pool()
    return SchedulerSide(KeySpace(plan, "tiny"), ConnectorConfig(**config), pool.query), pool


def _store(
    side: SchedulerSide,
    pool: Pool,
    tokens: list[int],
    heads: Sequence[int],
    upto: int,
    writer: Any = None,
    keys: KeySpace | None = None,
    generation: int = 0,
) -> None:
    """Put every group's blocks of the first `upto` tokens for `heads` (as `writer`, a
    request, computed them: its LoRA, salt...), under `keys` (default: the side's), as
    saved after `generation` cache resets."""
    keys = side.keys if keys is None else keys
    hashes = RequestHashes(side.plan, "", writer, generation)
    hashes.cover(tokens, upto)
    for group, plan in enumerate(side.plan.groups):
        blocks = hashes.for_group(plan.block_size)[: upto // plan.block_size]
        pool.keys.update(keys.keys(group, blocks, heads))


def test_hit_needs_every_storing_head_tp4_two_kv_heads(vllm_specs: Any) -> None:
    shape = ModelShape(tp_size=4, total_kv_heads=2)
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs, heads=1))], shape)
    _store(side, pool, TOKENS, [0], 192)  # only head 0's objects: rank 2 and 3 would miss
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (0, False)
    _store(side, pool, TOKENS, [1], 192)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (192, False)
    assert pool.queries == 2  # one batched query per lookup


def test_hit_is_capped_below_the_prompt_length(vllm_specs: Any) -> None:
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    tokens = TOKENS[:192]
    _store(side, pool, tokens, [0], 192)
    # 192 tokens are all stored, but the last token must be computed: 160 at most.
    assert side.num_new_matched_tokens(request("r", tokens), 0) == (160, False)


def test_partial_prefix_and_local_hit(vllm_specs: Any) -> None:
    side, pool = _side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    _store(side, pool, TOKENS, [0], 96)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (96, True)
    assert side.num_new_matched_tokens(request("r", TOKENS), 64) == (32, True)
    assert side.num_new_matched_tokens(request("r", TOKENS), 96) == (0, False)


def test_hits_load_in_the_background_when_vllm_requires_it(vllm_specs: Any) -> None:
    """A hybrid model's loads wait in the background whatever `load_async` says: only
    then can vLLM recompute a failed load."""
    plan = plan_groups(groups(vllm_specs, (["a"], attention(vllm_specs))), [0], ModelShape(1, 2))
    pool = Pool()
    config = ConnectorConfig(load_async=False)
    side = SchedulerSide(KeySpace(plan, "tiny"), config, pool.query, load_async_required=True)
    _store(side, pool, TOKENS, [0], 96)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (96, True)


@pytest.mark.parametrize(
    ("kind", "vllm_groups", "stages", "reason"),
    [
        ("full", 1, (), None),
        ("full", 2, (), "2 KV cache groups"),
        ("window", 1, (), "a sliding-window or state group"),
        ("state", 1, (), "a sliding-window or state group"),
        ("full", 1, ((0, 1), (1, 2)), "2 pipeline stages"),
    ],
)
def test_loads_go_to_the_background_where_vllm_cannot_recompute_from_a_failed_block(
    vllm_specs: Any,
    kind: str,
    vllm_groups: int,
    stages: tuple[tuple[int, int], ...],
    reason: str | None,
) -> None:
    """Only a single-group model of prefix KV (full attention, MLA) without stages may load
    before the forward: vLLM recomputes such a failed load from the failed block on."""
    spec = {
        "full": attention(vllm_specs),
        "window": attention(vllm_specs, window=64),
        "state": mamba(vllm_specs),
    }[kind]
    plan = plan_groups(groups(vllm_specs, (["a"], spec)), [0], ModelShape(1, 2), pp_stages=stages)
    found = background_loads_reason(vllm_groups, plan)
    if reason is None:
        assert found is None
    else:
        assert found is not None
        assert found.startswith(reason)


def _block_keys(side: SchedulerSide, tokens: list[int], group: int, blocks: slice) -> list[str]:
    hashes = RequestHashes(side.plan, "", None)
    hashes.cover(tokens, len(tokens))
    size = side.plan.groups[group].block_size
    return side.keys.keys(group, hashes.for_group(size)[blocks], [0])


def test_keys_whose_load_failed_count_as_absent_while_quarantined(vllm_specs: Any) -> None:
    """A dead holder's objects stay listed until the master drops them: lookups must not
    offer them again, to the request vLLM recomputes (which asks again at once, in a
    loop otherwise) or to any other; the blocks before the first failed one still serve."""
    plan = plan_groups(groups(vllm_specs, (["a"], attention(vllm_specs))), [0], ModelShape(1, 2))
    pool, clock = Pool(), Clock()
    config = ConnectorConfig(failed_load_quarantine_s=30)
    side = SchedulerSide(KeySpace(plan, "tiny"), config, pool.query, clock=clock)
    _store(side, pool, TOKENS, [0], 160)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (160, False)
    side.loads_failed({"r"}, _block_keys(side, TOKENS, 0, slice(2, 4)))
    assert side.take_stats()["quarantined_keys"] == 2
    # Another read of one of them, looked up before the failure was reported, fails too:
    # still the same two objects.
    side.loads_failed(set(), _block_keys(side, TOKENS, 0, slice(3, 5)))
    assert side.take_stats()["quarantined_keys"] == 1
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (64, False)
    assert side.num_new_matched_tokens(request("other", TOKENS), 0) == (64, False)
    clock.now = 29.9
    assert side.num_new_matched_tokens(request("other", TOKENS), 0) == (64, False)
    clock.now = 30.0
    assert side.num_new_matched_tokens(request("other", TOKENS), 0) == (160, False)
    assert len(side.quarantine) == 0


def test_a_recomputed_request_saves_the_blocks_past_its_new_hit(vllm_specs: Any) -> None:
    """Its first hit had marked every block below it decided; vLLM computes them now, so
    they are saved (the pool may have lost them with their holder)."""
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    _store(side, pool, TOKENS, [0], 160)
    r = request("r", TOKENS)
    assert side.num_new_matched_tokens(r, 0) == (160, False)
    side.after_alloc(r, ([1, 2, 3, 4, 5, 6, 7],), 160)
    side.build_meta(scheduler_output())
    side.loads_failed({"r"}, _block_keys(side, TOKENS, 0, slice(2, 5)))
    assert side.num_new_matched_tokens(r, 0) == (64, False)
    side.after_alloc(r, ([11, 12, 13, 14, 15, 16, 17],), 64)
    meta = side.build_meta(scheduler_output(new=[("r", ([11, 12, 13, 14, 15, 16, 17],), 64, 136)]))
    (transfers,) = meta.requests
    assert [ref.index for ref in transfers.loads] == [0, 1]
    assert [(ref.index, ref.block_id) for ref in transfers.saves] == [
        (2, 13),
        (3, 14),
        (4, 15),
        (5, 16),
    ]


def test_a_finished_id_reused_in_the_same_step_keeps_the_new_request_s_loads(
    vllm_specs: Any,
) -> None:
    """vLLM passes the ids that finished since the last step with the step that may
    already schedule a new request under one of them (request ids kept as sent): its
    loads must go out, or vLLM waits for them forever."""
    side, pool = _side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    _store(side, pool, TOKENS, [0], 96)
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


def test_a_prompt_given_as_embeddings_is_neither_looked_up_nor_saved(vllm_specs: Any) -> None:
    """vLLM fills its token ids with 0: saved under their hashes, its KV would be what a
    prompt of token 0 repeated loads."""
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    zeros = [0] * 100
    embedded = request("e", zeros, prompt_embeds=object())
    _store(side, pool, zeros, [0], 96)
    assert side.num_new_matched_tokens(embedded, 0) == (0, False)
    assert pool.queries == 0
    table = ([1, 2, 3, 4],)
    side.after_alloc(embedded, table, 0)
    meta = side.build_meta(scheduler_output(new=[("e", table, 0, 100)], tables={"e": table}))
    assert meta.requests == []


def test_saves_the_workers_left_out_after_a_failed_load_are_planned_again(
    vllm_specs: Any,
) -> None:
    """Blocks 2-3 were computed over a failed load and not saved: planned again in the
    next step that has them complete (vLLM rolled the request back to block 1 here)."""
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    r = request("r", TOKENS)
    side.after_alloc(r, ([],), 0)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    meta = side.build_meta(scheduler_output(new=[("r", table, 0, 128)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [0, 1, 2, 3]
    side.loads_failed((), (), {("r", 0, 2), ("r", 0, 3), ("gone", 0, 1)})
    meta = side.build_meta(scheduler_output(cached=[("r", 32, 32)], tables={"r": table}))
    assert meta.requests == []  # vLLM recomputes block 1; blocks 2-3 are not complete yet
    meta = side.build_meta(scheduler_output(cached=[("r", 64, 96)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [2, 3, 4]


def test_decode_saves_stop_at_the_tokens_vllm_knows(vllm_specs: Any) -> None:
    """With `save_decode_cache`, a block is saved once its tokens are known: async
    scheduling counts a step's token before it is sampled, speculative decoding schedules
    drafts that may be rejected. A block they would complete waits for its tokens."""
    side, _ = _side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), save_decode_cache=True
    )
    prompt = TOKENS[:40]
    r = request("r", list(prompt))
    side.after_alloc(r, ([1, 2],), 0)
    table = ([1, 2],)
    meta = side.build_meta(scheduler_output(new=[("r", table, 0, 40)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [0]
    r.all_token_ids = prompt + list(range(23))  # 63 known; the 64th not sampled yet
    r.num_tokens = 63
    assert (
        side.build_meta(scheduler_output(cached=[("r", 63, 1)], tables={"r": table})).requests == []
    )
    meta = side.build_meta(scheduler_output(cached=[("r", 62, 4)], tables={"r": table}))
    assert meta.requests == []  # three drafts past the known tokens
    r.all_token_ids.append(7)
    r.num_tokens = 64
    meta = side.build_meta(scheduler_output(cached=[("r", 64, 1)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [1]


def test_a_step_computing_nothing_is_marked_idle(vllm_specs: Any) -> None:
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    assert side.build_meta(scheduler_output()).idle
    busy = scheduler_output(new=[("r", ([1, 2],), 0, 64)])
    assert not side.build_meta(busy).idle


def test_lookup_failure_is_a_miss(vllm_specs: Any) -> None:
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    _store(side, pool, TOKENS, [0], 192)
    side.take_stats()
    pool.down = True
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (0, False)
    assert side.take_stats() == {
        "hit_tokens": 0,
        "tail_hit_tokens": 0,
        "lookups": 1,
        "failed_lookups": 1,
        "quarantined_keys": 0,
    }


def test_salt_and_lora_change_the_keys(vllm_specs: Any) -> None:
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    _store(side, pool, TOKENS, [0], 192)
    assert side.num_new_matched_tokens(request("a", TOKENS, cache_salt="s"), 0) == (0, False)
    # A LoRA name pointed at another adapter is another LoRA (vLLM hashes the path too).
    lora = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v1")
    _store(side, pool, TOKENS, [0], 192, writer=request("w", TOKENS, lora_request=lora))
    again = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v1")
    moved = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v2")
    assert side.num_new_matched_tokens(request("b", TOKENS, lora_request=again), 0) == (192, False)
    assert side.num_new_matched_tokens(request("c", TOKENS, lora_request=moved), 0) == (0, False)


def _image(identifier: str, offset: int, length: int) -> SimpleNamespace:
    """A multimodal input as vLLM's `MultiModalFeatureSpec` gives it."""
    return SimpleNamespace(
        identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length)
    )


def test_an_image_changes_the_keys_of_the_blocks_it_overlaps_and_later_ones(
    vllm_specs: Any,
) -> None:
    """As in vLLM's prefix cache: the blocks before an image are shared across images."""
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    cat = request("w", TOKENS, mm_features=[_image("cat", 70, 30)])  # tokens 70-99: blocks 2-3
    _store(side, pool, TOKENS, [0], 192, writer=cat)
    dog = request("a", TOKENS, mm_features=[_image("dog", 70, 30)])
    assert side.num_new_matched_tokens(dog, 0) == (64, False)
    moved = request("b", TOKENS, mm_features=[_image("cat", 71, 29)])  # same image, moved
    assert side.num_new_matched_tokens(moved, 0) == (64, False)
    assert side.num_new_matched_tokens(request("c", TOKENS), 0) == (64, False)
    again = request("d", TOKENS, mm_features=[_image("cat", 70, 30)])
    assert side.num_new_matched_tokens(again, 0) == (192, False)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(0, 99), min_size=1, max_size=150),
    st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 140), st.integers(1, 40))),
    st.lists(st.integers(0, 150)),
)
@example(list(range(64)), [("a", 3, 2)], [10])  # the block's image came with an earlier call
def test_hashes_with_images_do_not_depend_on_how_the_tokens_arrive(
    vllm_specs: Any, tokens: list[int], images: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    r = request("r", tokens, mm_features=[_image(*image) for image in images])
    whole = RequestHashes(side.plan, "", r)
    whole.cover(tokens, len(tokens))
    pieces = RequestHashes(side.plan, "", r)
    for cut in sorted(cuts):
        pieces.cover(tokens, cut)
    pieces.cover(tokens, len(tokens))
    assert pieces.for_group(32) == whole.for_group(32)
    # A block overlapping no image hashes as without images, given the same chain.
    plain = RequestHashes(side.plan, "", None)
    plain.cover(tokens, len(tokens))
    first = min((offset // 32 for _, offset, _ in images), default=len(tokens))
    assert whole.for_group(32)[:first] == plain.for_group(32)[:first]


@pytest.mark.parametrize("rewound", [True, False])
def test_a_streaming_session_names_its_next_chunk_as_a_whole_request_would(
    vllm_specs: Any, rewound: bool
) -> None:
    """A streaming-input session keeps its KV between chunks; for the next one vLLM drops
    the token it sampled last and appends the chunk's tokens and images. With async
    scheduling, the step computing that token may have run (and completed a block) before
    the stop was seen: that block holds the dropped token, and is computed again."""
    side, _ = _side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), save_decode_cache=True
    )
    table = ([1, 2, 3, 4, 5, 6, 7],)
    r = request("r", TOKENS[:60])
    side.after_alloc(r, table, 0)
    side.build_meta(scheduler_output(new=[("r", table, 0, 60)], tables={"r": table}))
    r.all_token_ids = [*TOKENS[:60], 7, 8, 9, 10]  # the last one sampled before the stop
    r.num_tokens = 64
    meta = side.build_meta(scheduler_output(cached=[("r", 60, 4)], tables={"r": table}))
    dropped = meta.requests[0].saves
    assert [ref.index for ref in dropped] == [1]
    # The next turn resumes at the safe frontier, 63 (or, had the step not run, at 64 with
    # the token kept), and appends an image's chunk.
    frontier = 63 if rewound else 64
    del r.all_token_ids[frontier:]
    r.all_token_ids += TOKENS[100:160]
    r.num_prompt_tokens = r.num_tokens = len(r.all_token_ids)
    r.mm_features = [_image("cat", frontier + 2, 24)]
    r.num_computed_tokens = frontier
    side.after_alloc(r, table, 0)
    meta = side.build_meta(scheduler_output(new=[("r", table, frontier, 60)], tables={"r": table}))
    whole = RequestHashes(side.plan, "", r)
    whole.cover(r.all_token_ids, len(r.all_token_ids) // 32 * 32)
    saved = [(ref.index, ref.block_hash) for ref in meta.requests[0].saves]
    if rewound:  # block 1 again, now holding the chunk's first token
        assert saved[0] == (1, whole.for_group(32)[1]) != (1, dropped[0].block_hash)
        saved = saved[1:]
    else:
        assert dropped[0].block_hash == whole.for_group(32)[1]
    assert saved == [(2, whole.for_group(32)[2])]
    tokens_only = RequestHashes(side.plan, "", None)
    tokens_only.cover(r.all_token_ids, 96)
    assert tokens_only.for_group(32)[2] != whole.for_group(32)[2]  # the image counts


def test_a_reset_moves_every_key_to_a_new_generation(vllm_specs: Any) -> None:
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    _store(side, pool, TOKENS, [0], 192)
    req = request("r", TOKENS)
    assert side.num_new_matched_tokens(req, 0) == (192, False)
    side.reset()
    assert side.generation == 1
    assert side.num_new_matched_tokens(req, 0) == (0, False)  # the old objects never answer
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(req, table, 0)
    meta = side.build_meta(scheduler_output(new=[("r", table, 0, 64)], tables={"r": table}))
    assert meta.generation == 1
    saved = [ref.block_hash for ref in meta.requests[0].saves]
    old = RequestHashes(side.plan, "", None)
    old.cover(TOKENS, 64)
    new = RequestHashes(side.plan, "", None, generation=1)
    new.cover(TOKENS, 64)
    assert saved == new.for_group(32)[:2] != old.for_group(32)[:2]
    pool.keys.update(side.keys.keys(0, new.for_group(32)[:2], [0]))  # saved anew
    assert side.num_new_matched_tokens(request("s", TOKENS), 0) == (64, False)


def test_kv_from_before_a_reset_is_not_saved_under_the_new_generation(vllm_specs: Any) -> None:
    """A reset while a request's hit loads in the background: the KV it then holds is
    the old generation's; saved, it would reach instances that reset as often. A request
    vLLM looks up afresh (preempted by the reset) is saved again."""
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    _store(side, pool, TOKENS, [0], 192)
    loading, preempted = request("loading", TOKENS), request("preempted", TOKENS[:100])
    table = ([1, 2, 3, 4, 5, 6, 7],)
    assert side.num_new_matched_tokens(loading, 0) == (192, False)
    side.after_alloc(loading, table, 192)
    side.after_alloc(preempted, ([8, 9, 10, 11],), 0)
    side.build_meta(scheduler_output(new=[("preempted", ([8, 9, 10, 11],), 0, 64)]))
    side.reset()
    side.after_alloc(loading, table, 0)  # its load done: vLLM schedules the rest
    assert side.num_new_matched_tokens(preempted, 0) == (0, False)  # new keys: a miss
    side.after_alloc(preempted, ([12, 13, 14, 15],), 0)
    meta = side.build_meta(
        scheduler_output(
            new=[("loading", table, 192, 8), ("preempted", ([12, 13, 14, 15],), 0, 100)]
        )
    )
    assert [(t.request_id, [ref.index for ref in t.saves]) for t in meta.requests] == [
        ("preempted", [0, 1, 2])
    ]
    assert meta.generation == 1


def _admitted(
    side: SchedulerSide,
    req: Any,
    table: tuple[list[int], ...],
    local: int = 0,
    scheduled: int | None = None,
) -> Any:
    """The metadata of the step that admits a request the pool misses, with `local` tokens
    of vLLM's own hit, scheduling `scheduled` tokens (default: the rest of its prompt)."""
    assert side.num_new_matched_tokens(req, local) == (0, False)
    side.after_alloc(req, table, 0)
    count = len(req.all_token_ids) - local if scheduled is None else scheduled
    rid = req.request_id
    return side.build_meta(scheduler_output(new=[(rid, table, local, count)], tables={rid: table}))


def _compute_after_reset(side: SchedulerSide, request_id: str, tokens: list[int]) -> None:
    """A request admitted without a hit and computed whole (its prefixes are then known
    fresh)."""
    _admitted(side, request(request_id, tokens), ([40 + b for b in range(len(tokens) // 32 + 1)],))


@pytest.mark.parametrize(
    ("resets", "computed_since", "admitted", "saved"),
    [
        (0, 0, 64, range(6)),  # before any reset, vLLM's own hit refills the pool
        (1, 0, 64, range(0)),  # a hit from before the reset: nothing computed over it
        (1, 100, 64, range(2, 6)),  # a hit computed since: the rest is saved
        (1, 100, 32, range(1, 6)),  # vLLM cut its hit after the lookup
        (1, 64, 96, range(0)),  # a hit reaching past what was computed since
        (1, 100, 70, range(0)),  # a hit where vLLM's hits never end (inside a hash unit)
        (2, 100, 64, range(0)),  # computed between the resets: the second forgot it
    ],
)
def test_after_a_reset_vllms_own_hit_and_what_it_computes_over_are_saved_only_if_fresh(
    vllm_specs: Any, resets: int, computed_since: int, admitted: int, saved: range
) -> None:
    """vLLM keeps its prefix cache when its own reset is refused (requests running): a
    local hit after the connector's reset may be KV from before it, and every block
    computed over it attends to it. Its blocks are never saved again; the blocks past
    them only when a request seen since the reset computed that prefix."""
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    for index in range(resets):
        side.reset()
        if index == 0 and computed_since:
            _compute_after_reset(side, "first", TOKENS[:computed_since])
    meta = _admitted(side, request("r", TOKENS), ([1, 2, 3, 4, 5, 6, 7],), admitted)
    assert [ref.index for t in meta.requests for ref in t.saves] == list(saved)


@pytest.mark.parametrize("fresh", [False, True])
def test_a_pool_hit_over_a_local_hit_from_before_a_reset_loads_but_saves_nothing(
    vllm_specs: Any, fresh: bool
) -> None:
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    if fresh:
        _compute_after_reset(side, "first", TOKENS[:64])
    _store(side, pool, TOKENS, [0], 128, generation=1)
    r = request("r", TOKENS)
    assert side.num_new_matched_tokens(r, 64) == (64, False)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(r, table, 64)
    meta = side.build_meta(scheduler_output(new=[("r", table, 128, 72)], tables={"r": table}))
    (transfers,) = meta.requests
    assert [ref.index for ref in transfers.loads] == [2, 3]
    assert [ref.index for ref in transfers.saves] == ([4, 5] if fresh else [])


def test_after_a_reset_a_hit_on_what_a_request_generated_since_is_fresh(
    vllm_specs: Any,
) -> None:
    """A chat's next turn hits vLLM's blocks of the last turn's answer: computed since
    the reset, so the new turn's blocks are saved."""
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    tokens = list(TOKENS[:100])
    _compute_after_reset(side, "first", tokens)
    first = side._tracked["first"].request
    for computed in range(100, 130):  # decode: one token per step
        tokens.append(TOKENS[computed])
        first.num_tokens = len(tokens)
        side.build_meta(scheduler_output(cached=[("first", computed, 1)]))
    meta = _admitted(side, request("r", TOKENS), ([1, 2, 3, 4, 5, 6, 7],), 128)
    assert [ref.index for t in meta.requests for ref in t.saves] == [4, 5]


def test_after_a_reset_a_hit_on_what_another_request_computes_in_the_same_step_is_fresh(
    vllm_specs: Any,
) -> None:
    """vLLM caches the blocks a step computes when it schedules them: a request admitted
    in that step may hit them (here 128 tokens, half of them computed in this step)."""
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    first = ([40, 41, 42, 43, 44, 45, 46],)
    _admitted(side, request("a", TOKENS), first, 0, 64)
    b = request("b", TOKENS[:128] + [7] * 72)
    assert side.num_new_matched_tokens(b, 128) == (0, False)
    second = ([40, 41, 42, 43, 1, 2, 3],)
    side.after_alloc(b, second, 0)
    output = scheduler_output(
        new=[("b", second, 128, 72)], cached=[("a", 64, 64)], tables={"a": first, "b": second}
    )
    meta = side.build_meta(output)
    assert {t.request_id: [ref.index for ref in t.saves] for t in meta.requests} == {
        "a": [2, 3],
        "b": [4, 5],
    }


def test_after_a_reset_a_hit_on_what_a_resumed_request_computes_in_the_same_step_is_fresh(
    vllm_specs: Any,
) -> None:
    """A preempted request resumes ahead of a new one in vLLM's waiting queue: the new
    one may hit the blocks the resumed one computes in that step. Both are judged in
    vLLM's order, so the resumed one's prefixes are known fresh first."""
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    first = ([40, 41, 42, 43, 44, 45, 46],)
    a = request("a", TOKENS)
    _admitted(side, a, first, 0, 64)
    # Preempted; looked up again, it hits its own 64 tokens in vLLM's prefix cache.
    assert side.num_new_matched_tokens(a, 64) == (0, False)
    side.after_alloc(a, first, 0)
    b = request("b", TOKENS[:128] + [7] * 72)
    assert side.num_new_matched_tokens(b, 128) == (0, False)
    second = ([40, 41, 42, 43, 1, 2, 3],)
    side.after_alloc(b, second, 0)
    output = scheduler_output(
        new=[("b", second, 128, 72)],
        resumed=[("a", first, 64, 64)],
        order=["a", "b"],
        tables={"a": first, "b": second},
    )
    meta = side.build_meta(output)
    assert {t.request_id: [ref.index for ref in t.saves] for t in meta.requests} == {
        "a": [2, 3],
        "b": [4, 5],
    }


def test_prefixes_a_request_skipping_vllms_prefix_cache_computes_are_not_fresh(
    vllm_specs: Any,
) -> None:
    """Prompt logprobs make vLLM skip its prefix cache: the request recomputes a prefix
    of which vLLM may still hold an older block, which it goes on serving first."""
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    skipping = request("a", TOKENS[:100], skip_reading_prefix_cache=True)
    _admitted(side, skipping, ([40, 41, 42, 43],))
    assert _admitted(side, request("b", TOKENS), ([1, 2, 3, 4, 5, 6, 7],), 64).requests == []


def test_a_request_whose_background_load_keeps_failing_is_computed_not_looked_up_for_ever(
    vllm_specs: Any,
) -> None:
    """A read failing with no object to blame (the client or the link failed) quarantines
    nothing: vLLM looks the request up again from token 0 and the pool offers the same
    hit. After a second failed load the request gets none, so vLLM computes it; another
    request, and the same id once it finished, still hit."""
    side, pool = _side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    _store(side, pool, TOKENS, [0], 128)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    r = request("r", TOKENS)
    for _ in range(2):
        assert side.num_new_matched_tokens(r, 0) == (128, True)
        side.after_alloc(r, table, 128)
        side.build_meta(scheduler_output())  # the background load goes out
        side.loads_failed(["r"], [])  # and fails, no key blamed
    assert side.num_new_matched_tokens(r, 0) == (0, False)
    assert side.num_new_matched_tokens(request("s", TOKENS), 0) == (128, True)
    side.forget("r")
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (128, True)


def test_a_tainted_request_whose_background_load_failed_stays_unsaved(
    vllm_specs: Any,
) -> None:
    """vLLM goes on from the tokens that did load, without a lookup: the request still
    computes over its vLLM-own hit from before the reset, and saves nothing; nor does a
    later request hitting those blocks."""
    side, pool = _side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    side.reset()
    _store(side, pool, TOKENS, [0], 128, generation=1)
    b = request("b", TOKENS)
    assert side.num_new_matched_tokens(b, 64) == (64, True)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(b, table, 64)
    side.build_meta(scheduler_output())  # the background load goes out
    side.loads_failed(["b"], [])  # block 3 failed: vLLM keeps 96 tokens
    b.num_computed_tokens = 96
    side.after_alloc(b, table, 0)
    meta = side.build_meta(scheduler_output(new=[("b", table, 96, 104)], tables={"b": table}))
    later = _admitted(side, request("c", TOKENS[:64] + [9] * 100), ([1, 2, 20, 21, 22, 23],), 64)
    assert [ref.index for t in [*meta.requests, *later.requests] for ref in t.saves] == []


def test_a_request_looked_up_again_after_its_stale_hit_left_saves_again(
    vllm_specs: Any,
) -> None:
    """Tainted by a local hit from before the reset, preempted, and admitted again once
    vLLM evicted that hit: it computes from its first token and saves."""
    side, _ = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    r = request("r", TOKENS)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    assert _admitted(side, r, table, 64, 64).requests == []
    assert side.num_new_matched_tokens(r, 0) == (0, False)
    side.after_alloc(r, table, 0)
    meta = side.build_meta(scheduler_output(resumed=[("r", table, 0, 200)], tables={"r": table}))
    assert [ref.index for t in meta.requests for ref in t.saves] == list(range(6))


def test_a_background_load_resumed_with_replay_saves_nothing_again(vllm_specs: Any) -> None:
    """vLLM admits a finished background load at fewer tokens than it loaded when it
    replays some (DeepSeek-V4.1): the loaded blocks are the pool's already."""
    side, pool = _side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    _store(side, pool, TOKENS, [0], 192)
    r = request("r", TOKENS)
    assert side.num_new_matched_tokens(r, 0) == (192, False)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(r, table, 192)
    side.build_meta(scheduler_output())
    r.num_computed_tokens = 128
    side.after_alloc(r, table, 0)
    meta = side.build_meta(scheduler_output(new=[("r", table, 128, 72)], tables={"r": table}))
    assert meta.requests == []


def _window_full_state(vllm_specs: Any) -> tuple[SchedulerSide, Pool]:
    kinds = [
        (["w"], attention(vllm_specs, window=64)),
        (["f"], attention(vllm_specs)),
        (["m"], mamba(vllm_specs)),
    ]
    return _side(vllm_specs, kinds, ModelShape(1, 2))


def test_hybrid_window_and_state_loads_only_what_the_boundary_needs(vllm_specs: Any) -> None:
    side, pool = _window_full_state(vllm_specs)
    _store(side, pool, TOKENS, [0], 192)
    req = request("r", TOKENS)
    assert side.num_new_matched_tokens(req, 0) == (192, False)
    tables = ([0, 0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [0, 0, 0, 0, 0, 36, 37])
    side.after_alloc(req, tables, 192)
    meta = side.build_meta(scheduler_output(new=[("r", tables, 192, 8)], tables={"r": tables}))
    (transfers,) = meta.requests
    loads = {(ref.group, ref.index, ref.block_id) for ref in transfers.loads}
    # window 64 = 2 blocks before 192 (plus none other); all 6 full blocks; the last state.
    assert loads == {(0, 4, 11), (0, 5, 12)} | {(1, i, 21 + i) for i in range(6)} | {(2, 5, 36)}
    assert transfers.saves == []  # 200 tokens complete no new block


def test_a_hit_vllm_cuts_shorter_loads_what_the_shorter_boundary_needs(vllm_specs: Any) -> None:
    """DeepSeek-V4.1's bounded replay has vLLM cut an external hit to a multiple of its
    scheduler block size (the lcm over all groups, the replayed ones too): the loads follow
    the cut, at its own window and state, even one the pool lacks (its load fails)."""
    side, pool = _window_full_state(vllm_specs)
    _store(side, pool, TOKENS, [0], 192)
    # The state at the cut (after block 3) is not in the pool.
    pool.keys.difference_update(_block_keys(side, TOKENS, 2, slice(3, 4)))
    req = request("r", TOKENS)
    assert side.num_new_matched_tokens(req, 0) == (192, False)
    tables = ([0, 0, 12, 13, 14, 15, 16], [20 + b for b in range(7)], [0, 0, 0, 33, 34, 35, 36])
    side.take_stats()
    side.after_alloc(req, tables, 128)
    assert side.take_stats()["hit_tokens"] == 128
    meta = side.build_meta(scheduler_output(new=[("r", tables, 128, 64)], tables={"r": tables}))
    (transfers,) = meta.requests
    loads = {(ref.group, ref.index, ref.block_id) for ref in transfers.loads}
    # The window's 2 blocks before 128, 4 full blocks, the state after block 3: its load
    # fails (the object is missing) and vLLM recomputes the request.
    assert loads == {(0, 2, 12), (0, 3, 13)} | {(1, i, 20 + i) for i in range(4)} | {(2, 3, 33)}
    # The step computes blocks 4 and 5 past the cut: saved as usual, in every group (the
    # window and the states at 160 and 192 are what those boundaries need).
    assert {(ref.group, ref.index) for ref in transfers.saves} == {
        (group, block) for group in range(3) for block in (4, 5)
    }


def test_an_allocation_no_hit_can_explain_is_refused(vllm_specs: Any) -> None:
    side, pool = _window_full_state(vllm_specs)
    _store(side, pool, TOKENS, [0], 192)
    tables = ([0] * 7, [20 + b for b in range(7)], [0] * 7)
    for external, why in ((200, "the hit was 192"), (100, "not a multiple of 32")):
        req = request(f"r{external}", TOKENS)
        assert side.num_new_matched_tokens(req, 0) == (192, False)
        with pytest.raises(RuntimeError, match=why):
            side.after_alloc(req, tables, external)


def test_with_pipeline_stages_a_block_hits_only_when_every_stage_holds_it(
    vllm_specs: Any,
) -> None:
    """Each stage's workers store their own layers under their `pp_rank`; the scheduler
    asks about every stage's objects of each head."""
    kinds = [(["w"], attention(vllm_specs, window=64)), (["f"], attention(vllm_specs))]
    plan = plan_groups(groups(vllm_specs, *kinds), [0, 1], ONE_RANK, pp_stages=[(0, 1), (1, 2)])
    pool = Pool()
    side = SchedulerSide(KeySpace(plan, "tiny"), ConnectorConfig(), pool.query)
    for stage, upto in ((0, 192), (1, 128)):  # the second stage saved four blocks only
        _store(side, pool, TOKENS, [0], upto, keys=KeySpace(plan, "tiny", pp_rank=stage))
    assert side.num_new_matched_tokens(request("r", TOKENS[:200]), 0) == (128, False)
    assert all("@pp_rank:" in key for key in pool.keys)
    assert len(side.keys.prefixes()) == 4  # two groups, two stages


def test_with_eagle_a_hit_drops_its_last_block_as_vllm_s_own_do(vllm_specs: Any) -> None:
    """EAGLE (and MTP) re-draft the last block of a hit: vLLM drops it from its own hits,
    and so from the pool's, which must reach one block further."""
    for use_eagle, tokens, hit in ((False, 200, 192), (True, 200, 160), (True, 192, 160)):
        side, pool = _tail_side(vllm_specs, 0, use_eagle=use_eagle)
        _store(side, pool, TOKENS, [0], 192)
        # A block-aligned prompt too: vLLM caps it at 191 tokens, but matches all six blocks
        assert side.num_new_matched_tokens(request("r", TOKENS[:tokens]), 0) == (hit, False)


def test_with_eagle_states_are_saved_where_vllm_keeps_them(vllm_specs: Any) -> None:
    """With EAGLE vLLM ends a prompt's chunks one block earlier (after 160 of 200 tokens, not
    192) and its last chunk leaves no state at the end of the block it crosses: that block
    is not saved, the states up to 160 are."""
    side, _ = _tail_side(vllm_specs, 0, use_eagle=True)
    req = request("w", TOKENS)
    side.after_alloc(req, ([], []), 0)
    tables = ([100 + b for b in range(7)], [200 + b for b in range(7)])
    saved = set()
    for output in (
        scheduler_output(new=[("w", tables, 0, 160)], tables={"w": tables}),
        scheduler_output(cached=[("w", 160, 40)], tables={"w": tables}),
    ):
        for transfers in side.build_meta(output).requests:
            saved |= {(ref.group, ref.index) for ref in transfers.saves}
    assert {index for group, index in saved if group == 1} == set(range(5))
    assert {index for group, index in saved if group == 0} == set(range(6))


def test_with_eagle_decode_saves_every_state_block_it_completes(vllm_specs: Any) -> None:
    """With `save_decode_cache` a request goes on past each block it completes, and stores
    the block EAGLE drops past it: a later request can hit at that block's end, so its
    state is saved, the prompt's last one (after 192 tokens) included."""
    side, _ = _tail_side(vllm_specs, 0, use_eagle=True, save_decode_cache=True)
    prompt = TOKENS[:192]
    req = request("r", list(prompt))
    side.after_alloc(req, ([], []), 0)
    tables = ([100 + b for b in range(9)], [200 + b for b in range(9)])
    steps = [scheduler_output(new=[("r", tables, 0, 160)], tables={"r": tables})]
    steps.append(scheduler_output(cached=[("r", 160, 32)], tables={"r": tables}))
    saved = set()
    for output in steps:
        for transfers in side.build_meta(output).requests:
            saved |= {(ref.group, ref.index) for ref in transfers.saves}
    for done in range(193, 265):  # decode, a token a step
        req.all_token_ids.append(done % 500)
        req.num_tokens = done
        output = scheduler_output(cached=[("r", done - 1, 1)], tables={"r": tables})
        for transfers in side.build_meta(output).requests:
            saved |= {(ref.group, ref.index) for ref in transfers.saves}
    assert {index for group, index in saved if group == 1} == set(range(8))
    assert {index for group, index in saved if group == 0} == set(range(8))


def test_saves_complete_blocks_once_and_skip_null_blocks(vllm_specs: Any) -> None:
    kinds = [(["w"], attention(vllm_specs, window=64)), (["m"], mamba(vllm_specs))]
    side, _ = _side(vllm_specs, kinds, ModelShape(1, 2))
    req = request("r", TOKENS)
    side.after_alloc(req, ([1, 2], [0, 3]), 0)
    step1 = ([1, 2], [0, 3])
    meta = side.build_meta(scheduler_output(new=[("r", step1, 0, 64)], tables={"r": step1}))
    saved = {(ref.group, ref.index, ref.block_id) for ref in meta.requests[0].saves}
    assert saved == {(0, 0, 1), (0, 1, 2), (1, 1, 3)}  # Mamba block 0 is null: no state
    step2 = ([1, 2, 5, 6], [0, 3, 0, 7])
    meta = side.build_meta(scheduler_output(cached=[("r", 64, 64)], tables={"r": step2}))
    saved = {(ref.group, ref.index, ref.block_id) for ref in meta.requests[0].saves}
    assert saved == {(0, 2, 5), (0, 3, 6), (1, 3, 7)}
    # Decode past the prompt saves nothing more.
    meta = side.build_meta(scheduler_output(cached=[("r", 200, 1)], tables={"r": step2}))
    assert meta.requests == []


def test_consumer_role_neither_loads_nor_saves_unless_told(vllm_specs: Any) -> None:
    kinds = [(["a"], attention(vllm_specs))]
    plan = plan_groups(groups(vllm_specs, *kinds), [0], ModelShape(1, 2))
    pool = Pool()
    _store(
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


ONE_RANK = ModelShape(tp_size=1, total_kv_heads=2)


def _tail_side(
    vllm_specs: Any,
    tail_unit: int = 8,
    shape: ModelShape = ONE_RANK,
    use_eagle: bool = False,
    local_hit_unit: int = 0,
    block_sizes: tuple[int, int] = (32, 32),
    **config: Any,
) -> tuple[SchedulerSide, Pool]:
    """Full attention beside a Mamba state, 32-token blocks (or `block_sizes`), vLLM
    hitting every `tail_unit` tokens (0: at block ends only) and hashing every
    `local_hit_unit`."""
    heads = shape.total_kv_heads // shape.tp_size or 1
    full, state = block_sizes
    kinds = [
        (["a"], attention(vllm_specs, block_size=full, heads=heads)),
        (["m"], mamba(vllm_specs, block_size=state)),
    ]
    plan = plan_groups(groups(vllm_specs, *kinds), [0, 1], shape)
    pool = Pool()
    side = SchedulerSide(
        KeySpace(plan, "tiny"),
        ConnectorConfig(**config),
        pool.query,
        tail_unit=tail_unit,
        use_eagle=use_eagle,
        local_hit_unit=local_hit_unit,
    )
    return side, pool


@pytest.mark.parametrize(("local_hit_unit", "saved"), [(8, True), (0, False)])
def test_after_a_reset_a_hit_inside_a_block_is_fresh_where_vllm_hashes(
    vllm_specs: Any, local_hit_unit: int, saved: bool
) -> None:
    """vLLM's own hits may end inside a block at its hash unit (a Mamba "align" model with
    a finer `prefix_match_unit`), whether or not prompt tails are stored: the prefixes
    remembered fresh end there too (unknown unit: only block ends, a hit inside a block is
    never known fresh)."""
    side, _ = _tail_side(vllm_specs, 0, local_hit_unit=local_hit_unit)
    side.reset()
    _admitted(
        side, request("a", TOKENS[:100]), ([100 + b for b in range(8)], [200 + b for b in range(8)])
    )
    other = ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17])
    assert bool(_admitted(side, request("b", TOKENS), other, 40).requests) is saved


def _write_prompt(
    side: SchedulerSide, pool: Pool, tokens: list[int], chunks: list[int], blocks: int = 8
) -> list:
    """Run a writer through prefill chunks ending at `chunks`; put what it saves."""
    req = request("w", tokens)
    side.after_alloc(req, ([], []), 0)
    tables = ([100 + b for b in range(blocks)], [200 + b for b in range(blocks)])
    saves = []
    done = 0
    for end in chunks:
        if done == 0:
            output = scheduler_output(new=[("w", tables, 0, end)], tables={"w": tables})
        else:
            output = scheduler_output(cached=[("w", done, end - done)], tables={"w": tables})
        for transfers in side.build_meta(output).requests:
            saves.extend(transfers.saves)
        done = end
    for ref in saves:  # every storing head's object, as each TP rank saves its own
        storing = range(side.plan.groups[ref.group].heads.storing)
        pool.keys.update(side.keys.keys(ref.group, [ref.block_hash], storing))
    return saves


@pytest.mark.parametrize("resets", [0, 1])
def test_prompt_tail_is_stored_where_vllm_ends_the_chunk_and_extends_a_later_hit(
    vllm_specs: Any, resets: int
) -> None:
    """(After a reset too: the block a tail hit ends in is the pool's, not vLLM's own.)"""
    side, pool = _tail_side(vllm_specs)
    for _ in range(resets):
        side.reset()
    prompt = TOKENS[:180]  # vLLM's tail: 179 // 8 * 8 = 176, inside block 5
    saves = _write_prompt(side, pool, prompt, [160, 176, 180])
    tails = [(ref.group, ref.index, ref.block_id, ref.tail) for ref in saves if ref.tail]
    assert tails == [(0, 5, 105, 176), (1, 5, 205, 176)]
    assert {ref.block_hash for ref in saves if ref.tail} == {
        RequestHashes(side.plan, "", None, side.generation).prefix(prompt, 176)
    }
    # A longer prompt with the same start resumes after 176 tokens, not at block 5's start.
    reader = request("r", prompt + list(range(900, 920)))
    assert side.num_new_matched_tokens(reader, 0) == (176, False)
    tables = ([10 + b for b in range(7)], [20 + b for b in range(7)])
    side.take_stats()  # the writer's lookups
    side.after_alloc(reader, tables, 176)
    assert side.take_stats() == {
        "hit_tokens": 176,
        "tail_hit_tokens": 16,
        "lookups": 0,
        "failed_lookups": 0,
        "quarantined_keys": 0,
    }
    output = scheduler_output(new=[("r", tables, 176, 16)], tables={"r": tables})
    (transfers,) = side.build_meta(output).requests
    loads = {(ref.group, ref.index, ref.block_id, ref.tail) for ref in transfers.loads}
    assert loads == {(0, b, 10 + b, 0) for b in range(5)} | {(0, 5, 15, 176), (1, 5, 25, 176)}
    # Completing block 5 saves it whole, under the whole block's hash.
    assert {(ref.group, ref.index, ref.tail) for ref in transfers.saves} == {(0, 5, 0), (1, 5, 0)}
    # The prompt's end, a multiple of 8 inside block 6, leaves a tail too.
    (transfers,) = side.build_meta(
        scheduler_output(cached=[("r", 192, 8)], tables={"r": tables})
    ).requests
    assert {(ref.group, ref.index, ref.tail) for ref in transfers.saves} == {
        (0, 6, 200),
        (1, 6, 200),
    }


def test_a_resend_of_the_same_prompt_resumes_at_its_tail(vllm_specs: Any) -> None:
    side, pool = _tail_side(vllm_specs)
    prompt = TOKENS[:180]
    _write_prompt(side, pool, prompt, [160, 176, 180])
    assert side.num_new_matched_tokens(request("again", prompt), 0) == (176, False)
    # vLLM's own cache already holds 160 tokens: the pool adds the tail's 16.
    assert side.num_new_matched_tokens(request("again", prompt), 160) == (16, False)


@pytest.mark.parametrize(
    ("stored", "prompt_tokens", "hit", "loads"),
    [
        # Blocks 0-6 stored whole: the hit reaches 224, block 5 loads whole.
        ([32 * k for k in range(1, 8)], 240, 224, {(0, 5, 15, 0), (0, 6, 16, 0), (1, 6, 26, 0)}),
        # A tail at 176 inside block 5: block 5 loads the tail's object, its only load.
        ([160, 176, 180], 180, 176, {(0, 5, 15, 176), (1, 5, 25, 176)}),
    ],
    ids=["whole", "tail"],
)
def test_the_block_vllm_s_own_hit_ends_inside_is_loaded_from_the_pool(
    vllm_specs: Any, stored: list[int], prompt_tokens: int, hit: int, loads: set[tuple]
) -> None:
    """vLLM's own hit (a Mamba "align" model hashing every 8 tokens) ends at 168, inside
    block 5, and reaches the connector so (vLLM 0.32 itself shows it only its block-aligned
    part): vLLM gives the request a copy of a block whose tokens past 168 are another
    prompt's. Where the pool's hit goes further, that block is the pool's to load, never
    left as vLLM's copy (nor a background load left with nothing to load)."""
    side, pool = _tail_side(vllm_specs, load_async=True)
    prompt = (TOKENS + list(range(900, 960)))[:prompt_tokens]
    _write_prompt(side, pool, prompt, stored)
    reader = request("r", prompt)
    assert side.num_new_matched_tokens(reader, 168) == (hit - 168, True)
    tables = ([10 + b for b in range(8)], [20 + b for b in range(8)])
    side.after_alloc(reader, tables, hit - 168)
    output = scheduler_output(new=[("r", tables, hit, 0)], tables={"r": tables})
    (transfers,) = side.build_meta(output).requests
    assert {(ref.group, ref.index, ref.block_id, ref.tail) for ref in transfers.loads} == loads


def test_a_tail_past_the_last_aligned_boundary_is_found_with_smaller_attention_blocks(
    vllm_specs: Any,
) -> None:
    """Attention blocks of 16 beside states of 64: the prompt's tail at 248 lies past its
    last aligned boundary (192) and needs attention blocks 12-14, which no aligned
    boundary does. The writer saves them and a resend asks about them, so it resumes at
    the tail, not at 192."""
    side, pool = _tail_side(vllm_specs, block_sizes=(16, 64))
    prompt = (TOKENS + list(range(900, 960)))[:250]
    saves = _write_prompt(side, pool, prompt, [64, 128, 192, 248, 250], blocks=16)
    assert sorted(ref.index for ref in saves if ref.group == 0 and not ref.tail) == list(range(15))
    assert {(ref.group, ref.index) for ref in saves if ref.tail == 248} == {(0, 15), (1, 3)}
    assert side.num_new_matched_tokens(request("again", prompt), 0) == (248, False)


@pytest.mark.parametrize("tail_unit", [0, 8])
def test_decode_saves_the_attention_blocks_a_later_boundary_needs_that_the_prompt_s_did_not(
    vllm_specs: Any, tail_unit: int
) -> None:
    """With `save_decode_cache`, attention blocks of 16 beside states of 64: blocks 5 and
    6 complete (at 96 and 112) before any boundary needs them; the boundary at 128 does.
    They are saved once decode grows the mask there, so a reader hits at 128."""
    side, pool = _tail_side(vllm_specs, tail_unit, block_sizes=(16, 64), save_decode_cache=True)
    writer = request("w", TOKENS[:100])
    side.after_alloc(writer, ([], []), 0)
    tables = ([100 + b for b in range(16)], [200 + b for b in range(4)])
    saves = []
    outputs = [scheduler_output(new=[("w", tables, 0, 100)], tables={"w": tables})]
    for done in range(100, 140):  # then one generated token a step
        outputs.append(scheduler_output(cached=[("w", done, 1)], tables={"w": tables}))
    for step, output in enumerate(outputs):
        if step:
            writer.all_token_ids.append(TOKENS[len(writer.all_token_ids)])
            writer.num_tokens += 1
        for transfers in side.build_meta(output).requests:
            saves.extend(transfers.saves)
    whole = [ref for ref in saves if not ref.tail]
    assert sorted(ref.index for ref in whole if ref.group == 0) == list(range(8))
    assert len({(ref.group, ref.index) for ref in whole}) == len(whole)  # each once
    for ref in saves:
        pool.keys.update(side.keys.keys(ref.group, [ref.block_hash], [0]))
    reader = request("r", [*TOKENS[:139], 1, 2, 3])
    assert side.num_new_matched_tokens(reader, 0) == (128, False)


def test_a_streaming_session_s_next_chunk_saves_the_attention_blocks_its_boundaries_need(
    vllm_specs: Any,
) -> None:
    """A 100-token first chunk leaves attention block 5 (tokens 80-95) unsaved: no boundary
    up to 100 needs it. The next chunk grows the prompt to 160, whose boundary at 128
    does: it is saved then."""
    side, _ = _tail_side(vllm_specs, block_sizes=(16, 64))
    session = request("w", TOKENS[:100])
    side.after_alloc(session, ([], []), 0)
    tables = ([100 + b for b in range(16)], [200 + b for b in range(4)])
    saves = []
    output = scheduler_output(new=[("w", tables, 0, 100)], tables={"w": tables})
    saves.extend(ref for t in side.build_meta(output).requests for ref in t.saves)
    assert 5 not in {ref.index for ref in saves if ref.group == 0 and not ref.tail}
    session.all_token_ids = TOKENS[:160]
    session.num_prompt_tokens = session.num_tokens = 160
    session.num_computed_tokens = 100
    side.after_alloc(session, tables, 0)
    output = scheduler_output(new=[("w", tables, 100, 60)], tables={"w": tables})
    saves.extend(ref for t in side.build_meta(output).requests for ref in t.saves)
    attention_blocks = sorted(ref.index for ref in saves if ref.group == 0 and not ref.tail)
    assert attention_blocks == list(range(9))


def test_a_tail_query_without_answer_keeps_the_aligned_hit_and_is_no_failed_lookup(
    vllm_specs: Any,
) -> None:
    side, pool = _tail_side(vllm_specs)
    prompt = TOKENS[:180]
    _write_prompt(side, pool, prompt, [160, 176, 180])
    side.take_stats()
    answered = pool.query

    def first_query_only(keys: Sequence[str]) -> list[bool] | None:
        pool.down = pool.queries > 0
        return answered(keys)

    side._query = first_query_only
    pool.queries = 0
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)
    assert pool.queries == 2
    stats = side.take_stats()
    assert (stats["lookups"], stats["failed_lookups"]) == (1, 0)


def test_a_failed_second_tail_query_keeps_the_aligned_hit(vllm_specs: Any) -> None:
    """The first tail query asks one group's partial objects, the second the others'."""
    side, pool = _tail_side(vllm_specs)
    prompt = TOKENS[:180]
    _write_prompt(side, pool, prompt, [160, 176, 180])
    answered = pool.query
    sizes: list[int] = []

    def two_queries_only(keys: Sequence[str]) -> list[bool] | None:
        sizes.append(len(keys))
        pool.down = pool.queries > 1
        return answered(keys)

    side._query = two_queries_only
    pool.queries = 0
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)
    # Candidates 176 and 168 (after the aligned 160; 179 caps them), one object each.
    assert sizes[1:] == [2, 1]
    pool.down = False
    side._query = answered
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (176, False)


def test_the_block_after_the_aligned_hit_is_asked_beyond_the_largest_candidates(
    vllm_specs: Any, monkeypatch: Any
) -> None:
    """Attention blocks readable far past a tail (a longer sibling whose states the pool
    no longer holds): the tail just past the aligned hit is still asked about."""
    monkeypatch.setattr(scheduler, "MAX_TAIL_CANDIDATES", 2)
    side, pool = _tail_side(vllm_specs)
    prompt = TOKENS[:180]
    _write_prompt(side, pool, prompt, [160, 176, 180])
    other_writer, _ = _tail_side(vllm_specs)
    sibling = [*TOKENS, *range(5000, 5050)]  # 250 tokens, the written prompt's 180 first
    saves = _write_prompt(other_writer, pool, sibling, [32 * k for k in range(1, 8)] + [250])
    evicted = [ref for ref in saves if ref.group == 1 and ref.index >= 5]
    assert [ref.index for ref in evicted] == [5, 6]  # the states after 192 and 224
    for ref in evicted:
        pool.keys -= set(side.keys.keys(1, [ref.block_hash], [0]))
    reader = request("r", [*sibling[:240], *range(9000, 9010)])  # blocks 0..6 readable
    assert side.num_new_matched_tokens(reader, 0) == (176, False)


def test_a_tail_needs_every_group_s_partial_object(vllm_specs: Any) -> None:
    side, pool = _tail_side(vllm_specs)
    prompt = TOKENS[:180]
    saves = _write_prompt(side, pool, prompt, [160, 176, 180])
    (state_tail,) = [ref for ref in saves if ref.tail and ref.group == 1]
    pool.keys -= set(side.keys.keys(1, [state_tail.block_hash], [0]))
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)


def test_at_tp2_a_tail_needs_every_storing_head_s_partial_object(vllm_specs: Any) -> None:
    """Two ranks with a KV head each and the state sharded: four objects per tail."""
    side, pool = _tail_side(vllm_specs, shape=ModelShape(tp_size=2, total_kv_heads=2))
    assert [g.heads.storing for g in side.plan.groups] == [2, 2]
    prompt = TOKENS[:180]
    saves = _write_prompt(side, pool, prompt, [160, 176, 180])
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (176, False)
    for group in (0, 1):
        (tail,) = [ref for ref in saves if ref.tail and ref.group == group]
        second_rank = set(side.keys.keys(group, [tail.block_hash], [1]))
        pool.keys -= second_rank
        assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)
        pool.keys |= second_rank


def test_no_tails_where_vllm_makes_none_or_when_turned_off(vllm_specs: Any) -> None:
    prompt = TOKENS[:180]
    for side, pool in [_tail_side(vllm_specs, 0), _tail_side(vllm_specs, prompt_tails=False)]:
        saves = _write_prompt(side, pool, prompt, [160, 176, 180])
        assert not [ref for ref in saves if ref.tail]
        assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)


def test_tails_only_at_unit_multiples_inside_the_prompt(vllm_specs: Any) -> None:
    side, pool = _tail_side(vllm_specs)
    # Chunks ending at 170 (not a multiple of 8) and 192 (a block end) leave no tail;
    # decode past the prompt neither.
    saves = _write_prompt(side, pool, TOKENS[:192], [170, 192, 193, 200])
    assert not [ref for ref in saves if ref.tail]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(1, 200), st.integers(0, 220), st.integers(1, 40))
def test_a_reader_finds_what_a_writer_stored_whole_blocks_and_tails(
    vllm_specs: Any, written_length: int, shared: int, extra: int
) -> None:
    """Oracle: the writer stores the whole blocks of its prompt and a tail where a chunk
    ends inside a block at a multiple of 8 (vLLM's checkpoint, the prompt's end); a reader
    sharing `shared` tokens with it resumes at the largest of those it may use."""
    side, pool = _tail_side(vllm_specs)
    written = TOKENS[:written_length]
    checkpoint = (written_length - 1) // 8 * 8  # where vLLM ends a chunk for the tail
    chunks = sorted({*range(32, written_length + 1, 32), checkpoint, written_length} - {0})
    _write_prompt(side, pool, written, chunks)
    shared = min(shared, written_length)
    reader = written[:shared] + [5000 + i for i in range(extra)]  # never the writer's
    cap = len(reader) - 1
    usable = min(shared, cap)
    whole = min(usable, written_length) // 32 * 32
    tails = {end for end in chunks if end % 8 == 0 and end % 32}
    expected = max([whole, *(t for t in tails if whole < t <= usable and t < whole + 32)])
    got, _ = side.num_new_matched_tokens(request("r", reader), 0)
    assert got == expected
