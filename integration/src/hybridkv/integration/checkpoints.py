"""Mamba prefill checkpoints: a state block that does not hold the state at its own end.

The connector names a recurrent-state block by its end boundary (block p: the state after
(p + 1) x block size tokens). vLLM 0.32's Mamba2 and KDA layers
(`num_prefill_checkpoint_blocks > 0`, "align" mode) also write, in a prefill chunk, the
state at an inner position (the last hash-unit multiple before the chunk end, one more
unit back under EAGLE's block drop) into the block before the chunk's last one. Where
that position is not the block's end (hash units smaller than the block, or EAGLE), the
block must not be stored under its boundary's key: a reader would take a later (or
earlier) state for it; it is stored as the prompt tail of that position instead, which is
where vLLM's own prefix cache hits it. The positions come from vLLM's own
`compute_mamba_prefill_checkpoints`, the rule its kernels write by, so the two never
disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.integration.groups import KVPlan


@dataclass(frozen=True)
class CheckpointRule:
    """What vLLM's rule needs of one Mamba group: its block size and checkpoint alignment."""

    block_size: int
    alignment: int | None


@dataclass(frozen=True)
class Checkpoint:
    """A chunk left block `block` holding the state after `tokens` tokens."""

    tokens: int
    block: int

    def is_block_end(self, block_size: int) -> bool:
        """Whether that is the state the block stands for (the one at its end)."""
        return self.tokens == (self.block + 1) * block_size


@dataclass(frozen=True)
class PrefillCheckpoints:
    """The Mamba groups (plan group -> rule) whose prefill chunks write inner checkpoints."""

    rules: Mapping[int, CheckpointRule]
    hash_block_size: int
    alignment_tokens: int
    drop_eagle_block: bool

    def written(self, group: int, query_start: int, query_end: int) -> Checkpoint | None:
        """Where the chunk [query_start, query_end) writes plan group `group`'s checkpoint,
        if anywhere (perhaps at its block's end)."""
        rule = self.rules.get(group)
        # vLLM's rule puts a checkpoint a unit or more past the chunk's start, never in a
        # decode step: those skip the call (every step of every running request asks).
        if rule is None or query_end - query_start <= self.hash_block_size:
            return None
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        (offset,), (column,) = compute_mamba_prefill_checkpoints(
            [query_end],
            [query_end - query_start],
            self.hash_block_size,
            rule.block_size,
            rule.alignment,
            self.drop_eagle_block,
            self.alignment_tokens,
        )
        return None if column < 0 else Checkpoint(query_start + offset, int(column))


def prefill_checkpoints(
    vllm_config: Any, kv_cache_config: Any, plan: KVPlan
) -> PrefillCheckpoints | None:
    """The checkpoint rules of the plan's Mamba groups, None when no group writes any."""
    rules = {}
    for index, group in enumerate(plan.groups):
        spec = kv_cache_config.kv_cache_groups[group.vllm_group_id].kv_cache_spec
        if (
            getattr(spec, "num_prefill_checkpoint_blocks", 0) > 0
            and getattr(spec, "mamba_cache_mode", None) == "align"
        ):
            rules[index] = CheckpointRule(spec.block_size, spec.prefill_checkpoint_alignment)
    if not rules:
        return None
    hash_block_size = kv_cache_config.hash_block_size or plan.hash_block_size
    return PrefillCheckpoints(
        rules,
        hash_block_size=hash_block_size,
        alignment_tokens=kv_cache_config.cache_hit_alignment_tokens or hash_block_size,
        drop_eagle_block=drops_eagle_block(vllm_config),
    )


def drops_eagle_block(vllm_config: Any) -> bool:
    """Whether vLLM drops the last block of a prefix hit (speculative decoding on the target
    model's hidden states: EAGLE, MTP...) so that the draft head recomputes it."""
    speculative = vllm_config.speculative_config
    return speculative is not None and bool(speculative.use_eagle_block_drop())
