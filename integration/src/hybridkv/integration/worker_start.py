"""The worker role's start from vLLM's live state: its ranks, then its WorkerSide.

`HybridKVConnector.register_kv_caches` runs these steps in order, keeping what each one
opened (the pool first) so that shutdown closes it whichever later step fails.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.integration.keying import KeySpace
from hybridkv.integration.pool import Pool
from hybridkv.integration.topologies import WriterReads
from hybridkv.integration.transfer_mode import TransferMode
from hybridkv.integration.vllm_facts import preemptions_come_first, tp_any_rank
from hybridkv.integration.worker import WorkerSide
from hybridkv.transport import GroupLayout, TransferEngine, make_event

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerRanks:
    """This worker's place in vLLM's parallel groups."""

    tp_rank: int
    pp_rank: int
    tp_group: Any  # vLLM's GroupCoordinator

    @classmethod
    def current(cls) -> WorkerRanks:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tp_group,
        )

        tp_rank = get_tensor_model_parallel_rank()
        tp_group = get_tp_group()
        return cls(tp_rank, get_pp_group().rank_in_group, tp_group)

    @property
    def serves_lookups(self) -> bool:
        """Worker rank 0 (TP rank 0 of the first stage) answers the scheduler's lookups."""
        return self.tp_rank == 0 and self.pp_rank == 0


def new_worker_side(
    vllm_config: VllmConfig,
    keys: KeySpace,
    pool: Pool,
    layouts: Sequence[GroupLayout],
    mode: TransferMode,
    ranks: WorkerRanks,
    save_deadline_s: float,
    reads: WriterReads | None = None,
) -> WorkerSide:
    """The WorkerSide moving `layouts` through `pool` in `mode` (logged); `reads`: this
    rank's reads of another writer topology's objects, with layouts of their own."""
    device = vllm_config.device_config.device_type
    logger.info(
        "hybridkv: TP rank %d moves %d KV cache groups %s at granularity %r; %d of them "
        "in place (block-outermost caches: one run of memory per object, no copy)",
        ranks.tp_rank,
        len(layouts),
        mode.described,
        mode.options.granularity,
        sum(layout.contiguous for layout in layouts),
    )
    extra = [] if reads is None else reads.layouts
    engine = TransferEngine(pool.store, [*layouts, *extra], mode.options, device)
    return WorkerSide(
        keys,
        engine,
        mode.strategy(engine, vllm_config, device),
        ranks.tp_rank,
        lambda: make_event(device),
        tp_any_rank(ranks.tp_group) if ranks.tp_group.world_size > 1 else None,
        steps_ahead=vllm_config.max_concurrent_batches - 1,
        saves_outlive_step=preemptions_come_first(vllm_config, device),
        save_deadline_s=save_deadline_s,
        writer_reads=reads,
        load_deadline_s=mode.load_deadline_s,
    )
