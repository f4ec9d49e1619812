"""Worked examples with hand-checked numbers, and the errors bad input gets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from hybridkv.coordinator import (
    ChunkedLocal,
    Coordinator,
    FullAttention,
    RecurrentState,
    SlidingWindow,
    marked_blocks,
    scatter_readable,
)

T, F = True, False


def blocks(mask: tuple[bool, ...]) -> list[int]:
    return [index for index, marked in enumerate(mask) if marked]


def test_each_kind_needs_what_the_issue_says() -> None:
    coord = Coordinator(
        [
            FullAttention(16),
            SlidingWindow(16, window=40),  # ceil(39 / 16) = 3 blocks
            ChunkedLocal(16, chunk=64),
            RecurrentState(16),
        ],
        alignment=16,
    )
    full, window, chunked, state = coord.load_mask(96)
    assert blocks(full) == [0, 1, 2, 3, 4, 5]
    assert blocks(window) == [3, 4, 5]
    assert blocks(chunked) == [4, 5]  # tokens 64..95
    assert blocks(state) == [5]
    assert blocks(coord.load_mask(128)[2]) == []  # a chunk boundary needs nothing
    assert blocks(coord.load_mask(32)[1]) == [0, 1]  # fewer when T is small
    assert coord.load_mask(0) == ((), (), (), ())


def test_each_kind_answers_the_scheduler_s_questions_itself() -> None:
    """vLLM keeps every block of full attention while a request runs, and frees windows,
    chunks and states behind it; only a recurrent state's block holds one state."""
    kinds = [FullAttention(16), SlidingWindow(16, window=40), ChunkedLocal(16, 64)]
    kinds.append(RecurrentState(16))
    assert [kind.keeps_passed_blocks for kind in kinds] == [True, False, False, False]
    assert [kind.holds_state for kind in kinds] == [False, False, False, True]


def test_chunk_not_a_multiple_of_the_block_needs_the_block_holding_its_start() -> None:
    coord = Coordinator([ChunkedLocal(16, chunk=40)], alignment=16)
    assert blocks(coord.load_mask(64)[0]) == [2, 3]  # chunk starts at token 40, block 2


def test_default_alignment_is_the_lcm_of_block_sizes_and_chunks() -> None:
    assert Coordinator([FullAttention(16), SlidingWindow(32, 100)]).alignment == 32
    assert Coordinator([FullAttention(48), RecurrentState(64)]).alignment == 192
    assert Coordinator([FullAttention(16), ChunkedLocal(16, chunk=8192)]).alignment == 8192
    assert Coordinator([FullAttention(32), ChunkedLocal(16, chunk=40)]).alignment == 160


def test_explicit_alignment_may_land_inside_a_chunk() -> None:
    coord = Coordinator([FullAttention(16), ChunkedLocal(16, chunk=64)], alignment=16)
    assert blocks(coord.load_mask(96)[1]) == [4, 5]


def test_hit_stops_at_the_first_boundary_some_group_cannot_serve() -> None:
    coord = Coordinator([FullAttention(16), SlidingWindow(16, window=33), RecurrentState(64)])
    full = [T] * 20
    window = [T] * 20
    state = [T, F, T, T, F]  # no snapshot at tokens 128 and 320
    assert coord.find_hit(320, [full, window, state]).tokens == 256
    window[14] = F  # boundary 256 needs window blocks 14, 15
    assert coord.find_hit(320, [full, window, state]).tokens == 192
    full[3] = F
    assert coord.find_hit(320, [full, window, state]).tokens == 0
    assert coord.find_hit(320, lambda group, block: True).tokens == 320


def test_max_tokens_caps_the_hit() -> None:
    coord = Coordinator([FullAttention(16)])
    assert coord.find_hit(63, [[T] * 10]).tokens == 48
    assert coord.find_hit(64, [[T] * 10]).tokens == 64
    assert coord.find_hit(0, [[T] * 10]) == coord.find_hit(0, [[]])


