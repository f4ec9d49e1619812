"""HybridKVConnector: the vLLM KV connector, a thin shell delegating by role.

The scheduler role decides hits and plans transfers (`scheduler.SchedulerSide`); the worker
role moves bytes (`worker.WorkerSide`). Both derive the same plan (groups, keys, layout
digest) from `kv_cache_config`, so they agree on every key without talking about it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from hybridkv.integration.bounded_wait import finished_within
from hybridkv.integration.cache_layouts import build_layouts
from hybridkv.integration.checkpoints import drops_eagle_block, prefill_checkpoints
from hybridkv.integration.config import ConnectorConfig, parse_extra_config
from hybridkv.integration.groups import KVPlan
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.kv_events import PoolAnnouncer, StoredEvents
from hybridkv.integration.logs import follow_vllm_logging
from hybridkv.integration.lookup import LookupChannel, LookupClient, LookupServer
from hybridkv.integration.metadata import FailedLoads, HybridKVMetadata
from hybridkv.integration.pool import Pool, open_pool
from hybridkv.integration.scheduler import SchedulerSide
from hybridkv.integration.stats import HybridKVPromMetrics, HybridKVStats
from hybridkv.integration.topologies import WriterReads, rank_reads
from hybridkv.integration.transfer_mode import TransferMode
from hybridkv.integration.vllm_facts import (
    background_loads_reason,
    data_parallel_index,
    event_builder,
    explain_failed_loads,
    hash_block_size,
    instance_id,
    layer_numbers,
    pipeline_stages,
    plan_from_vllm,
    prompt_tail_unit,
    refuse_layerwise_micro_batches,
    writer_plan,
)
from hybridkv.integration.weights import weights_identity
from hybridkv.integration.worker import WorkerSide
from hybridkv.integration.worker_start import WorkerRanks, new_worker_side
from hybridkv.keys import model_name
from hybridkv.transport import GroupLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# How long shutdown waits for the worker's transfers to drain (vLLM itself kills workers
# that take more than a few seconds to stop).
SHUTDOWN_WAIT_S = 10.0


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Reuses KV that any instance stored in the Mooncake pool, for hybrid models too."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        follow_vllm_logging()
        if kv_cache_config is None:
            raise ValueError("HybridKVConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config: ConnectorConfig = parse_extra_config(transfer.kv_connector_extra_config)
        # A fixed port past 65535, or a socket path too long, is refused here, not at the
        # first lookup.
        port = self.config.lookup_port(data_parallel_index(vllm_config))
        self._channel = LookupChannel(instance_id(vllm_config), port)
        if self.config.use_layerwise:
            refuse_layerwise_micro_batches(vllm_config)
        weights = weights_identity(vllm_config, self.config.weights_version)
        self.plan = plan_from_vllm(vllm_config, kv_cache_config, self.config.namespace, weights)
        self.keys = self._key_space(self.plan)
        self._writer = self._writer_topology(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._client: LookupClient | None = None
        self._worker: WorkerSide | None = None
        self._server: LookupServer | None = None
        self._pool: Pool | None = None
        events = vllm_config.kv_events_config
        self._events_on = events is not None and events.enable_kv_cache_events
        self._announcer: PoolAnnouncer | None = None
        if role == KVConnectorRole.SCHEDULER:
            background = background_loads_reason(len(kv_cache_config.kv_cache_groups), self.plan)
            explain_failed_loads(
                transfer.kv_load_failure_policy, self.config.load_async, background
            )
            builder = (
                event_builder(vllm_config, kv_cache_config, self.plan) if self._events_on else None
            )
            if self._events_on:
                # Every stage's workers write their own objects of each head.
                stages = self.plan.pp_size
                storing = {g.vllm_group_id: g.heads.storing * stages for g in self.plan.groups}
                self._announcer = PoolAnnouncer(storing)
            self._client = LookupClient(
                self._channel.address,
                self.config.lookup_timeout_ms,
                self._channel.answered,
                probe_backoff_s=self.config.lookup_probe_backoff_s,
                probe_max_backoff_s=self.config.lookup_probe_max_backoff_s,
            )
            self._scheduler = SchedulerSide(
                self.keys,
                self.config,
                self._client.query,
                transfer.kv_role,
                builder,
                prompt_tail_unit(vllm_config, kv_cache_config),
                load_async_required=background is not None,
                checkpoints=prefill_checkpoints(vllm_config, kv_cache_config, self.plan),
                use_eagle=drops_eagle_block(vllm_config),
                local_hit_unit=hash_block_size(vllm_config, kv_cache_config),
                steps_ahead=vllm_config.max_concurrent_batches - 1,
                block_query=self._client.query_blocks,
                writer_keys=None if self._writer is None else self._writer_keys(None),
            )

    def _writer_topology(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> tuple[KVPlan, list[tuple[int, int]]] | None:
        """The other writer topology this reader reads (plan, stage ranges), if any."""
        topology = self.config.writer_topology()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        if topology is None or not self.config.loads_for(transfer.kv_role):
            return None
        if self.config.use_layerwise:
            raise ValueError(
                "use_layerwise: reading another writer topology (prefill_pp_size, "
                "prefill_pp_layer_partition, store_tp_size, prefill_tp_sizes) loads whole "
                "blocks only; turn one of them off"
            )
        return writer_plan(vllm_config, kv_cache_config, self.plan, topology, self.config.namespace)

    def _key_space(self, plan: KVPlan, pp_rank: int | None = None) -> KeySpace:
        """The keys of `plan`'s objects in this model and namespace: one stage's (`pp_rank`)
        or, for the scheduler, every stage's."""
        model = model_name(self._vllm_config.model_config.model)
        return KeySpace(plan, model, self.config.namespace, pp_rank)

    def _writer_keys(self, pp_rank: int | None) -> KeySpace:
        assert self._writer is not None
        return self._key_space(self._writer[0], pp_rank)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save a preemption cut short is a later miss, never a
        hand-off another instance waits for, so vLLM need not recompute the preempted
        request's late output (vLLM defaults this to the producer role, true for
        kv_both)."""
        return False

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side call on the worker connector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side call before register_kv_caches")
        return self._worker

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = connector_output.kv_connector_worker_meta
        if not isinstance(failed, FailedLoads):
            failed = FailedLoads()
        self.scheduler_side.loads_failed(
            connector_output.failed_recving,
            failed.keys,
            failed.unsaved,
            connector_output.invalid_block_ids,
        )
        reports = connector_output.kv_cache_events
        if self._announcer is not None and isinstance(reports, StoredEvents):
            self._announcer.add(reports.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """`BlockStored` for blocks every storing head has put in the pool (see kv_events.py)."""
        return self._announcer.take() if self._announcer is not None else ()

    def reset_cache(self) -> bool:
        """vLLM's connector reset (`reset_prefix_cache(reset_connector=True)`, and pausing
        with `clear_cache`, as around an RL weight update): no KV stored before it is
        loaded after it.

        This instance moves to new keys at once (saves still in flight land under keys it
        never asks for again), and worker rank 0 removes every object of this model and
        layout from the pool that no read holds a lease on, so that other instances do not
        load them either. False, so that vLLM reports the reset as failed, if that removal
        did not happen.
        """
        self.scheduler_side.reset()
        if self._announcer is not None:
            self._announcer.reset(self.scheduler_side.generation)
        assert self._client is not None  # the scheduler side has one
        removed = self._client.remove()
        if removed is None:
            logger.warning(
                "hybridkv: cache reset: this instance will not load older KV, but the pool "
                "still holds it (removal failed, see above)"
            )
            return False
        logger.info(
            "hybridkv: cache reset: removed %d objects of this model from the pool; "
            "instances share KV again once each has reset as often (generation %d)",
            removed,
            self.scheduler_side.generation,
        )
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves never outlive the step after the one that issued them (the worker waits
        # for them before vLLM writes any block again), so the blocks can be freed now.
        self.scheduler_side.forget(request.request_id)
        return False, None

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ranks = WorkerRanks.current()
        if self.plan.pp_size > 1:
            self.keys = self._key_space(self.plan, ranks.pp_rank)
        layer_index = layer_numbers(kv_caches, self._vllm_config.model_config.hf_config.model_type)
        layouts = build_layouts(self.keys, kv_caches, layer_index, self._kv_cache_config.num_blocks)
        reads = None
        if self._writer is not None:
            reads = self._writer_reads(ranks, layouts, layer_index)
        pool = open_pool(
            self.config, ranks.tp_rank, ranks.tp_group.broadcast_object, self.plan.pp_size
        )
        device = self._vllm_config.device_config.device_type
        contiguous = all(layout.contiguous for layout in layouts)
        try:
            mode = TransferMode.choose(self.config, device, pool.rdma, contiguous)
        except ValueError:
            pool.close()  # an embedded master must not outlive the refused start
            raise
        self._pool = pool
        self._worker = new_worker_side(
            self._vllm_config,
            self.keys,
            pool,
            layouts,
            mode,
            ranks,
            self.config.save_deadline_s,
            reads,
        )
        if ranks.serves_lookups:
            self._channel.claim()
            self._server = LookupServer(
                self._worker.engine.batch_is_readable,
                self._channel.endpoint,
                self._remove_from_pool,
                keys=self._scheduler_keys(),
            )

    def _writer_reads(
        self, ranks: WorkerRanks, layouts: list[GroupLayout], layer_index: dict[str, int]
    ) -> WriterReads:
        """This rank's reads of the writer topology's objects, planned once."""
        assert self._writer is not None
        writer, writer_stages = self._writer
        layers = self._vllm_config.model_config.get_total_num_hidden_layers()
        own_stages = pipeline_stages(self._vllm_config) or [(0, layers)]
        names = {index: name for name, index in layer_index.items()}
        reads = rank_reads(
            self.plan,
            writer,
            writer_stages,
            own_stages[ranks.pp_rank],
            ranks.pp_rank,
            ranks.tp_rank,
            layouts,
            names,
            layers,
            getattr(self._vllm_config.model_config.hf_text_config, "layer_types", None),
        )
        keys = [self._writer_keys(stage) for stage in range(writer.pp_size)]
        logger.info(
            "hybridkv: TP rank %d of stage %d reads %d objects per block of the writer "
            "topology (TP size %d, stages %s)",
            ranks.tp_rank,
            ranks.pp_rank,
            len(reads),
            writer.tp_size,
            writer_stages or "none",
        )
        return WriterReads(keys, layouts, reads)

    def _scheduler_keys(self) -> KeySpace:
        """The scheduler's key space: every stage's (this worker's renders its own stage's
        only)."""
        return self._key_space(self.plan)

    def _remove_from_pool(self) -> int:
        # Every stage's objects. Not forced: an object read in the last lease period may
        # still be in flight to another instance, and freeing it could hand its memory to
        # a new put mid-read.
        prefixes = self._scheduler_keys().prefixes()
        store = self.worker_side.engine.store
        return sum(store.remove_by_prefix(prefix) for prefix in prefixes)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # The first hook of a step (see `preemptions_come_first`).
        self.worker_side.before_step()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The step starts here: vLLM calls start_load_kv after the forward when the step
        # has no synchronous loads, too late for a layerwise step or a synchronous load.
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, HybridKVMetadata)
        self.worker_side.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_async_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.strategy.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self.worker_side.strategy.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker_side.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # vLLM 0.32 asks only this (its own default of it calls get_finished).
        done = self.worker_side.finished()  # first: it records failures
        return KVConnectorTransferResults(
            finished_recving=done, failed_recving=self.worker_side.take_failed_requests()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        keys = self.worker_side.take_failed_keys()
        unsaved = self.worker_side.take_unsaved()
        return FailedLoads(frozenset(keys), frozenset(unsaved)) if keys or unsaved else None

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        if not self._events_on or self._worker is None:
            return None
        stored = self._worker.take_stored_events()
        return StoredEvents(stored) if stored else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.counters.take()
        if self._scheduler is not None and self._client is not None:
            data = {**self._scheduler.take_stats(), **self._client.take_stats()}
            return HybridKVStats(data=dict(data)) if any(data.values()) else None
        return None

    def transfer_totals(self, reset: bool = False) -> dict[str, float]:
        """This worker's counters summed since start-up (or the last reset).

        For in-process benchmarks (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, through
        `vllm.distributed.kv_transfer.get_kv_transfer_group()`): vLLM's own stats
        snapshots reset every step, these do not.
        """
        return self.worker_side.totals.snapshot(reset)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # A full CUDA graph replays attention without the per-layer connector calls: a
        # layerwise load would not be waited for before its layer reads the blocks.
        return parse_extra_config(extra_config).use_layerwise

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        return parse_extra_config(transfer.kv_connector_extra_config).kv_cache_layout

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return HybridKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HybridKVPromMetrics:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Stop threads, sessions, sockets and any embedded master; safe to call twice.

        A store call that hangs holds shutdown up for `SHUTDOWN_WAIT_S` at most: the
        transfers still running are then left, with the store, to the process's exit."""
        idle = False  # until the worker's close returned: it may have left calls running
        worker, self._worker = self._worker, None
        try:
            idle = worker is None or finished_within(
                worker.close, SHUTDOWN_WAIT_S, "hybridkv-shutdown"
            )
            if not idle:
                logger.error(
                    "hybridkv: transfers still running %g s into shutdown; left to the "
                    "process's exit with the store",
                    SHUTDOWN_WAIT_S,
                )
        finally:  # the rest goes whatever the worker's close did
            server, self._server = self._server, None
            if server is not None:
                idle &= server.close()
                self._channel.release()
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.close(store_idle=idle)
            client, self._client = self._client, None
            if client is not None:
                client.close()
