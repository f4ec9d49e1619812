"""hybridkv.keys speed on one core: block hashing and key rendering for a 128k-token prompt.

Prints measured figures, the ratio to target, and the slower straightforward way of doing
the same work side by side. No assertions: speed is reported, not tested.
Runs standalone: ``python benchmarks/bench_keys.py``.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from collections.abc import Callable

from hybridkv.keys import BlockHasher, HybridKey, KeyRenderer, layout_digest

PROMPT_TOKENS = 131072
HASH_BLOCK = 16
GROUPS = 4
HEADS = 8
MIN_RUNS = 5
MIN_SECONDS = 1.0
TARGET_TOKENS_PER_S = 10e6
TARGET_KEYS_PER_S = 2e6


def best_seconds(work: Callable[[], object]) -> float:
    """Fastest run of at least MIN_RUNS filling MIN_SECONDS: least disturbed by other load."""
    best = float("inf")
    runs = 0
    began = time.perf_counter()
    while runs < MIN_RUNS or time.perf_counter() - began < MIN_SECONDS:
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best


def report(what: str, count: int, seconds: float, unit: str, target: float | None) -> None:
    rate = count / seconds
    line = f"{what:<44} {rate / 1e6:8.2f} M {unit}/s  ({seconds * 1e3:7.2f} ms)"
    if target is not None:
        line += f"  target {target / 1e6:.0f} M/s  ratio {rate / target:5.2f}x"
    print(line)


def pickled_chain(tokens: list[int]) -> list[bytes]:
    """The straightforward way: sha256 of a pickled (parent, block tokens, extra) per block."""
    parent = b""
    hashes = []
    for start in range(0, len(tokens) - HASH_BLOCK + 1, HASH_BLOCK):
        block = tuple(tokens[start : start + HASH_BLOCK])
        parent = hashlib.sha256(pickle.dumps((parent, block, None))).digest()
        hashes.append(parent)
    return hashes


def main() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(152064) for _ in range(PROMPT_TOKENS)]
    namespace = "Qwen3-Next-80B-A3B-Instruct"

    def hash_prompt() -> BlockHasher:
        hasher = BlockHasher(HASH_BLOCK, namespace)
        hasher.extend(tokens, extra={"cache_salt": "tenant-a"})
        return hasher

    print(f"hybridkv.keys, one core: {PROMPT_TOKENS} tokens, hash block {HASH_BLOCK}")
    report(
        "BlockHasher.extend",
        PROMPT_TOKENS,
        best_seconds(hash_prompt),
        "tokens",
        TARGET_TOKENS_PER_S,
    )
    report(
        "  beside: sha256(pickle(...)) per block",
        PROMPT_TOKENS,
        best_seconds(lambda: pickled_chain(tokens)),
        "tokens",
        None,
    )

    hasher = hash_prompt()
    hashes = hasher.hashes_for(HASH_BLOCK)
    layout = layout_digest(8, [([f"layers.{g}"], {"group": g}) for g in range(GROUPS)])
    renderers = [
        KeyRenderer.hybrid("Qwen3-Next-80B-A3B-Instruct", layout, group, HASH_BLOCK)
        for group in range(GROUPS)
    ]
    heads = range(HEADS)
    num_keys = GROUPS * HEADS * len(hashes)

    def render_bulk() -> list[list[str]]:
        return [renderer.render_all(hashes, heads) for renderer in renderers]

    def render_one_by_one() -> list[str]:
        return [
            str(HybridKey("Qwen3-Next-80B-A3B-Instruct", layout, group, HASH_BLOCK, h.hex(), head))
            for group in range(GROUPS)
            for h in hashes
            for head in heads
        ]

    assert sum(map(len, render_bulk())) == num_keys == 262144
    print(f"{GROUPS} groups x {HEADS} heads x {len(hashes)} blocks = {num_keys} keys")
    report("KeyRenderer.render_all", num_keys, best_seconds(render_bulk), "keys", TARGET_KEYS_PER_S)
    report(
        "  beside: str(HybridKey(...)) per key",
        num_keys,
        best_seconds(render_one_by_one),
        "keys",
        None,
    )


if __name__ == "__main__":
    main()
