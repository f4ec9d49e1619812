"""vLLM's KV cache groups as hybridkv sees them: a coordinator kind, who stores, a digest.

One small translator per vLLM spec class, found through a registry keyed by class (walking
the MRO, so subclasses such as MLA specs inherit their parent's translation). A spec with no
translator stops start-up: guessing how its blocks relate to a prefix could serve wrong KV.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.coordinator import (
    ChunkedLocal,
    Coordinator,
    FullAttention,
    GroupKind,
    RecurrentState,
    SlidingWindow,
)
from hybridkv.keys import scope_digest, topology_digest


@dataclass(frozen=True)
class HeadPlan:
    """Which TP ranks write a group's objects and which object each rank reads.

    `storing` distinct objects exist per block. When fewer KV heads than TP ranks exist,
    consecutive ranks hold the same heads: all of a run read each object, and they take
    turns writing them, block by block, so no rank carries every put of a replicated head
    (MLA's latent at TP=8: each rank puts an eighth of the blocks). `stripe` shifts the
    turns (the group's position in the plan), so the groups' first blocks start on
    different ranks.
    """

    storing: int
    tp_size: int
    stripe: int = 0

    def __post_init__(self) -> None:
        if self.storing < 1 or self.tp_size % self.storing:
            raise ValueError(
                f"{self.storing} storing heads do not divide tp_size {self.tp_size} evenly"
            )

    @property
    def replicas(self) -> int:
        return self.tp_size // self.storing

    def head_of(self, tp_rank: int) -> int:
        return tp_rank // self.replicas

    def writes(self, tp_rank: int, block_index: int) -> bool:
        """Whether `tp_rank` puts its head's object of logical block `block_index`."""
        return tp_rank % self.replicas == (block_index + self.stripe) % self.replicas

    @property
    def heads(self) -> range:
        return range(self.storing)


@dataclass(frozen=True)
class GroupPlan:
    """One prefix-cacheable vLLM group: its id in vLLM, coordinator kind, layers, signature,
    and whether vLLM drops EAGLE's block from its hits (when speculative decoding drops one)."""

    vllm_group_id: int
    kind: GroupKind
    layer_names: tuple[str, ...]
    signature: dict[str, Any]
    heads: HeadPlan
    drafted: bool = True

    @property
    def block_size(self) -> int:
        return self.kind.block_size


@dataclass(frozen=True)
class ModelShape:
    """What the translators need beyond the spec itself."""

    tp_size: int
    total_kv_heads: int
    # The memory order of a cache block's heads (H), tokens (N) and channels (C), from
    # vLLM's KV cache layout (LBNHC: "NHC"). Instances lay a block's bytes out alike only
    # when it matches; with one head slot per page every order gives the same bytes.
    block_interior: str = "HNC"


_Translation = tuple[GroupKind, dict[str, Any], int]
_Translator = Callable[[Any, ModelShape], _Translation]
_TRANSLATORS: dict[type, _Translator] = {}


def translator(*spec_types: type) -> Callable[[_Translator], _Translator]:
    """Register the translation of a vLLM spec class (used at import of the vLLM specs)."""

    def register(function: _Translator) -> _Translator:
        for spec_type in spec_types:
            _TRANSLATORS[spec_type] = function
        return function

    return register


def _attention_signature(spec: Any, shape: ModelShape) -> dict[str, Any]:
    """In whole-model terms: every topology of one model computes the same signature
    (heads are the model's total, bytes are per head), unless a page does not split into
    equal heads (padding), where the page and the TP size name it instead."""
    sharded = spec.num_kv_heads < shape.total_kv_heads
    heads = shape.total_kv_heads if sharded else spec.num_kv_heads
    signature = {
        "spec": type(spec).__name__,
        "block_size": spec.block_size,
        "kv_heads": heads,
        "head_size": spec.head_size,
        "dtype": str(spec.dtype),
    }
    if spec.page_size_bytes % spec.num_kv_heads:
        signature |= {"page_bytes": spec.page_size_bytes, "tp_size": shape.tp_size}
    else:
        signature["head_bytes"] = spec.page_size_bytes // spec.num_kv_heads
    # The order of heads and tokens moves bytes only where a page holds several of each
    # (its head slots: some backends pack one KV head into two); across TP sizes a page
    # holds a share of the model's heads, so the model's count decides.
    if max(spec.num_heads, heads) > 1 and spec.num_states > 1:
        signature["block_interior"] = shape.block_interior
    return signature


def _attention_storing(shape: ModelShape) -> int:
    # Heads split over ranks; with fewer heads than ranks, each head is held by a run of
    # ranks and stored once.
    return math.gcd(min(shape.total_kv_heads, shape.tp_size), shape.tp_size)


def translate(spec: Any, shape: ModelShape) -> _Translation:
    """(kind, signature, storing heads) of one group's spec, or a ValueError naming it."""
    for spec_type in type(spec).__mro__:
        found = _TRANSLATORS.get(spec_type)
        if found is not None:
            return found(spec, shape)
    raise ValueError(
        f"hybridkv cannot store KV cache groups of type {type(spec).__name__}: "
        f"supported are {sorted(t.__name__ for t in _TRANSLATORS)}"
    )


def _register_vllm_specs() -> None:
    """Bind the translators to vLLM's spec classes (imported only when vLLM is present)."""
    from vllm.v1 import kv_cache_interface as specs

    @translator(specs.FullAttentionSpec)
    def _full(spec: Any, shape: ModelShape) -> _Translation:
        signature = _attention_signature(spec, shape)
        return FullAttention(spec.block_size), signature, _attention_storing(shape)

    @translator(specs.MLAAttentionSpec)
    def _mla(spec: Any, shape: ModelShape) -> _Translation:
        # The latent cache is replicated on every TP rank: one object per block.
        return FullAttention(spec.block_size), _attention_signature(spec, shape), 1

    @translator(specs.SlidingWindowSpec)
    def _sliding(spec: Any, shape: ModelShape) -> _Translation:
        signature = {**_attention_signature(spec, shape), "window": spec.sliding_window}
        kind = SlidingWindow(spec.block_size, spec.sliding_window)
        return kind, signature, _attention_storing(shape)

    @translator(specs.ChunkedLocalAttentionSpec)
    def _chunked(spec: Any, shape: ModelShape) -> _Translation:
        signature = {**_attention_signature(spec, shape), "chunk": spec.attention_chunk_size}
        kind = ChunkedLocal(spec.block_size, spec.attention_chunk_size)
        return kind, signature, _attention_storing(shape)

    @translator(specs.MambaSpec)
    def _mamba(spec: Any, shape: ModelShape) -> _Translation:
        if spec.mamba_cache_mode != "align":
            raise ValueError(
                f"Mamba groups need mamba_cache_mode='align' (got {spec.mamba_cache_mode!r}): "
                "only then does a block hold the state at its end boundary; enable prefix "
                "caching or pass mamba_cache_mode='align'"
            )
        # A state sharded by TP holds this TP size's share (`shards`): the shapes of the
        # unsharded state are the model's own, which no rule gives for every state type.
        shards = 1 if spec.tp_replicated else shape.tp_size
        signature = {
            "spec": type(spec).__name__,
            "block_size": spec.block_size,
            "page_bytes": spec.page_size_bytes,
            "shapes": [list(s) for s in spec.shapes],
            "dtypes": [str(d) for d in spec.dtypes],
            "mamba_type": str(spec.mamba_type),
            "shards": shards,
        }
        storing = shards
        return RecurrentState(spec.block_size), signature, storing

    @translator(specs.UniformTypeKVCacheSpecs)
    def _uniform(spec: Any, shape: ModelShape) -> _Translation:
        # One group of layers of one attention type with pages of different sizes (e.g.
        # DeepSeek-V3.2's MLA latent and indexer keys). vLLM hands the scheduler the first
        # member's spec in its place, so that one speaks for the group in both roles; each
        # layer's own bytes come from its cache tensor.
        translations = {
            name: translate(member, shape) for name, member in spec.kv_cache_specs.items()
        }
        first = next(iter(translations.values()))
        for name, (kind, _, storing) in translations.items():
            if (kind, storing) != (first[0], first[2]):
                raise ValueError(
                    f"UniformTypeKVCacheSpecs: layer {name} is {kind} stored by {storing} "
                    f"heads, the group's first layer {first[0]} stored by {first[2]}"
                )
        return first

    @translator(specs.RSWASpec)
    def _rswa(spec: Any, shape: ModelShape) -> _Translation:
        # A full-attention subclass whose generated tokens attend to a window of the others:
        # their KV differs from a prompt's, and vLLM frees blocks behind that window.
        raise ValueError(
            "hybridkv cannot store RSWASpec groups: a generated token's KV attends to only "
            f"the last {spec.rswa_window} generated tokens, so it is not the KV a prompt "
            "with the same tokens computes"
        )

    @translator(specs.CrossAttentionSpec, specs.EncoderOnlyAttentionSpec)
    def _refuse(spec: Any, shape: ModelShape) -> _Translation:
        raise ValueError(
            f"hybridkv cannot store {type(spec).__name__} groups: their KV does not follow "
            "the prompt prefix"
        )


@dataclass(frozen=True)
class KVPlan:
    """Everything both connector roles derive from `kv_cache_config`, identically."""

    groups: tuple[GroupPlan, ...]
    tp_size: int
    # The topology digest: the keys' `layout` field (see `hybridkv.keys.topology_digest`).
    digest: str
    # The topology-free scope block hashes chain under (`hybridkv.keys.scope_digest`).
    scope: str
    hash_block_size: int
    pp_size: int = 1
    # vLLM's scheduler block size: the LCM over ALL its groups, those not stored included.
    scheduler_block_size: int = 1
    # What besides the layout makes one prefix's KV differ (see `weights_identity`).
    weights: str = ""

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def coordinator(self, use_eagle: bool = False) -> Coordinator:
        """`use_eagle`: vLLM drops the last matched block of its own hits (EAGLE, MTP) in
        the drafted groups and keeps Mamba states one block back to match; hits from the
        pool do the same."""
        # vLLM's own hits land on block boundaries, inside local-attention chunks too.
        drafted = [index for index, group in enumerate(self.groups) if group.drafted]
        return Coordinator(
            [group.kind for group in self.groups],
            alignment=self.alignment,
            use_eagle=use_eagle,
            eagle_groups=drafted if use_eagle else None,
        )

    @property
    def alignment(self) -> int:
        """Where hits may land: vLLM's own hits land on its scheduler block size (groups
        not stored, such as a replayed window, count too)."""
        return math.lcm(self.scheduler_block_size, *(group.block_size for group in self.groups))


def plan_groups(
    kv_cache_groups: Sequence[Any],
    group_ids: Sequence[int],
    shape: ModelShape,
    namespace: str = "",
    pp_stages: Sequence[tuple[int, int]] = (),
    weights: str = "",
    num_layers: int | None = None,
) -> KVPlan:
    """Translate the prefix-cacheable groups `group_ids` of a vLLM kv_cache_config.

    `pp_stages`: the `[start, end)` model layers of each pipeline stage (none: no stages).
    Each stage holds its own layers of every group and keys its objects by stage.
    `num_layers`: the model's layers (default: the stages' end, else the layer names).
    vLLM groups the whole model's layers before it gives each stage its share, so group
    ids and whole-model signatures name the scope whichever stage asks (a stage's
    kv_cache_config names its own layers only, the scheduler's the first stage's)."""
    if not _TRANSLATORS:
        _register_vllm_specs()
    if not group_ids:
        raise ValueError("the model has no prefix-cacheable KV cache group to store")
    plans: list[GroupPlan] = []
    drafted = _drafted_specs(kv_cache_groups, group_ids)
    for group_id in group_ids:
        group = kv_cache_groups[group_id]
        try:
            kind, signature, storing = translate(group.kv_cache_spec, shape)
        except ValueError as exc:
            raise ValueError(f"KV cache group {group_id}: {exc}") from exc
        plans.append(
            GroupPlan(
                vllm_group_id=group_id,
                kind=kind,
                layer_names=tuple(sorted(group.layer_names)),
                signature=signature,
                heads=HeadPlan(storing, shape.tp_size, stripe=len(plans)),
                drafted=any(group.kv_cache_spec == spec for spec in drafted),
            )
        )
    if num_layers is None:
        names = {name for group in kv_cache_groups for name in group.layer_names}
        num_layers = pp_stages[-1][1] if pp_stages else len(names)
    scope = scope_digest(
        [(plan.vllm_group_id, plan.signature) for plan in plans], num_layers, namespace or None
    )
    return KVPlan(
        groups=tuple(plans),
        tp_size=shape.tp_size,
        digest=topology_digest(scope, shape.tp_size, pp_stages),
        hash_block_size=math.gcd(*(plan.block_size for plan in plans)),
        scope=scope,
        pp_size=max(1, len(pp_stages)),
        scheduler_block_size=math.lcm(
            *(group.kv_cache_spec.block_size for group in kv_cache_groups)
        ),
        weights=weights,
    )


def _drafted_specs(kv_cache_groups: Sequence[Any], group_ids: Sequence[int]) -> list[Any]:
    """The specs whose groups vLLM's coordinator drops EAGLE's block from: those of the
    groups it marks as the draft head's (`is_eagle_group`), or of every group when it marks
    none. A marked prefix-cacheable group passes the drop on to the groups of an equal spec,
    which vLLM looks up together; a marked group outside the lookup passes on nothing.
    (vLLM also asks for the same manager class and block pool: they differ only in HiSparse
    layouts, which no translator accepts.)"""
    marked = [
        group_id
        for group_id, group in enumerate(kv_cache_groups)
        if getattr(group, "is_eagle_group", False)
    ]
    sources = marked or group_ids
    return [kv_cache_groups[i].kv_cache_spec for i in sources if i in group_ids]
