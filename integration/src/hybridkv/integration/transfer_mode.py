"""Whole blocks or layer by layer, and at which granularity: decided once, here.

The worker's strategy (how a step's transfers are issued) and the transport's granularity
(how objects meet the store) both follow from `use_layerwise`; deciding them together
keeps them from disagreeing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridkv.integration.transfer_strategy import TransferStrategy, WholeBlocks
from hybridkv.transport import PipelineOptions, TransferEngine, make_event
from hybridkv.transport.pipeline import Granularity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from hybridkv.integration.config import ConnectorConfig


@dataclass(frozen=True)
class TransferMode:
    """How a worker moves KV: `layerwise` (within the forward) or whole blocks (around
    it), and the transport settings that go with it."""

    layerwise: bool
    options: PipelineOptions
    load_deadline_s: float = 10.0  # see ConnectorConfig.load_deadline_s
    save_deadline_s: float = 10.0  # see ConnectorConfig.save_deadline_s

    @classmethod
    def choose(
        cls, config: ConnectorConfig, device: str, rdma: bool = False, contiguous: bool = False
    ) -> TransferMode:
        """The mode for caches on `device` (see `granularity`)."""
        return cls(
            layerwise=config.use_layerwise,
            options=PipelineOptions(
                granularity=granularity(config, device, rdma, contiguous),
                backlog=config.bench_layerwise_backlog,
                prefetch_layers=config.layerwise_prefetch_layers,
                max_transfer_blocks=config.layerwise_max_transfer_blocks,
                max_transfer_bytes=config.layerwise_max_transfer_bytes,
                staging_bytes=config.staging_bytes,
                full_pool_pause_s=config.full_pool_pause_s,
            ),
            load_deadline_s=config.load_deadline_s,
            save_deadline_s=config.save_deadline_s,
        )

    @property
    def described(self) -> str:
        return "layer by layer" if self.layerwise else "as whole blocks"

    def strategy(
        self, engine: TransferEngine, vllm_config: VllmConfig, device: str
    ) -> TransferStrategy:
        """The strategy that issues a step's transfers in this mode."""
        if self.layerwise:
            from hybridkv.integration.layerwise.vllm_window import build_vllm_layerwise

            context = vllm_config.compilation_config.static_forward_context
            return build_vllm_layerwise(
                engine, context, device, vllm_config, self.load_deadline_s, self.save_deadline_s
            )
        return WholeBlocks(engine, lambda: make_event(device), self.load_deadline_s)


def granularity(config: ConnectorConfig, device: str, rdma: bool, contiguous: bool) -> Granularity:
    """The configured granularity, or for "auto" the one that moves fewest pieces
    without losing the layer overlap where it pays.

    Host caches: "staged" (one piece per object; objects that are one run of cache
    memory move in place). Device caches have no host copy, so a piece per layer and
    cache entry, unless the object is one run of memory (`contiguous`: every group has
    a block-outermost layout). Over TCP each piece costs ~30-40 us, so "group" (one
    multi-buffer call per group) wins whenever the layer overlap cannot pay for the
    pieces: whole-block steps, and layerwise steps whose objects are single pieces.
    Layerwise steps over RDMA, or with objects in many pieces, use "layer": each
    layer moves while the next one computes.
    """
    on_host = device.split(":", 1)[0] == "cpu"
    if config.integrity_secret_env and not on_host:
        raise ValueError(
            f"integrity_secret_env: tags are computed by the CPU over host memory and "
            f"cannot cover caches on {device!r}: unset it there"
        )
    if config.granularity == "staged" and not on_host:
        raise ValueError(
            f"granularity 'staged' copies through host memory with the CPU and cannot "
            f"reach caches on {device!r}: use 'auto', 'layer' or 'group'"
        )
    if config.granularity != "auto":
        return config.granularity
    if on_host:
        return "staged"
    if config.use_layerwise and (rdma or not contiguous):
        return "layer"
    return "group"
