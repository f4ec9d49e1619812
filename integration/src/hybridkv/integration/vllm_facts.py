"""What the connector asks of vLLM's configuration, answered in one place.

vLLM's settings (parallelism, hash unit, layer naming, model runner) decide how the
connector plans its keys and when it may load; the connector shell (`connector.py`)
only asks. Each answer says which vLLM behaviour it follows, so a vLLM upgrade that
changes one is checked here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from hybridkv.integration.config import WriterTopology
from hybridkv.integration.groups import KVPlan, ModelShape, plan_groups
from hybridkv.integration.kv_events import EventBuilder
from hybridkv.integration.topologies import refuse_unreadable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def plan_from_vllm(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, namespace: str, weights: str
) -> KVPlan:
    """`weights`: what besides the layout makes the KV differ (`weights_identity`)."""
    parallel = vllm_config.parallel_config
    for what, setting, size in (
        # Context-parallel ranks hold the same heads but different tokens of each block:
        # keyed by head alone, one rank's share would be loaded by all of them.
        (
            "decode context parallelism",
            "decode_context_parallel_size",
            parallel.decode_context_parallel_size,
        ),
        (
            "prefill context parallelism",
            "prefill_context_parallel_size",
            parallel.prefill_context_parallel_size,
        ),
    ):
        if size > 1:
            raise ValueError(f"HybridKVConnector does not support {what} yet ({setting}={size})")
    return _plan(
        vllm_config,
        kv_cache_config,
        namespace,
        weights,
        parallel.tensor_parallel_size,
        pipeline_stages(vllm_config),
    )


def _plan(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    namespace: str,
    weights: str,
    tp_size: int,
    stages: list[tuple[int, int]],
) -> KVPlan:
    return plan_groups(
        kv_cache_config.kv_cache_groups,
        kv_cache_config.prefix_cacheable_group_ids,
        ModelShape(
            tp_size=tp_size,
            total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
            block_interior=block_interior(vllm_config),
        ),
        namespace,
        stages,
        weights,
        vllm_config.model_config.get_total_num_hidden_layers(),
    )


def pipeline_stages(vllm_config: VllmConfig) -> list[tuple[int, int]]:
    """The model layers of each pipeline stage, as vLLM splits them (none: one stage)."""
    from vllm.distributed.utils import get_pp_indices

    stages = vllm_config.parallel_config.pipeline_parallel_size
    if stages == 1:
        return []
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    return [get_pp_indices(layers, rank, stages) for rank in range(stages)]


def block_interior(vllm_config: VllmConfig) -> str:
    """The order of a cache block's heads (H), tokens (N) and channels (C) in vLLM's
    resolved KV cache layout (LBNHC: "NHC")."""
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    return "".join(axis for axis in layout.name if axis in "HNC")


def writer_plan(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    reader: KVPlan,
    topology: WriterTopology,
    namespace: str,
) -> tuple[KVPlan, list[tuple[int, int]]] | None:
    """The plan and stage ranges of the writer topology the config names (None: it is the
    reader's own); refused with the reason where this reader cannot read it."""
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    if topology.pp_size is None:  # the reader's own stages
        stages = pipeline_stages(vllm_config)
    else:
        stages = writer_stages(layers, topology.pp_size, topology.partition)
    tp_size = topology.tp_size or reader.tp_size
    if tp_size == reader.tp_size and stages == pipeline_stages(vllm_config):
        logger.info("hybridkv: the configured writer topology is this instance's own")
        return None
    writer = _plan(vllm_config, kv_cache_config, namespace, reader.weights, tp_size, stages)
    refuse_unreadable(reader, writer, block_interior(vllm_config))
    return writer, stages


def writer_stages(
    num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None
) -> list[tuple[int, int]]:
    """A writer's stage ranges as vLLM's `get_pp_indices` cuts them (none: one stage):
    by its `partition` (VLLM_PP_LAYER_PARTITION's meaning), else evenly with the
    remainder on the stages before the last. Never from this process's own environment."""
    if pp_size == 1:
        return []
    counts = list(partition or ())
    if counts and sum(counts) != num_layers:
        raise ValueError(
            f"prefill_pp_layer_partition {','.join(map(str, counts))} sums to "
            f"{sum(counts)} layers; the model has {num_layers}"
        )
    if not counts:
        counts = [num_layers // pp_size] * pp_size
        for stage in range(2, num_layers % pp_size + 2):
            counts[-stage] += 1
    starts = [sum(counts[:stage]) for stage in range(len(counts))]
    return [(start, start + count) for start, count in zip(starts, counts, strict=True)]


def refuse_layerwise_micro_batches(vllm_config: VllmConfig) -> None:
    """Layerwise transfer takes a layer's connector calls as the whole batch's: with
    micro-batches (dual-batch overlap), a layer's save would go out after the first."""
    parallel = vllm_config.parallel_config
    if parallel.use_ubatching:
        raise ValueError(
            "HybridKVConnector's use_layerwise does not support micro-batching "
            f"(enable_dbo={parallel.enable_dbo}, ubatch_size={parallel.ubatch_size}): "
            "turn one of them off"
        )


def hash_block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """The unit vLLM hashes requests at: kv_cache_config.hash_block_size (set by the
    engine core), else the block size."""
    return int(kv_cache_config.hash_block_size or vllm_config.cache_config.block_size)


def event_builder(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, plan: KVPlan
) -> EventBuilder:
    """vLLM's KV events for the plan's groups, hashed at vLLM's unit."""
    unit = hash_block_size(vllm_config, kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    specs = {g.vllm_group_id: groups[g.vllm_group_id].kv_cache_spec for g in plan.groups}
    return EventBuilder(unit, specs)


def prompt_tail_unit(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """vLLM's hash unit where its own prefix cache hits inside blocks, else 0.

    Asks vLLM what its hybrid coordinator asks (a Mamba "align" group with blocks larger
    than the unit, every other group able to hit at the unit), with prefix caching on.
    Not with speculative decoding: vLLM then moves the prompt's checkpoint back a unit.
    """
    from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    unit = kv_cache_config.hash_block_size
    groups = kv_cache_config.kv_cache_groups
    if (
        not unit
        or len(groups) < 2
        or not vllm_config.cache_config.enable_prefix_caching
        or vllm_config.speculative_config is not None
    ):
        return 0
    managers = []
    for group in groups:
        manager = KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec, group.role)
        if manager is None:
            return 0
        managers.append(manager)
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    return unit if partial_hash_hits_enabled(groups, unit, dcp, managers) else 0


def layer_numbers(names: Iterable[str], model_type: str) -> dict[str, int]:
    """Each cache's physical layer, numbered as vLLM binds the caches (`bind_kv_cache`):
    LongCat-Flash's two attention modules per layer get numbers of their own."""
    from vllm.model_executor.models.utils import extract_layer_index

    modules = 2 if model_type == "longcat_flash" else 1
    return {name: extract_layer_index(name, modules) for name in names}


def data_parallel_index(vllm_config: VllmConfig) -> int:
    """This engine's data-parallel rank. Not `data_parallel_rank`: vLLM sets that to 0 in
    every engine of a dense model (its DP engines run independently), so engines on one
    host would share a lookup port."""
    index: int = vllm_config.parallel_config.data_parallel_index
    return index


def instance_id(vllm_config: VllmConfig) -> str:
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    return f"{transfer.engine_id}-dp{data_parallel_index(vllm_config)}"


def tp_any_rank(tp_group: Any) -> Callable[[bool], bool]:
    """`any_rank(flag)`: whether a flag is set on any rank of vLLM's TP group (one MAX
    all-reduce over its CPU group; every rank calls it together)."""

    def any_rank(flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32)
        torch.distributed.all_reduce(
            value, op=torch.distributed.ReduceOp.MAX, group=tp_group.cpu_group
        )
        return bool(value.item())

    return any_rank


def preemptions_come_first(vllm_config: VllmConfig, device: str) -> bool:
    """Whether vLLM's model runner calls `handle_preemptions` before it zeroes new blocks,
    copies blocks or computes: then a step's whole-block saves may go on reading their
    blocks until then. vLLM's V1 runner (CUDA, CPU) does; its V2 runner (the default on
    CUDA) zeroes and copies blocks first, and other platforms' runners are unchecked:
    there every save completes within `wait_for_save`."""
    return not vllm_config.use_v2_model_runner and device in ("cpu", "cuda")


def background_loads_reason(vllm_groups: int, plan: KVPlan) -> str | None:
    """Why pool hits must load in the background (None: they may load before the forward).

    A load before the forward that fails is reported by block ids; vLLM 0.32 then
    recomputes from the first failed block on, over the blocks before it. A background
    load that fails is reported by request, and vLLM recomputes it from its first token.
    """
    if vllm_groups > 1:
        return (
            f"{vllm_groups} KV cache groups: block ids repeat across them, and vLLM stops "
            "the engine on failed block ids of such a model"
        )
    if any(group.kind.sparse for group in plan.groups):
        return (
            "a sliding-window or state group: recomputing from a failed block would start "
            "over a window or state that the hit never loaded (it needs its own boundary's)"
        )
    if plan.pp_size > 1:
        return (
            f"{plan.pp_size} pipeline stages: a stage that computed over its own failed "
            "load hands wrong hidden states to the next, and the stages cannot agree within "
            "a step; vLLM learns of a failed background load before any stage computes"
        )
    return None


def explain_failed_loads(policy: str, load_async: bool, background: str | None) -> None:
    """Log what becomes of a request whose pool load fails, given vLLM's
    `kv_load_failure_policy`, `load_async` and why loads must run in the background
    (`background_loads_reason`)."""
    if policy != "recompute":
        logger.warning(
            "kv_load_failure_policy is %r: a request whose pool load fails will end "
            "with an error; set it to 'recompute' to have vLLM recompute those blocks",
            policy,
        )
    if background is not None and not load_async:
        logger.info("hybridkv: pool hits load in the background (load_async): %s.", background)
    elif not load_async and policy == "recompute":
        logger.info(
            "hybridkv: pool hits load before the forward; vLLM caches their blocks "
            "before they arrive, and when a load fails, a request that hits them in "
            "vLLM's prefix cache before they are recomputed (the failed request "
            "preempted or cancelled first) computes over them (see "
            "docs/configuration.md); load_async=true avoids it"
        )