def test_deepseek_v4_shape() -> None:
    """Full attention 16 tokens/block, compressed KV 32 tokens/block, window 16."""
    coord = Coordinator([FullAttention(16), FullAttention(32), SlidingWindow(16, window=16)])
    assert coord.alignment == 32
    full = [T] * 8
    compressed = [T, T, T, F]
    window = [F, F, F, F, F, T, F, T]  # window 16 needs one block: the one before T
    hit = coord.find_hit(127, [full, compressed, window])
    assert hit.tokens == 96
    assert [blocks(mask) for mask in hit.load_masks] == [[0, 1, 2, 3, 4, 5], [0, 1, 2], [5]]


def test_eagle_needs_the_block_past_the_hit_and_loads_only_up_to_it() -> None:
    """vLLM drops the last matched block for EAGLE: a run of 4 readable blocks gives 48
    tokens, not 64, and a window group must have its block at the boundary too."""
    coord = Coordinator([FullAttention(16), SlidingWindow(16, window=17)], use_eagle=True)
    hit = coord.find_hit(1000, [[T] * 4, [F, F, T, T]])
    assert hit.tokens == 48
    assert [blocks(mask) for mask in hit.load_masks] == [[0, 1, 2], [2]]
    # The dropped block must lie under the cap: 64 tokens cap -> boundary 48 at most.
    assert coord.find_hit(64, [[T] * 8, [T] * 8]).tokens == 48
    assert coord.max_boundary(64) == 48


def test_eagle_with_coarse_alignment_moves_back_a_whole_step() -> None:
    coord = Coordinator([FullAttention(16), RecurrentState(64)], use_eagle=True)
    assert coord.find_hit(1000, [[T] * 8, [T] * 2]).tokens == 64  # block 4 is readable
    assert coord.find_hit(1000, [[T] * 4, [T] * 2]).tokens == 0  # 64 matched, dropped
    # Recurrent state has no draft layers: it needs nothing past the boundary.
    assert coord.find_hit(1000, [[T] * 9, [T, F]]).tokens == 64
    assert coord.find_hit(1000, [[T] * 9, [F, T]]).tokens == 128


def test_eagle_drops_a_block_only_in_the_draft_head_s_groups() -> None:
    """DeepSeek-V4 / Kimi MTP: vLLM marks the drafter's groups (`is_eagle_group`) and only
    their hits lose a block. A drafter in 64-token blocks beside a 256-token target group,
    1000 tokens: the drafter's block after 768 lies within them, so the hit is 768; with
    every group dropping, the target's would not (768 + 256 > 1000): 512."""
    kinds = [FullAttention(256), FullAttention(64)]
    readable = [[T] * 3, [T] * 15]
    drafter = Coordinator(kinds, use_eagle=True, eagle_groups=[1])
    assert drafter.find_hit(999, readable, known_tokens=1000).tokens == 768
    assert drafter.eagle_tokens == 64
    every = Coordinator(kinds, use_eagle=True)
    assert every.find_hit(999, readable, known_tokens=1000).tokens == 512
    # The drafter's block past the boundary must be readable; the target's need not be.
    assert drafter.lookup_mask(999, 1000) == ((T,) * 3, (T,) * 13 + (F, F))
    assert drafter.find_hit(999, [[T] * 3, [T] * 12], known_tokens=1000).tokens == 512
    # Naming no group: nothing drops (the drafter's groups are not prefix-cacheable).
    none = Coordinator(kinds, use_eagle=True, eagle_groups=())
    assert none.find_hit(999, readable, 1000).tokens == 768
    assert none.eagle_tokens == 0
    assert none.find_hit(999, [[T] * 3, [T] * 12], 1000).tokens == 768
    # Any iterable names them, a generator too (checked and kept in one pass).
    marked = Coordinator(kinds, use_eagle=True, eagle_groups=(i for i in [1]))
    assert marked.find_hit(999, readable, known_tokens=1000).tokens == 768
    assert marked.eagle_tokens == 64


