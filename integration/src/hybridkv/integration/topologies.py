"""Reading what a writer of another topology (TP size, pipeline stages) stored.

The reader learns the writer's cut from its config keys (`WriterTopology`), never from
the pool. vLLM groups the whole model's layers before it gives each stage its share, so
a writer's groups are the reader's own, translated for the writer's TP size and stages
(`writer_plan`): its topology digest names its keys, and its objects are described as
`ObjectMap`s from the reader's own caches (every layer of a group has the same caches;
a cache's bytes split by units, KV heads outermost in a block). `plan_reads` then says
which writer bytes fill which of this rank's bytes; `WriterReads` turns that into one
transport layout per writer object a block needs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridkv.coordinator import RecurrentState
from hybridkv.integration.groups import GroupPlan, KVPlan
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.metadata import BlockRef
from hybridkv.keys import Entry, ObjectMap, Source, Span, plan_reads
from hybridkv.transport import BlockTransfer, GroupLayout

logger = logging.getLogger(__name__)


def refuse_unreadable(reader: KVPlan, writer: KVPlan, block_interior: str) -> None:
    """Stop start-up, with the reason, where this reader cannot read the writer's objects."""
    if writer.tp_size != reader.tp_size:
        states = [g.vllm_group_id for g in reader.groups if isinstance(g.kind, RecurrentState)]
        if states:
            raise ValueError(
                f"reading a writer of TP size {writer.tp_size} from TP size "
                f"{reader.tp_size}: KV cache groups {states} hold states (Mamba, conv, GDN) "
                "that TP shards per state type, and vLLM sizes the attention blocks of such "
                "a model by the per-rank state page; only the same TP size is readable"
            )
        nested = [g.vllm_group_id for g in reader.groups if "block_interior" in g.signature]
        if nested and block_interior != "HNC":
            raise ValueError(
                f"reading a writer of TP size {writer.tp_size} from TP size "
                f"{reader.tp_size}: the KV cache layout puts heads inside each token "
                f"({block_interior}), so a head range is not one run of a block (groups "
                f"{nested}); use a layout with heads outermost (HNC) or the same TP size"
            )
    if writer.scope != reader.scope:
        differing = [
            mine.vllm_group_id
            for mine, theirs in zip(reader.groups, writer.groups, strict=True)
            if mine.signature != theirs.signature
        ]
        raise ValueError(
            f"the writer topology (TP size {writer.tp_size}, {writer.pp_size} stages) caches "
            f"KV cache groups {differing} differently from this reader"
        )


def group_units(group: GroupPlan) -> int:
    """The model's units a group's caches split into over TP ranks: KV heads (attention),
    shards (a state TP shards; 1 where every rank holds it whole)."""
    units: int = group.signature.get("kv_heads") or group.signature["shards"]
    return units


