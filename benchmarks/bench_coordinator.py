"""find_hit on a 131072-token request over four KV cache groups, next to a naive
boundary-by-boundary search, and how many blocks `lookup_mask` asks the store about.

Runs standalone (`python benchmarks/bench_coordinator.py [--repeats N]`) or under
`nox -s bench`. Prints figures and ratios to the 2 ms target; asserts nothing on time.
The store query is excluded: readability is built once, as the integration builds it from
one batched answer.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

from hybridkv.coordinator import (
    Coordinator,
    FullAttention,
    GroupKind,
    RecurrentState,
    SlidingWindow,
    marked_blocks,
    scatter_readable,
)

NUM_TOKENS = 131072
TARGET_MS = 2.0
GROUPS: list[GroupKind] = [
    FullAttention(16),
    FullAttention(64),
    SlidingWindow(16, window=4096),
    RecurrentState(64),
]


def time_ms(call: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median and best wall time of one call, in ms."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(samples), min(samples)


def naive_hit(coord: Coordinator, max_tokens: int, readable: Sequence[Sequence[bool]]) -> int:
    """Every boundary from the top down, every needed block of every group checked."""
    for tokens in range(coord.max_boundary(max_tokens), 0, -coord.alignment):
        needed = coord.load_mask(tokens)
        if all(
            block < len(readable[group]) and readable[group][block]
            for group, mask in enumerate(needed)
            for block, need in enumerate(mask)
            if need
        ):
            return tokens
    return 0


def readable_after_query(
    coord: Coordinator, max_tokens: int, miss_token: int | None
) -> tuple[tuple[bool, ...], ...]:
    """What one batched store query gives back: asked blocks readable except the block of
    each group holding `miss_token`; blocks not asked are unreadable."""
    mask = coord.lookup_mask(max_tokens)
    answers = [
        miss_token is None or block != miss_token // coord.groups[group].block_size
        for group, block in marked_blocks(mask)
    ]
    return scatter_readable(mask, answers)


def bench_find_hit(repeat: int) -> None:
    coord = Coordinator(GROUPS)
    max_tokens = NUM_TOKENS - 1  # vLLM must compute at least one token
    names = ", ".join(repr(kind) for kind in GROUPS)
    print(f"find_hit, {NUM_TOKENS} tokens, alignment {coord.alignment}, groups: {names}")
    for label, miss in [("all readable", None), ("miss in the middle", NUM_TOKENS // 2 + 100)]:
        readable = readable_after_query(coord, max_tokens, miss)
        hit = coord.find_hit(max_tokens, readable)
        median, best = time_ms(functools.partial(coord.find_hit, max_tokens, readable), repeat)
        naive_ms, _ = time_ms(functools.partial(naive_hit, coord, max_tokens, readable), 1)
        assert naive_hit(coord, max_tokens, readable) == hit.tokens, "fast and naive disagree"
        print(
            f"  {label:<19} hit {hit.tokens:>6} tokens  median {median:7.3f} ms"
            f" (best {best:.3f})  = {median / TARGET_MS:.3f}x the {TARGET_MS:g} ms target;"
            f"  naive {naive_ms:9.1f} ms = {naive_ms / median:,.0f}x slower"
        )


def count(masks: tuple[tuple[bool, ...], ...]) -> int:
    return sum(sum(mask) for mask in masks)


def bench_masks() -> None:
    print(f"blocks asked by lookup_mask / stored by store_mask vs all blocks, {NUM_TOKENS} tokens")
    shapes: list[tuple[str, Coordinator]] = [
        ("issue shape (above)", Coordinator(GROUPS)),
        ("same, retention_interval=64", Coordinator(GROUPS, retention_interval=64)),
        (
            "Full16 + SWA(16, 512) + State16, alignment 256",
            Coordinator(
                [FullAttention(16), SlidingWindow(16, 512), RecurrentState(16)], alignment=256
            ),
        ),
        (
            "DeepSeek-V4: Full16 + Full32 + SWA(16, 16)",
            Coordinator([FullAttention(16), FullAttention(32), SlidingWindow(16, 16)]),
        ),
    ]
    for label, coord in shapes:
        every = sum((NUM_TOKENS - 1) // kind.block_size for kind in coord.groups)
        asked = count(coord.lookup_mask(NUM_TOKENS - 1))
        stored = count(coord.store_mask(NUM_TOKENS))
        lookup_ms, _ = time_ms(functools.partial(coord.lookup_mask, NUM_TOKENS - 1), 5)
        print(
            f"  {label:<47} asked {asked:>6}/{every} = {asked / every:6.1%}"
            f"  stored {stored:>6} = {stored / every:6.1%}  (lookup_mask {lookup_ms:.2f} ms)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per figure")
    args = parser.parse_args()
    bench_find_hit(args.repeats)
    bench_masks()


if __name__ == "__main__":
    main()