def test_store_mask_keeps_state_snapshots_only_at_aligned_boundaries() -> None:
    coord = Coordinator(
        [FullAttention(16), RecurrentState(16), SlidingWindow(16, 17)], alignment=64
    )
    full, state, window = coord.store_mask(200)
    assert blocks(full) == list(range(12))
    assert blocks(state) == [3, 7, 11]
    assert blocks(window) == [3, 7, 11]
    assert coord.lookup_mask(200) == (full, state, window)


def test_retention_thins_snapshots_but_keeps_the_replay_boundaries() -> None:
    coord = Coordinator([FullAttention(64), RecurrentState(64)], retention_interval=4)
    full, state = coord.store_mask(64 * 10 + 5)
    assert blocks(full) == list(range(10))
    assert blocks(state) == [3, 7, 9]  # boundaries 256, 512 and the tail 640
    _, state = coord.store_mask(64 * 10)
    assert blocks(state) == [3, 7, 8, 9]  # resend caps at 639 -> boundary 576 too
    _, asked = coord.lookup_mask(64 * 9 + 3)
    assert blocks(asked) == list(range(9))  # another request's replay boundary can be any


def test_under_retention_a_longer_request_resumes_where_a_shorter_one_ended() -> None:
    """A multi-turn conversation: the first turn kept its end (100 tokens: boundary 96)
    though 96 is no retained boundary; the next, longer turn finds it."""
    coord = Coordinator([FullAttention(16), SlidingWindow(16, window=16)], retention_interval=4)
    stored = coord.store_mask(100)
    mask = coord.lookup_mask(199, 200)
    answers = [block < len(stored[g]) and stored[g][block] for g, block in marked_blocks(mask)]
    assert coord.find_hit(199, scatter_readable(mask, answers), 200).tokens == 96


def test_under_retention_with_eagle_a_resend_keeps_the_blocks_of_its_hit() -> None:
    """A resend of a stored 64-token prompt asks up to 63 tokens knowing all 64, so EAGLE's
    dropped block lies among known ones and it resumes at 48 (not 32, as a request knowing
    only 63 would): retention keeps the window blocks 48 needs, and no more."""
    coord = Coordinator(
        [FullAttention(16), SlidingWindow(16, window=16)],
        alignment=16,
        use_eagle=True,
        retention_interval=3,
    )
    full, window = coord.store_mask(64)
    assert blocks(full) == [0, 1, 2, 3]
    assert blocks(window) == [2, 3]
    assert coord.find_hit(63, [list(full), list(window)], 64).tokens == 48


def test_with_eagle_a_block_aligned_prompt_loses_one_block_as_in_vllm() -> None:
    """vLLM's hybrid coordinator caps a 64-token prompt's hit at 63 tokens but matches the
    dropped block among all four full blocks: 48, not 32 (its single-group one, matching
    nothing past the cap, gives 32; 48 is safe: the stored dropped block shows the writer
    saw the tokens after 48)."""
    coord = Coordinator([FullAttention(16)], use_eagle=True)
    assert (coord.eagle_tokens, Coordinator([FullAttention(16)]).eagle_tokens) == (16, 0)
    readable = [[True] * 4]
    assert coord.find_hit(63, readable, known_tokens=64).tokens == 48
    assert coord.find_hit(63, readable).tokens == 32  # nothing known past the cap
    assert blocks(coord.lookup_mask(63, 64)[0]) == [0, 1, 2, 3]
    assert coord.store_mask(64) == ((True,) * 4,)
    with pytest.raises(ValueError, match="known_tokens 62 is below max_tokens 63"):
        coord.find_hit(63, readable, known_tokens=62)


def test_lookup_asks_sparse_groups_only_for_what_a_boundary_could_need() -> None:
    coord = Coordinator([FullAttention(64), SlidingWindow(16, window=17), RecurrentState(16)])
    full, window, state = coord.lookup_mask(256)
    assert blocks(full) == [0, 1, 2, 3]
    assert blocks(window) == [3, 7, 11, 15]
    assert blocks(state) == [3, 7, 11, 15]


