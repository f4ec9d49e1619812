"""Object keys of a request's blocks: hybridkv's own hashes, rendered per group and head.

Hashes come from `hybridkv.keys.BlockHasher` (SHA-256 chains over token ids and extras), not
from vLLM's block hashes, so two instances agree without sharing `PYTHONHASHSEED`. The
hasher's namespace carries the layout digest, so incompatible layouts never share a hash
even in the single-group key format, which has no layout field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.integration.groups import KVPlan
from hybridkv.keys import BlockHasher, KeyRenderer


def request_extra(request: Any) -> object:
    """What besides the tokens makes this request's KV differ (LoRA, salt, multimodal).

    Request-level, so it is passed with every `extend` call and hashes do not depend on how
    tokens arrived. Multimodal inputs are folded into every block: conservative (blocks
    before an image lose reuse across different images) but never wrong.
    """
    extra: dict[str, object] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:  # the path too, as vLLM: a name may be pointed at another adapter
        extra["lora"] = [lora.lora_name, lora.lora_path]
    salt = getattr(request, "cache_salt", None)
    if salt:
        extra["salt"] = salt
    features = getattr(request, "mm_features", None) or []
    if features:
        extra["mm"] = [
            [str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)]
            for f in features
        ]
    return extra or None


class RequestHashes:
    """The growing list of block hashes of one request (at the plan's hash granularity)."""

    __slots__ = ("_extra", "_hasher")

    def __init__(self, plan: KVPlan, namespace: str, extra: object, generation: int = 0) -> None:
        # Each cache reset (a weight update) starts a generation whose hashes share nothing
        # with the previous ones; generation 0 hashes as before resets existed.
        scope = f"{namespace}\0{plan.digest}" + (f"\0reset {generation}" if generation else "")
        self._hasher = BlockHasher(plan.hash_block_size, scope)
        self._extra = extra

    def cover(self, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash the full blocks of the first `num_tokens` tokens (no-op if done already)."""
        done = self._hasher.num_tokens
        if num_tokens > done:
            self._hasher.extend(token_ids[done:num_tokens], self._extra)

    def for_group(self, block_size: int) -> list[bytes]:
        """One hash per full block of a group with `block_size`-token blocks."""
        return self._hasher.hashes_for(block_size)

    def prefix(self, token_ids: Sequence[int], num_tokens: int) -> bytes:
        """The hash naming exactly the first `num_tokens` tokens (a prompt tail's objects)."""
        self.cover(token_ids, num_tokens)
        if num_tokens % self._hasher.block_size == 0:
            return self._hasher.boundary_hash(num_tokens)
        return self._hasher.partial_hash(num_tokens, token_ids, self._extra)


class KeySpace:
    """Renders the keys of every group: BlockKey for one group, HybridKey for several.

    Both formats keep namespaces apart in the key, not only in the hash, so that removing
    by key prefix (a cache reset) reaches one namespace: the hybrid format through its
    layout digest, which folds the namespace in; the single-group format, which has no
    layout field, through its model field (`{model}~{namespace}`).

    With pipeline stages each stage's workers write objects of their own layers under
    their stage's `pp_rank`, in the hybrid format (the single-group one has no stage
    field): a worker's key space (`pp_rank` given) renders its stage's keys, the
    scheduler's (`pp_rank` None) every stage's.
    """

    def __init__(
        self, plan: KVPlan, model: str, namespace: str = "", pp_rank: int | None = None
    ) -> None:
        self.plan = plan
        stages: list[int | None]
        if plan.pp_size == 1:
            stages = [None]
        elif pp_rank is None:
            stages = list(range(plan.pp_size))
        elif 0 <= pp_rank < plan.pp_size:
            stages = [pp_rank]
        else:
            raise ValueError(f"pp_rank {pp_rank} is not a stage of {plan.pp_size}")
        #: Objects of one head of one block that `keys` renders: one per stage rendered.
        self.stages = len(stages)
        #: The stage whose objects this key space writes (0 without pipeline stages).
        self.pp_rank = pp_rank or 0
        self._hybrid = plan.hybrid or plan.pp_size > 1
        if self._hybrid:
            self._renderers = [
                [
                    KeyRenderer.hybrid(
                        model, plan.digest, group.vllm_group_id, group.block_size, stage
                    )
                    for stage in stages
                ]
                for group in plan.groups
            ]
        else:
            scoped = f"{model}~{namespace}" if namespace else model
            self._renderers = [[KeyRenderer.single_group(scoped)]]

    def keys(self, group: int, hashes: Sequence[bytes], heads: Sequence[int]) -> list[str]:
        """Keys of `hashes` in plan group `group`, block-major; within a block stage by
        stage, `heads` within a stage."""
        renderers = self._renderers[group]
        if len(renderers) == 1:
            return renderers[0].render_all(hashes, heads)
        per_stage = [renderer.render_all(hashes, heads) for renderer in renderers]
        width = len(heads)
        return [
            key
            for start in range(0, len(hashes) * width, width)
            for stage in per_stage
            for key in stage[start : start + width]
        ]

    def prefixes(self) -> list[str]:
        """Key prefixes that match every key of this key space and no other's.

        A single-group key's prefix (`{model}@`) also begins every hybrid key of that model
        (`{model}@mooncake_hybrid_v1:...`), so it is narrowed by the first character of
        the hash, which is lowercase hex where the hybrid tag is not."""
        if self._hybrid:
            return sorted({renderer.prefix for group in self._renderers for renderer in group})
        [[renderer]] = self._renderers
        return [renderer.prefix + digit for digit in "0123456789abcdef"]
