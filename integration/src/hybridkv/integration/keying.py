"""Object keys of a request's blocks: hybridkv's own hashes, rendered per group and head.

Hashes come from `hybridkv.keys.BlockHasher` (SHA-256 chains over token ids and extras), not
from vLLM's block hashes, so two instances agree without sharing `PYTHONHASHSEED`. The
hasher's namespace carries the plan's scope (topology-free: every TP size and pipeline
split of one model hashes a prompt alike), so incompatible models never share a hash even
in the single-group key format, which has no layout field.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from hybridkv.integration.groups import KVPlan
from hybridkv.keys import BlockHasher, KeyRenderer


class RequestExtras:
    """What besides the tokens makes a request's KV differ, per block.

    LoRA (name and path, as vLLM: a name may be pointed at another adapter) and cache salt
    fold into every block; a multimodal input into the blocks it overlaps and, through the
    chain, every later one, as in vLLM's prefix cache: blocks before an image are shared
    across images. The inputs are read when a block is hashed, not once: a streaming-input
    session adds those of each chunk it receives.
    """

    __slots__ = ("_base", "_request")

    def __init__(self, request: Any) -> None:
        base: dict[str, object] = {}
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            base["lora"] = [lora.lora_name, lora.lora_path]
        salt = getattr(request, "cache_salt", None)
        if salt:
            base["salt"] = salt
        self._base = base
        self._request = request

    @property
    def has_media(self) -> bool:
        """Whether extras differ between blocks (else `of` is the same everywhere)."""
        return bool(getattr(self._request, "mm_features", None))

    def _media(self) -> list[tuple[int, int, str]]:
        """(start, stop, identifier) of each multimodal input, by start."""
        features = getattr(self._request, "mm_features", None) or []
        return sorted(
            (
                int(f.mm_position.offset),
                int(f.mm_position.offset + f.mm_position.length),
                str(f.identifier),
            )
            for f in features
        )

    def _extra(self, media: list[tuple[int, int, str]]) -> object:
        if media:
            return {
                **self._base,
                "mm": [[name, start, stop - start] for start, stop, name in media],
            }
        return self._base or None

    def of(self, start: int, stop: int) -> object:
        """The extra of the tokens in [start, stop): the request's, and the inputs there."""
        [extra] = self.of_blocks(start, stop, stop - start)
        return extra

    def of_blocks(self, first: int, stop: int, size: int) -> list[object]:
        """The extra of each `size`-token block from token `first` up to `stop`: one pass
        over the inputs, not one per block (long prompts carry many images)."""
        media = self._media()
        starts = [start for start, _, _ in media]
        extras: list[object] = []
        low = 0  # inputs before it end before the current block
        for block in range(first, stop, size):
            while low < len(media) and media[low][1] <= block:
                low += 1
            high = bisect.bisect_left(starts, block + size)
            extras.append(self._extra([m for m in media[low:high] if m[1] > block]))
        return extras


class RequestHashes:
    """The growing list of block hashes of one request (at the plan's hash granularity)."""

    __slots__ = ("_extras", "_hasher")

    def __init__(self, plan: KVPlan, namespace: str, request: Any, generation: int = 0) -> None:
        """`request`: whose LoRA, salt and multimodal inputs the hashes fold in (None:
        tokens only)."""
        # Each cache reset (a weight update) starts a generation whose hashes share nothing
        # with the previous ones; generation 0 hashes as before resets existed.
        scope = f"{namespace}\0{plan.scope}"
        if plan.weights:
            scope += f"\0weights {plan.weights}"
        if generation:
            scope += f"\0reset {generation}"
        self._hasher = BlockHasher(plan.hash_block_size, scope)
        self._extras = RequestExtras(request)

    def cover(self, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash the full blocks of the first `num_tokens` tokens (no-op if done already)."""
        hasher = self._hasher
        done = hasher.num_tokens
        if num_tokens <= done:
            return
        if not self._extras.has_media:  # one extra for every block: one call
            hasher.extend(token_ids[done:num_tokens], self._extras.of(done, num_tokens))
            return
        size = hasher.block_size
        first = done // size * size
        extras = self._extras.of_blocks(first, num_tokens, size)
        # Each block with its own extra, given by the call that ends it.
        for block, extra in zip(range(first, num_tokens, size), extras, strict=True):
            hasher.extend(token_ids[max(block, done) : min(num_tokens, block + size)], extra)

    def rewind(self, num_tokens: int) -> None:
        """The tokens from `num_tokens` on changed: hash them again when covered."""
        self._hasher.rewind(num_tokens)

    def for_group(self, block_size: int) -> list[bytes]:
        """One hash per full block of a group with `block_size`-token blocks."""
        return self._hasher.hashes_for(block_size)

    def prefix(self, token_ids: Sequence[int], num_tokens: int) -> bytes:
        """The hash naming exactly the first `num_tokens` tokens (a prompt tail's objects)."""
        self.cover(token_ids, num_tokens)
        size = self._hasher.block_size
        if num_tokens % size == 0:
            return self._hasher.boundary_hash(num_tokens)
        extra = self._extras.of(num_tokens // size * size, num_tokens)
        return self._hasher.partial_hash(num_tokens, token_ids, extra)


def scoped_model(model: str, namespace: str) -> str:
    """The single-group key's model field: `{model}~{namespace}`, one name per pair.

    A namespace holds no '~', so the last '~' ends the model. A model whose name holds one
    takes a trailing '~' without a namespace: `m~a~` (model `m~a`), not `m~a` (model `m`,
    namespace `a`), whose cache reset would remove it. Other names are as before.
    """
    if "~" in namespace:
        raise ValueError(f"namespace must not contain '~': {namespace!r}")
    return f"{model}~{namespace}" if namespace or "~" in model else model


class KeySpace:
    """Renders the keys of every group: BlockKey for a whole block of one group (one
    stage, one storing head), HybridKey otherwise (its `layout` field the topology digest).

    Both formats keep namespaces apart in the key, not only in the hash, so that removing
    by key prefix (a cache reset) reaches one namespace: the hybrid format through its
    layout digest, which folds the namespace in; the single-group format, which has no
    layout field, through its model field (`{model}~{namespace}`, see `scoped_model`).

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
        # Block hashes are topology-free: only an object that is a whole block of every
        # layer and head (one group, stage and storing head) is the same bytes for every
        # topology writing it, and only it may take the format without a layout field.
        self._hybrid = plan.hybrid or plan.pp_size > 1 or plan.groups[0].heads.storing > 1
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
            self._renderers = [[KeyRenderer.single_group(scoped_model(model, namespace))]]

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