class NotAKind:
    block_size = 16


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: FullAttention(0), "block_size must be a positive int"),
        (lambda: FullAttention(True), "block_size must be a positive int"),
        (lambda: SlidingWindow(16, window=0), "window must be a positive int"),
        (lambda: ChunkedLocal(16, chunk=-64), "chunk must be a positive int"),
        (lambda: RecurrentState(16.0), "block_size must be a positive int"),  # type: ignore[arg-type]
        (lambda: Coordinator([]), "at least one"),
        (lambda: Coordinator([NotAKind()]), r"groups\[0\]: unknown group kind NotAKind"),  # type: ignore[list-item]
        (
            lambda: Coordinator([FullAttention(16), FullAttention(64)], alignment=32),
            r"alignment 32 is not a multiple of groups\[1\].block_size 64",
        ),
        (lambda: Coordinator([FullAttention(16)], alignment=0), "alignment must be a positive"),
        (lambda: Coordinator([FullAttention(16)], use_eagle=1), "use_eagle must be a bool"),  # type: ignore[arg-type]
        (
            lambda: Coordinator([FullAttention(16)], eagle_groups=[0]),
            "eagle_groups has no effect without use_eagle",
        ),
        (
            lambda: Coordinator([FullAttention(16)], use_eagle=True, eagle_groups=[1]),
            "eagle_groups: 1 is not the index of one of the 1 groups",
        ),
        (
            lambda: Coordinator([FullAttention(16)], use_eagle=True, eagle_groups=[True]),
            "eagle_groups: True is not",
        ),
        (lambda: Coordinator([RecurrentState(16)], retention_interval=0), "retention_interval"),
        (lambda: Coordinator([FullAttention(16)], retention_interval=2), "has no effect"),
    ],
)
def test_bad_configuration_is_refused_by_name(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_a_prompt_tail_extends_the_hit_inside_the_next_block() -> None:
    """Qwen3-Next on vLLM: attention and state share 640-token blocks; vLLM's own prefix
    cache hits at 64-token units, and a 2500-token prompt leaves its state at 2496."""
    coord = Coordinator([FullAttention(640), RecurrentState(640)])
    every = [[T] * 4, [T] * 4]
    assert coord.tail_boundaries(1920, 2499, 64, every, 10) == list(range(2496, 1920, -64))
    assert coord.tail_boundaries(1920, 2499, 64, every, 3) == [2496, 2432, 2368]
    assert coord.tail_boundaries(1920, 1999, 64, every, 10) == [1984]
    assert coord.tail_boundaries(1920, 1920, 64, every, 10) == []
    assert coord.tail_boundaries(1920, 2499, 64, every, 0) == []
    assert coord.tail_boundaries(0, 200, 64, [[], []], 10) == [192, 128, 64]
    hit = coord.tail_hit(2496)
    assert hit.tokens == 2496
    full, state = hit.load_masks
    assert blocks(full) == [0, 1, 2, 3]  # block 3 is the partial one
    assert blocks(state) == [3]  # the state after exactly 2496 tokens
    assert coord.is_tail_boundary(2496)
    assert not coord.is_tail_boundary(2560)
    # EAGLE's dropped block cannot reach past a partial one.
    eagle = Coordinator([FullAttention(640), RecurrentState(640)], use_eagle=True)
    assert eagle.tail_boundaries(1920, 2499, 64, every, 10) == []


def test_a_tail_can_lie_blocks_past_the_aligned_hit() -> None:
    """Mamba2 on vLLM with 64-token blocks and a 16-token unit: a 1200-token prompt in one
    chunk leaves no state at any block end, only its checkpoint after 1184 tokens; the
    attention blocks before it are all there. Candidates stop below the first attention
    block missing and skip block ends, the largest `limit` first."""
    coord = Coordinator([FullAttention(64), RecurrentState(64)])
    attention = [T] * 18  # blocks 0..17: tokens 0..1151
    readable = [attention, [F] * 18]
    assert coord.find_hit(1199, readable).tokens == 0  # no state at any block end
    tails = coord.tail_boundaries(0, 1199, 16, readable, 4)
    assert tails == [1184, 1168, 1136, 1120]  # 1200 > max, 1152 a block end
    attention, state = coord.tail_hit(tails[0]).load_masks
    assert blocks(attention) == list(range(19))  # 18 whole, the partial 18
    assert blocks(state) == [18]
    assert coord.partial_groups(1184) == (0, 1)
    # A hole in the attention blocks: nothing past it, the search jumps straight below.
    holed = [[T] * 5 + [F] + [T] * 12, [F] * 18]
    assert coord.tail_boundaries(0, 1199, 16, holed, 4) == [368, 352, 336, 304]
    assert coord.tail_boundaries(0, 1199, 16, lambda g, b: g == 0 and b != 5, 2) == [
        368,
        352,
    ]
    # A unit that some block size divides leaves no boundary inside a block of every group.
    fine = Coordinator([FullAttention(16), RecurrentState(64)])
    assert fine.tail_boundaries(0, 1 << 17, 16, [[T] * 8192, []], 4) == []


def test_a_tail_inside_a_smaller_block_stops_before_it() -> None:
    coord = Coordinator([FullAttention(16), SlidingWindow(64, window=100)])
    readable = [[T] * 12, [T] * 3]
    assert coord.tail_boundaries(64, 80, 4, readable, 8) == [76, 72, 68]  # in block 4
    window = coord.tail_hit(76).load_masks[1]
    assert blocks(window) == [0, 1]  # tokens 0..75, the partial block 1 included
    assert coord.partial_groups(76) == (0, 1)
    assert not coord.is_tail_boundary(80)  # a whole 16-token block ends there
    # A window of one token sees no earlier token: no partial object of its own.
    single = Coordinator([FullAttention(16), SlidingWindow(64, window=1)])
    assert single.partial_groups(76) == (0,)
    assert blocks(single.tail_hit(76).load_masks[1]) == []
    # Nor does a chunk's first token (the chunk starts at 24, inside block 1).
    chunked = Coordinator([FullAttention(16), ChunkedLocal(16, chunk=24)])
    assert chunked.partial_groups(24) == (0,)
    assert chunked.partial_groups(40) == (0, 1)


def test_a_tail_past_the_last_aligned_boundary_finds_its_whole_blocks() -> None:
    """Blocks of 64 beside states of 128: a 500-token prompt's last aligned boundary is
    384, but its tail at 496 needs attention blocks 0-6. The store keeps block 6 and the
    lookup asks about it, so a resend resumes at 496, not at 432."""
    coord = Coordinator([FullAttention(64), RecurrentState(128)])
    assert blocks(coord.store_mask(500)[0]) == list(range(6))  # aligned boundaries only
    stored = coord.store_mask(500, tail_unit=16)
    assert blocks(stored[0]) == list(range(7))
    assert blocks(stored[1]) == [0, 1, 2]  # snapshots at 128, 256, 384; tails are objects
    mask = coord.lookup_mask(499, 500, tail_unit=16)
    assert blocks(mask[0]) == list(range(7))
    answers = [stored[group][block] for group, block in marked_blocks(mask)]
    readable = scatter_readable(mask, answers)
    hit = coord.find_hit(499, readable, 500)
    assert hit.tokens == 384
    assert coord.tail_boundaries(384, 499, 16, readable, 3) == [496, 480, 464]
    # Past the last aligned boundary (640), the tail at 752 needs block 10; no tail is
    # stored past the prompt (500), so a decode up to 760 tokens need not keep it.
    assert blocks(coord.store_mask(760, tail_unit=16)[0]) == list(range(11))
    assert blocks(coord.store_mask(760, tail_unit=16, tail_tokens=500)[0]) == list(range(10))


def test_bad_calls_are_refused_by_name() -> None:
    coord = Coordinator([FullAttention(16), RecurrentState(64)])
    with pytest.raises(ValueError, match="tokens 80 is not a multiple of the alignment 64"):
        coord.load_mask(80)
    with pytest.raises(ValueError, match="max_tokens must be a non-negative int"):
        coord.find_hit(-1, [[], []])
    with pytest.raises(ValueError, match="max_tokens must be a non-negative int"):
        coord.lookup_mask(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="readable has 1 entries for 2 groups"):
        coord.find_hit(128, [[T] * 8])
    with pytest.raises(ValueError, match=r"readable\[1\] must hold bools"):
        coord.find_hit(128, [[T] * 8, [None, None]])  # type: ignore[list-item]
    with pytest.raises(
        ValueError, match=r"readable\[1\] must be a sequence of bools, got a NoneType"
    ):
        coord.find_hit(128, [[T] * 8, None])  # type: ignore[list-item]
    with pytest.raises(
        ValueError, match="readable must be a callable or one sequence of bools per"
    ):
        coord.find_hit(128, {0: [T] * 8, 1: [T] * 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        coord.store_mask(-1)
    with pytest.raises(ValueError, match="tail_unit must be a non-negative int"):
        coord.lookup_mask(200, tail_unit=-4)
    with pytest.raises(ValueError, match="tail_tokens must be a non-negative int"):
        coord.store_mask(200, 4, tail_tokens=-1)
    with pytest.raises(ValueError, match="hit 80 is not a multiple of the alignment 64"):
        coord.tail_boundaries(80, 200, 4, [[], []], 1)
    with pytest.raises(ValueError, match="tokens 128 does not end inside a block of every"):
        coord.partial_groups(128)
    with pytest.raises(ValueError, match="unit must be a positive int"):
        coord.tail_boundaries(64, 200, 0, [[], []], 1)
    with pytest.raises(ValueError, match="limit must be a non-negative int"):
        coord.tail_boundaries(64, 200, 4, [[], []], -1)
    with pytest.raises(ValueError, match=r"tokens 96 does not end inside a block of every"):
        coord.tail_hit(96)
    with pytest.raises(ValueError, match="tokens must be a non-negative int"):
        coord.is_tail_boundary(-1)


@pytest.mark.parametrize("answer", [-1, 2, None, "yes"])
def test_a_store_answer_that_is_not_a_bool_is_refused_not_counted_readable(
    answer: object,
) -> None:
    mask = Coordinator([FullAttention(16), RecurrentState(16)]).lookup_mask(63)
    answers = [True] * len(marked_blocks(mask))
    answers[2] = answer  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=rf"answers must hold bools, got {answer!r} at index 2"):
        scatter_readable(mask, answers)


@pytest.mark.parametrize("answer", [-1, 2, None])
def test_a_readable_callable_must_answer_true_or_false(answer: object) -> None:
    coord = Coordinator([FullAttention(16)])
    message = rf"readable\(0, 2\) must return True or False, got {answer}"
    with pytest.raises(ValueError, match=message):
        coord.find_hit(63, lambda group, block: block < 2 or answer)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    "column",
    [[T, T, 2, T], [T, None], "", b"", {1}, frozenset({0, 1}), {0: T, 1: T}],
    ids=["two", "none", "str", "bytes", "set", "frozenset", "mapping"],
)
def test_a_readable_column_must_be_a_sequence_of_bools(column: Any) -> None:
    """A set of block indices or a mapping would be read in iteration order: {1} as
    "block 0 readable"."""
    coord = Coordinator([FullAttention(16), RecurrentState(16)])
    with pytest.raises(ValueError, match=r"readable\[1\] must "):
        coord.find_hit(63, [[T] * 4, column])


def test_one_and_zero_answer_as_true_and_false() -> None:
    """A store's 1/0 existence answers mean what True/False do (its -1 is refused above)."""
    coord = Coordinator([FullAttention(16), RecurrentState(16)])
    mask = coord.lookup_mask(63)
    flat = [1] * len(marked_blocks(mask))
    assert scatter_readable(mask, flat) == scatter_readable(mask, [True] * len(flat))
    assert coord.find_hit(63, lambda group, block: 1).tokens == 48


def test_a_custom_kind_needing_a_negative_token_is_refused() -> None:
    @dataclass(frozen=True, slots=True)
    class Broken(FullAttention):
        def first_token_needed(self, tokens: int) -> int:
            return -16

    with pytest.raises(ValueError, match=r"Broken.first_token_needed\(64\) returned -16"):
        Coordinator([Broken(16)]).find_hit(64, [[True, True, True, False]])
