"""Which blocks a step saves: those it completes that a later lookup could need.

Saves follow the coordinator's `store_mask`, one complete block at a time, in the step
that completes it (a Mamba block holds the state at its end only then). Prompt tails:
where vLLM's own prefix cache hits inside blocks (a Mamba "align" model with a
`prefix_match_unit` finer than its blocks), vLLM ends a prompt's chunk at its last
multiple of that unit, or (Mamba2, KDA) has the prompt's last chunk write the state there
into a checkpoint block. The step that leaves such a prefix stores each group's block
holding it as a partial object, named by the prefix's hash.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any

from hybridkv.coordinator import Coordinator, Masks
from hybridkv.integration.checkpoints import Checkpoint, PrefillCheckpoints
from hybridkv.integration.groups import KVPlan
from hybridkv.integration.kv_events import EventBuilder
from hybridkv.integration.metadata import BlockRef, RequestTransfers
from hybridkv.integration.tracked_requests import NULL_BLOCK_ID, TrackedRequest


class SavePlanner:
    """Plans each tracked request's saves step by step (its `scanned`, `store_mask` and
    `inner` blocks are this planner's to move)."""

    def __init__(
        self,
        plan: KVPlan,
        coordinator: Coordinator,
        save_decode_cache: bool,
        tail_unit: int,
        poisoned: Container[int],
        checkpoints: PrefillCheckpoints | None = None,
        events: EventBuilder | None = None,
    ) -> None:
        """`tail_unit`: where prompt tails are stored (0: none). `poisoned`: the block ids
        holding KV computed over a failed load, never saved. `checkpoints`: the Mamba
        groups whose prefill chunks leave a block holding an inner state (saved only as a
        prompt tail). `events`: what vLLM's KV events say of a stored block."""
        self._plan = plan
        self._coordinator = coordinator
        self._save_decode_cache = save_decode_cache
        self._tail_unit = tail_unit
        self._poisoned = poisoned
        self._checkpoints = checkpoints
        self._events = events
        self._state_groups = {
            index for index, group in enumerate(plan.groups) if group.kind.holds_state
        }

    def store_mask(self, tokens: int, request: Any) -> Masks:
        """What to save of a request's first `tokens` tokens, with the whole blocks its
        prompt's tails need. With `save_decode_cache` the request goes on and stores
        EAGLE's dropped block past them too, so a later one can hit at `tokens` itself:
        its state there is worth keeping."""
        reach = self._coordinator.eagle_tokens if self._save_decode_cache else 0
        return self._coordinator.store_mask(
            tokens + reach, self._tail_unit, request.num_prompt_tokens
        )

    def regrow_mask(self, tracked: TrackedRequest, tokens: int) -> None:
        """Make the store mask one for `tokens` tokens (a longer prompt, or generated
        tokens past it). Blocks passed over because no boundary the old mask covered
        needed them, and that a boundary of the new one does, are scanned again where
        vLLM keeps them while the request runs (full attention; windows and states passed
        over may be gone)."""
        old = tracked.store_mask
        tracked.store_mask = self.store_mask(tokens, tracked.request)
        tracked.mask_tokens = tokens
        for group, plan in enumerate(self._plan.groups):
            if not plan.kind.keeps_passed_blocks:
                continue
            before, after = old[group], tracked.store_mask[group]
            for block in range(min(tracked.scanned[group], len(after))):
                if after[block] and not (block < len(before) and before[block]):
                    tracked.scanned[group] = block
                    break

    def plan(
        self,
        tracked: TrackedRequest,
        start: int,
        done: int,
        table: Sequence[Sequence[int]],
        step: dict[str, RequestTransfers],
    ) -> bool:
        """Queue the store-worthy blocks this step completes (the prompt's, or with
        `save_decode_cache` also those the generated tokens complete, as far as they are
        known: with async scheduling vLLM counts a step's token before it is sampled, and
        speculative decoding schedules draft tokens that may be rejected). True if one
        is a state that vLLM copies into its block after sampling: a decode step's draft
        tokens ran past the block's end in this step, so the kernel wrote the state
        further on."""
        request = tracked.request
        known = len(request.all_token_ids) if self._save_decode_cache else request.num_prompt_tokens
        upto = min(done, known)
        if upto > tracked.mask_tokens:  # decode went past the mask: grow it, doubling
            self.regrow_mask(tracked, max(upto, 2 * tracked.mask_tokens))
        saves: list[BlockRef] = []
        checkpoints: dict[int, Checkpoint] = {}
        prefill = start < max(request.num_prompt_tokens, request.num_tokens - 1)  # vLLM's bound
        after_sampling = False
        for group, plan in enumerate(self._plan.groups):
            size = plan.block_size
            written = None
            sources: dict[int, int] = {}  # block -> the block holding its state instead
            if self._checkpoints is not None:
                written = self._checkpoints.written(group, start, done)
                if written is not None and not written.is_block_end(size):
                    tracked.inner.add((group, written.block))
                    checkpoints[group] = written
                    if written.tokens % size == 0:
                        # Another block's end (EAGLE moved the checkpoint back, or its
                        # unit spans blocks): that block's state, kept in this one.
                        sources[written.tokens // size - 1] = written.block
            resumed = start // size
            if (
                prefill
                and group in self._state_groups
                and start % size
                and done > (resumed + 1) * size
                and written != Checkpoint((resumed + 1) * size, resumed)
            ):
                # A prefill chunk resuming inside a block and running past its end writes
                # its final state further on: that block keeps the state it resumed from.
                # (A decode step crossing a block end with draft tokens has vLLM copy the
                # state at the block end into it.)
                tracked.inner.add((group, resumed))
            complete = upto // size
            first = tracked.scanned[group]
            if complete <= first:
                continue
            tracked.hashes.cover(request.all_token_ids, complete * size)
            hashes = tracked.hashes.for_group(size)
            ids = table[plan.vllm_group_id]
            mask = tracked.store_mask[group]
            for block in range(first, min(complete, len(ids))):
                source = sources.get(block, block)
                if ids[block] in self._poisoned or ids[source] in self._poisoned:
                    complete = block  # computed over a failed load: not before it is redone
                    break
                # Null: a window or a state vLLM already dropped; it is never coming back.
                # Inner: a state that is not the one at the block's end (unless this
                # step's checkpoint put that one in another block).
                if (
                    block < len(mask)
                    and mask[block]
                    and source < len(ids)
                    and ids[source] != NULL_BLOCK_ID
                    and (source != block or (group, block) not in tracked.inner)
                ):
                    stored = None
                    if self._events is not None:
                        stored = self._events(request, plan.vllm_group_id, size, block)
                    saves.append(BlockRef(group, block, ids[source], hashes[block], stored))
                    after_sampling |= (
                        not prefill
                        and group in self._state_groups
                        and start < (source + 1) * size < done
                    )
            tracked.scanned[group] = complete
        saves.extend(self._tail_saves(tracked, done, table, checkpoints))
        if saves:
            entry = step.setdefault(
                request.request_id, RequestTransfers(request_id=request.request_id)
            )
            entry.saves.extend(saves)
        return after_sampling

    def _tail_saves(
        self,
        tracked: TrackedRequest,
        done: int,
        table: Sequence[Sequence[int]],
        checkpoints: Mapping[int, Checkpoint],
    ) -> list[BlockRef]:
        """The prompt tails a step leaves, stored before the next step overwrites a state:
        a chunk ending inside a block at a multiple of the tail unit leaves every group's
        KV of exactly that prefix; a prompt's last chunk whose every state group wrote its
        checkpoint at one such position leaves the states there in the checkpoint blocks,
        and the other groups' KV of that prefix in the blocks holding its last token."""
        if not self._tail_unit:
            return []
        saves = self._tail_at(tracked, done, table, {})
        if (
            checkpoints
            and done >= tracked.request.num_prompt_tokens
            and self._state_groups <= checkpoints.keys()
        ):
            # One position for every group: vLLM's rule places it by the chunk alone.
            position = next(iter(checkpoints.values())).tokens
            sources = {group: checkpoint.block for group, checkpoint in checkpoints.items()}
            saves.extend(self._tail_at(tracked, position, table, sources))
        return saves

    def _tail_at(
        self,
        tracked: TrackedRequest,
        tokens: int,
        table: Sequence[Sequence[int]],
        sources: Mapping[int, int],
    ) -> list[BlockRef]:
        """Each group's partial object of the prefix of `tokens` tokens, from the block
        `sources` names for the group, else from the block holding the prefix's last token;
        none unless `tokens` is a multiple of the tail unit inside the prompt and inside a
        block of every group."""
        request = tracked.request
        if tokens % self._tail_unit or tokens > request.num_prompt_tokens:
            return []
        if not self._coordinator.is_tail_boundary(tokens):
            return []
        tail_hash = tracked.hashes.prefix(request.all_token_ids, tokens)
        saves = []
        for group in self._coordinator.partial_groups(tokens):
            plan = self._plan.groups[group]
            block = tokens // plan.block_size
            source = sources.get(group, block)
            ids = table[plan.vllm_group_id]
            if source < len(ids) and ids[source] != NULL_BLOCK_ID:
                saves.append(BlockRef(group, block, ids[source], tail_hash, tail=tokens))
        return saves
