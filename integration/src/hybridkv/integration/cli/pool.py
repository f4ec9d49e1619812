"""Whose objects a pool holds: keys read with `parse_key`, summed, and selected for eviction.

Namespaces show differently in the two key formats (see `keying.KeySpace`): a
single-group key carries it in its model field, `{model}~{namespace}`; a hybrid key folds
it into its layout digest, so the namespace of a hybrid key cannot be read back, only its
layout. Selection follows that: `--namespace` picks single-group keys, `--layout` hybrid
ones, and a hybrid key is never taken for a namespace it may not belong to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from hybridkv.keys import HybridKey, KeyFormatError, parse_key

Format = Literal["single-group", "hybrid", "foreign"]
NAMESPACE_MARK = "~"


class Owner(msgspec.Struct, frozen=True):
    """What a key belongs to: one KV cache group of one model's deployment.

    `namespace` is None where the key does not say (hybrid keys; foreign keys); `layout`
    and `pp_rank` exist for hybrid keys only. Foreign keys (not hybridkv's, e.g. another
    connector's) have model "" and are never selected for eviction. A summary over
    several groups or namespaces leaves those fields None.
    """

    format: Format
    model: str
    namespace: str | None = None
    layout: str | None = None
    pp_rank: int | None = None
    group: int | None = None

    def sort_key(self) -> tuple[str, str, str, str, int, int]:
        """Owners in a stable order (None first), whatever fields they leave out."""
        return (
            self.format,
            self.model,
            self.namespace or "",
            self.layout or "",
            -1 if self.pp_rank is None else self.pp_rank,
            -1 if self.group is None else self.group,
        )


class Usage(msgspec.Struct, frozen=True):
    """Objects and bytes of one owner (bytes: objects the master still knew when sized)."""

    owner: Owner
    objects: int
    bytes: int


def owner_of(key: str) -> Owner:
    """The owner a key names; `foreign` for text that is no hybridkv key."""
    try:
        parsed = parse_key(key)
    except KeyFormatError:
        return Owner(format="foreign", model="")
    if isinstance(parsed, HybridKey):
        return Owner("hybrid", parsed.model, None, parsed.layout, parsed.pp_rank, parsed.group)
    model, mark, namespace = parsed.model.partition(NAMESPACE_MARK)
    return Owner("single-group", model, namespace if mark else "", group=0)


def usage(keys: Iterable[str], sizes: Mapping[str, int]) -> list[Usage]:
    """Objects and bytes per owner, sorted by owner."""
    objects: dict[Owner, int] = {}
    total: dict[Owner, int] = {}
    for key in keys:
        owner = owner_of(key)
        objects[owner] = objects.get(owner, 0) + 1
        total[owner] = total.get(owner, 0) + sizes.get(key, 0)
    return [
        Usage(owner, objects[owner], total[owner]) for owner in sorted(objects, key=Owner.sort_key)
    ]


class Selector(msgspec.Struct, frozen=True):
    """Which objects a command acts on; None: any.

    `model` is the key's model field (the last path component of what vLLM was given).
    `namespace` selects single-group keys ("" is the default namespace), `layout`
    hybrid ones; given one and not the other, keys of the other format are left alone.
    """

    model: str | None = None
    namespace: str | None = None
    layout: str | None = None
    group: int | None = None

    def matches(self, owner: Owner) -> bool:
        if owner.format == "foreign":
            return self == Selector()  # only an empty selector lists foreign keys
        if self.model is not None and owner.model != self.model:
            return False
        if self.group is not None and owner.group != self.group:
            return False
        if owner.format == "single-group":
            own, other = self.namespace, self.layout
            value = owner.namespace
        else:
            own, other = self.layout, self.namespace
            value = owner.layout
        if own is not None:
            return value == own
        # Filtered by the other format's field only: this key cannot be told to match it.
        return other is None


def select(keys: Iterable[str], selector: Selector) -> list[str]:
    """The keys `selector` matches, in the order given."""
    return [key for key in keys if selector.matches(owner_of(key))]


def unread_namespaces(keys: Sequence[str], selector: Selector) -> int:
    """Hybrid keys of the selected model left out because `--namespace` cannot reach them."""
    if selector.namespace is None or selector.layout is not None:
        return 0
    everywhere = msgspec.structs.replace(selector, namespace=None)
    return sum(
        1
        for key in keys
        if (owner := owner_of(key)).format == "hybrid" and everywhere.matches(owner)
    )
