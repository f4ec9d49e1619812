"""The blocks computed over a failed synchronous load, followed through what each step
writes (the end to end cases, with vLLM's calls and a worker: test_failed_sync_loads)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridkv.integration.poisoned_blocks import PoisonedBlocks

SIZE = 32  # tokens per block


_spans = st.lists(
    st.lists(st.integers(1, 6), min_size=1, max_size=4).flatmap(
        lambda ids: st.tuples(
            st.just(ids),
            st.integers(0, len(ids) * SIZE).flatmap(
                lambda start: st.tuples(st.just(start), st.integers(start, len(ids) * SIZE))
            ),
        )
    ),
    max_size=4,
)


@settings(max_examples=500)
# S (first) meets no poisoned block, but holds block 2, which C writes over poisoned 1.
@example(spans=[([3, 2, 4], (64, 90)), ([1, 2], (32, 64))], poisoned={1: 0})
@given(spans=_spans, poisoned=st.dictionaries(st.integers(1, 6), st.integers(0, SIZE)))
def test_leaving_out_the_requests_that_meet_no_poisoned_block_changes_nothing(
    spans: list[tuple[list[int], tuple[int, int]]], poisoned: dict[int, int]
) -> None:
    """A step's pass over the poisoned blocks only visits the requests that may meet one
    (cheap while a poisoned block lingers); the blocks it leaves poisoned are those the
    pass over every request of the step leaves."""
    every, some = PoisonedBlocks(SIZE, 0), PoisonedBlocks(SIZE, 0)
    steps = [(ids, start, done) for ids, (start, done) in spans]
    every._poisoned, some._poisoned = dict(poisoned), dict(poisoned)
    every._heal(steps, {})
    some._heal(some._meeting_poison(steps), {})
    assert some._poisoned == every._poisoned
