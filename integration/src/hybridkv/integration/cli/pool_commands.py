"""`hybridkv pool status|ls|du|evict`: what the pool holds, whose it is, and removing it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import msgspec

from hybridkv.integration.cli import pool
from hybridkv.integration.cli.common import (
    BAD_INPUT,
    NOT_READY,
    _admin,
    _emit,
    _fail,
    _mooncake_config,
    _selector,
)
from hybridkv.integration.cli.master_http import (
    SegmentUse,
)
from hybridkv.integration.cli.text import human_bytes, table
from hybridkv.integration.config import MOONCAKE_CONFIG_ENV
from hybridkv.transport.errors import Status
from hybridkv.transport.master_address import parse_master_address
from hybridkv.transport.mooncake_store import MooncakeStore

# A removal is a master call per key; larger batches only lengthen one call.
_REMOVE_BATCH = 1000
# The evicting client lends nothing and stages nothing: it only asks the master.
_EVICT_BUFFER_BYTES = 16 << 20


def _owner_cells(owner: pool.Owner) -> list[object]:
    if owner.format == "foreign":
        return ["(not a hybridkv key)", "", "", "", ""]
    if owner.namespace is not None:
        namespace = owner.namespace or "(default)"
    else:  # a hybrid key's is folded into its layout; a summary's spans several
        namespace = "(in layout)" if owner.layout is not None else ""
    pp = "" if owner.pp_rank is None else owner.pp_rank
    group = "" if owner.group is None else owner.group
    return [owner.model, namespace, owner.layout or "", pp, group]


_OWNER_HEADER = ["MODEL", "NAMESPACE", "LAYOUT", "PP", "GROUP"]


def _usage_table(rows: Sequence[pool.Usage]) -> str:
    total_objects = sum(row.objects for row in rows)
    total_bytes = sum(row.bytes for row in rows)
    body = table(
        [*_OWNER_HEADER, "OBJECTS", "BYTES", "SIZE"],
        [
            [*_owner_cells(row.owner), row.objects, row.bytes, human_bytes(row.bytes)]
            for row in rows
        ],
    )
    return f"{body}\ntotal: {total_objects} objects, {human_bytes(total_bytes)}"


# -- commands ------------------------------------------------------------------------


class PoolStatus(msgspec.Struct, frozen=True):
    master_admin: str
    role: str
    ready: bool
    master_rpc: str | None
    master_rpc_listening: bool | None
    segments: list[SegmentUse]
    capacity_bytes: int
    used_bytes: int
    objects: int
    foreign_objects: int


def _pool_status(args: argparse.Namespace) -> int:
    admin = _admin(args)
    health = admin.health()
    segments = admin.segments()
    keys = admin.list_keys()
    config = _mooncake_config(args)
    rpc = None if config is None else config.master_server_address
    listening = None if rpc is None else parse_master_address(rpc).reachable(timeout_s=0.5)
    capacity = sum(segment.capacity_bytes for segment in segments)
    used = sum(segment.used_bytes for segment in segments)
    foreign = sum(1 for key in keys if pool.owner_of(key).format == "foreign")
    status = PoolStatus(
        master_admin=admin.address,
        role=str(health.get("role", "")),
        ready=bool(health.get("service_ready", False)),
        master_rpc=rpc,
        master_rpc_listening=listening,
        segments=segments,
        capacity_bytes=capacity,
        used_bytes=used,
        objects=len(keys),
        foreign_objects=foreign,
    )
    share = f" ({100 * used / capacity:.1f}%)" if capacity else ""
    lines = [
        f"master    {admin.address} (admin): {status.role or '?'}, "
        f"{'serving' if status.ready else 'NOT serving'}",
    ]
    if rpc is not None:
        lines.append(f"rpc       {rpc}: {'listening' if listening else 'NOT listening'}")
    lines += [
        f"segments  {len(segments)}",
        *(
            f"  {segment.name}  {segment.status}  {human_bytes(segment.used_bytes)} used of "
            f"{human_bytes(segment.capacity_bytes)}"
            for segment in segments
        ),
        f"capacity  {human_bytes(capacity)}",
        f"used      {human_bytes(used)}{share}",
        f"objects   {len(keys)} ({foreign} not hybridkv's)",
    ]
    _emit(args, status, "\n".join(lines))
    return 0 if status.ready and (listening is not False) else NOT_READY


class Listed(msgspec.Struct, frozen=True):
    key: str
    owner: pool.Owner
    bytes: int | None = None


def _pool_ls(args: argparse.Namespace) -> int:
    admin = _admin(args)
    keys = pool.select(admin.list_keys(), _selector(args))
    sizes = admin.object_sizes(keys) if args.long or args.json else {}
    listed = [Listed(key, pool.owner_of(key), sizes.get(key)) for key in keys]
    if args.long:
        text = table(
            ["BYTES", *_OWNER_HEADER, "KEY"],
            [
                [item.bytes if item.bytes is not None else 0, *_owner_cells(item.owner), item.key]
                for item in listed
            ],
        )
    else:
        text = "\n".join(keys)
    _emit(args, listed, text)
    return 0


def _coarser(owner: pool.Owner, by: str) -> pool.Owner:
    if by == "group" or owner.format == "foreign":
        return owner
    if by == "namespace":
        return pool.Owner(owner.format, owner.model, owner.namespace, owner.layout, owner.pp_rank)
    return pool.Owner(owner.format, owner.model)


def _pool_du(args: argparse.Namespace) -> int:
    admin = _admin(args)
    keys = pool.select(admin.list_keys(), _selector(args))
    rows = pool.usage(keys, admin.object_sizes(keys))
    merged: dict[pool.Owner, tuple[int, int]] = {}
    for row in rows:
        owner = _coarser(row.owner, args.by)
        objects, size = merged.get(owner, (0, 0))
        merged[owner] = (objects + row.objects, size + row.bytes)
    coarse = [
        pool.Usage(owner, *merged[owner]) for owner in sorted(merged, key=pool.Owner.sort_key)
    ]
    _emit(args, coarse, _usage_table(coarse))
    return 0


class Eviction(msgspec.Struct, frozen=True):
    dry_run: bool
    selector: pool.Selector
    removed: list[str]
    usage: list[pool.Usage]
    failed: dict[str, str]
    hybrid_not_selected: int


def _connect(args: argparse.Namespace) -> MooncakeStore:
    """A client that lends and stages nothing (Mooncake itself is imported only here)."""
    config = _mooncake_config(args)
    if config is None:
        _fail(
            f"evicting needs a Mooncake client: pass --mooncake-config or set "
            f"{MOONCAKE_CONFIG_ENV}",
            BAD_INPUT,
        )
    client = msgspec.structs.replace(
        config,
        global_segment_size=0,
        local_buffer_size=_EVICT_BUFFER_BYTES,
        mode=None,
        preferred_segment=False,
        prefer_alloc_in_same_node=False,
        enable_client_http_server=False,
    )
    return MooncakeStore.connect(client)


def _pool_evict(args: argparse.Namespace) -> int:
    selector = _selector(args)
    admin = _admin(args)
    everything = admin.list_keys()
    chosen = pool.select(everything, selector)
    sizes = admin.object_sizes(chosen)
    failed: dict[str, str] = {}
    removed = chosen
    if chosen and not args.dry_run:
        store = _connect(args)
        try:
            statuses: list[Status] = []
            for start in range(0, len(chosen), _REMOVE_BATCH):
                statuses += store.batch_remove(chosen[start : start + _REMOVE_BATCH], force=True)
        finally:
            store.close()
        # An object gone meanwhile (evicted, removed by another) is not there either way.
        gone = (Status.OK, Status.NOT_FOUND)
        failed = {k: s.name for k, s in zip(chosen, statuses, strict=True) if s not in gone}
        removed = [key for key in chosen if key not in failed]
    report = Eviction(
        dry_run=args.dry_run,
        selector=selector,
        removed=removed,
        usage=pool.usage(removed, sizes),
        failed=failed,
        hybrid_not_selected=pool.unread_namespaces(everything, selector),
    )
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} {len(removed)} objects ({human_bytes(sum(u.bytes for u in report.usage))})"]
    if removed:
        lines.append(_usage_table(report.usage))
    if args.verbose:
        lines += [f"  {key}" for key in removed]
    if failed:
        lines.append(f"NOT removed: {len(failed)} objects")
        lines += [f"  {key}: {status}" for key, status in failed.items()]
    if report.hybrid_not_selected:
        lines.append(
            f"note: {report.hybrid_not_selected} objects of this model are in the hybrid key "
            "format, whose namespace is folded into the layout digest: select them with "
            "--layout (see `hybridkv pool du --model ...`)"
        )
    _emit(args, report, "\n".join(lines))
    return NOT_READY if failed else 0