@dataclass(frozen=True)
class LayerCaches:
    """The caches of every layer of one group, from one of this rank's layers: (cache name
    inside the layer, bytes per unit), in the transport's order (by full name)."""

    caches: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, group: GroupPlan, layout: GroupLayout, names: Mapping[int, str]) -> LayerCaches:
        """From this rank's entries (`names`: physical layer -> layer name); every layer
        must hold the same caches."""
        units = group_units(group)
        per_rank = max(1, units // group.heads.storing)
        seen: dict[str, tuple[tuple[str, int], ...]] = {}
        for layer in layout.layers:
            name = names[layer]
            caches = []
            for index in layout.entries_of_layer(layer):
                entry = layout.entries[index]
                if entry.block_bytes % per_rank:
                    raise ValueError(
                        f"{entry.name}: {entry.block_bytes} bytes per block do not split "
                        f"into {per_rank} equal units"
                    )
                caches.append((entry.name[len(name) :], entry.block_bytes // per_rank))
            seen[name] = tuple(caches)
        first = next(iter(seen.values()))
        odd = [name for name, caches in seen.items() if caches != first]
        if odd:
            raise ValueError(
                f"KV cache group {group.vllm_group_id}: layers {odd} hold other caches than "
                f"{next(iter(seen))}; another topology's objects cannot be described"
            )
        return cls(first)


def whole_model_layers(
    stage_layers: Mapping[int, str],
    stage: tuple[int, int],
    num_layers: int,
    layer_types: Sequence[str] | None = None,
) -> dict[int, str]:
    """Physical layer -> name of one group over the whole model, from this stage's.

    A stage names only its own layers, all named alike but for the index. A group holding
    every layer of the stage holds every layer of the model. Else the model's
    `layer_types` (one per layer, as Hugging Face configs give them) tell it, where each
    type is one group (`one_group_per_type`): the group holds every layer of its type.
    """
    if stage == (0, num_layers):
        return dict(stage_layers)
    templates = {_template(index, name) for index, name in stage_layers.items()}
    held = _layers_of_type(stage_layers, stage, layer_types)
    if held is None and set(stage_layers) == set(range(*stage)):
        held = list(range(num_layers))
    if held is None or len(templates) != 1:
        raise ValueError(
            f"a pipeline stage reading another topology needs every layer's name: this "
            f"stage's group of layers {sorted(stage_layers)} does not tell them for "
            f"layers [0, {num_layers}), and the model's layer_types do not either"
        )
    [template] = templates
    return {index: template.format(index) for index in held}


def _layers_of_type(
    stage_layers: Mapping[int, str], stage: tuple[int, int], layer_types: Sequence[str] | None
) -> list[int] | None:
    """Every layer of the type this group's stage layers share, if they are every layer
    of that type in the stage; None where `layer_types` cannot tell."""
    if layer_types is None:
        return None
    types = {layer_types[index] for index in stage_layers}
    if len(types) != 1:
        return None
    [kind] = types
    if {i for i in range(*stage) if layer_types[i] == kind} != set(stage_layers):
        return None
    return [index for index, each in enumerate(layer_types) if each == kind]


def one_group_per_type(plan: KVPlan, layer_types: Sequence[str] | None) -> Sequence[str] | None:
    """`layer_types` where each type is exactly one of the plan's groups (vLLM splits a
    type into several groups where types differ in count): None where it is not."""
    if layer_types is None or len(set(layer_types)) != len(plan.groups):
        return None
    return layer_types


def _template(index: int, name: str) -> str:
    parts = name.replace("{", "{{").replace("}", "}}").split(".")
    matches = [i for i, part in enumerate(parts) if part == str(index)]
    if len(matches) != 1:
        return name  # no single index to substitute: never a shared template
    parts[matches[0]] = "{}"
    return ".".join(parts)


def object_maps(
    plan: KVPlan,
    stages: Mapping[int, tuple[int, int]],
    layers: Sequence[Mapping[int, str]],
    caches: Sequence[LayerCaches],
    tp_rank: int | None = None,
) -> list[ObjectMap]:
    """The objects a topology writes per block, one per (stage, group, storing shard).

    `stages`: stage -> its `[start, end)` layers; `layers`, `caches`: per plan group, its
    layers (physical layer -> name) and their caches. `tp_rank`: only the objects that
    rank fills (its own storing shard of each group)."""
    maps = []
    for stage, (start, stop) in sorted(stages.items()):
        for group, names, layer_caches in zip(plan.groups, layers, caches, strict=True):
            held = sorted((index, name) for index, name in names.items() if start <= index < stop)
            if not held:
                continue
            heads = group.heads
            count = max(1, group_units(group) // heads.storing)
            wanted = heads.heads if tp_rank is None else [heads.head_of(tp_rank)]
            for shard in wanted:
                entries = tuple(
                    Entry(name, cache, count * unit, Span(shard * count, count, unit))
                    for _, name in held
                    for cache, unit in sorted(layer_caches.caches, key=lambda c: name + c[0])
                )
                maps.append(ObjectMap(stage, group.vllm_group_id, shard, entries))
    return maps


class WriterReads:
    """This rank's reads of the writer topology's objects.

    One transport layout per writer object a reader object needs: its pieces, in the
    writer object's order, point into this rank's caches. A block's load reads every such
    object; any of them failing fails the block (vLLM recomputes it)."""

    def __init__(
        self,
        writer_keys: Sequence[KeySpace],
        reader_layouts: Sequence[GroupLayout],
        reads: Sequence[tuple[int, Source, int]],
    ) -> None:
        """`writer_keys`: the writer's key space per stage. `reads`: (plan group, source,
        writer object size) of every object this rank reads."""
        self.layouts: list[GroupLayout] = []
        # per reader plan group: (layout id, the writer stage's key space, its plan
        # group, storing shard) of every writer object a block of it needs
        self._sources: dict[int, list[tuple[int, KeySpace, int, int]]] = {}
        self._plan_group: dict[int, int] = {}
        next_id = len(reader_layouts)
        for group, source, size in reads:
            ident = next_id
            next_id += 1
            self.layouts.append(_piece_layout(ident, group, reader_layouts[group], source, size))
            keys = writer_keys[source.stage]
            writer_group = _group_index(keys.plan, source.group)
            self._sources.setdefault(group, []).append((ident, keys, writer_group, source.shard))
            self._plan_group[ident] = group

    def transfers(self, ref: BlockRef, request_id: str, owner_index: int) -> list[BlockTransfer]:
        """The reads of one reader block: one per writer object it needs."""
        transfers = []
        for ident, keys, group, shard in self._sources[ref.group]:
            [key] = keys.keys(group, [ref.block_hash], [shard])
            transfers.append(BlockTransfer(key, ident, ref.block_id, request_id, owner_index))
        return transfers

    def plan_group(self, layout_id: int) -> int:
        """The plan group a layout id loads (its own for this rank's own layouts)."""
        return self._plan_group.get(layout_id, layout_id)


def _group_index(plan: KVPlan, vllm_group_id: int) -> int:
    return next(i for i, g in enumerate(plan.groups) if g.vllm_group_id == vllm_group_id)


def _piece_layout(
    ident: int, group: int, reader: GroupLayout, source: Source, size: int
) -> GroupLayout:
    """A read-only layout of the writer object `source` names (`size` bytes): its pieces
    at their places in this rank's caches of plan group `group`, whose blocks fail when
    it fails. A rank that reads part of the object reads only those pieces."""
    return GroupLayout.partial(
        ident,
        group,
        size,
        [
            (
                reader.entries[piece.dst_entry].piece(piece.dst_offset, piece.length),
                piece.src_offset,
            )
            for piece in source.pieces
        ],
    )


def rank_reads(
    reader: KVPlan,
    writer: KVPlan,
    writer_stages: Sequence[tuple[int, int]],
    reader_stage: tuple[int, int],
    pp_rank: int,
    tp_rank: int,
    layouts: Sequence[GroupLayout],
    layer_names: Mapping[int, str],
    num_layers: int,
    layer_types: Sequence[str] | None = None,
) -> list[tuple[int, Source, int]]:
    """(plan group, writer object, its size) of every writer object this rank reads:
    `plan_reads` over this rank's objects and the writer's, computed once at start-up.
    `layer_names`: physical layer -> name of this stage's layers; `layer_types`: the
    model's, one per layer, if its config gives them."""
    stage_names = [{layer: layer_names[layer] for layer in layout.layers} for layout in layouts]
    caches = [
        LayerCaches.of(group, layout, names)
        for group, layout, names in zip(reader.groups, layouts, stage_names, strict=True)
    ]
    types = one_group_per_type(reader, layer_types)
    whole = [whole_model_layers(names, reader_stage, num_layers, types) for names in stage_names]
    own = object_maps(reader, {pp_rank: reader_stage}, stage_names, caches, tp_rank)
    theirs = object_maps(writer, dict(enumerate(writer_stages or [(0, num_layers)])), whole, caches)
    sizes = {m.ident: m.size for m in theirs}
    index = {g.vllm_group_id: i for i, g in enumerate(reader.groups)}
    return [
        (index[reads.group], source, sizes[(source.stage, source.group, source.shard)])
        for reads in plan_reads(own, theirs)
        for source in reads.sources
    ]
