"""`hybridkv`: the operator's tool for a hybridkv deployment and its Mooncake pool.

Commands: `doctor` (are these settings and this host ready), `pool status|ls|du|evict`
(what the pool holds, whose it is, removing one model's objects) and `keys explain`.
Nothing here imports vLLM or torch, so it runs on any host that reaches the pool.
Exit status: 0 done, 1 the pool or host is not ready (unreachable master, no Mooncake
client, objects not removed), 2 bad input (arguments, settings, keys).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, NoReturn

import msgspec

from hybridkv.integration.cli import doctor, pool
from hybridkv.integration.cli.master_http import (
    MasterHttp,
    MasterUnreachableError,
    SegmentUse,
    default_address,
)
from hybridkv.integration.cli.text import human_bytes, table
from hybridkv.integration.config import MOONCAKE_CONFIG_ENV
from hybridkv.keys import KeyFormatError, model_name, parse_key
from hybridkv.keys.__main__ import explain
from hybridkv.transport.config import MooncakeConfig
from hybridkv.transport.errors import Status, StoreError
from hybridkv.transport.master import is_listening, split_address
from hybridkv.transport.mooncake_store import MooncakeStore

__all__ = ["main"]

BAD_INPUT = 2
NOT_READY = 1
# A removal is a master call per key; larger batches only lengthen one call.
_REMOVE_BATCH = 1000
# The evicting client lends nothing and stages nothing: it only asks the master.
_EVICT_BUFFER_BYTES = 16 << 20


class CliError(Exception):
    """An expected failure: printed as one line, exiting with `status`."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _fail(message: str, status: int) -> NoReturn:
    raise CliError(message, status)


# -- where the pool is ---------------------------------------------------------------


def _mooncake_config(args: argparse.Namespace) -> MooncakeConfig | None:
    path = args.mooncake_config or os.environ.get(MOONCAKE_CONFIG_ENV)
    if not path:
        return None
    try:
        return MooncakeConfig.from_json_file(path)
    except (OSError, ValueError) as exc:
        _fail(f"Mooncake config: {exc}", BAD_INPUT)


def _admin(args: argparse.Namespace) -> MasterHttp:
    if args.master_http:
        return MasterHttp(args.master_http)
    config = _mooncake_config(args)
    if config is None:
        _fail(
            f"no pool given: pass --master-http HOST:PORT (the master's metrics port) or "
            f"--mooncake-config / {MOONCAKE_CONFIG_ENV}",
            BAD_INPUT,
        )
    return MasterHttp(default_address(config.master_server_address))


def _selector(args: argparse.Namespace) -> pool.Selector:
    try:
        model = None if args.model is None else model_name(args.model)
    except KeyFormatError as exc:
        _fail(f"--model: {exc}", BAD_INPUT)
    return pool.Selector(
        model=model,
        namespace=args.namespace,
        layout=args.layout,
        group=getattr(args, "group", None),
    )


def _emit(args: argparse.Namespace, value: Any, text: str) -> None:
    if args.json:
        sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
    else:
        print(text)


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
    listening = None if rpc is None else is_listening(*split_address(rpc))
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


class Explained(msgspec.Struct, frozen=True):
    key: str
    format: str
    fields: dict[str, Any]
    owner: pool.Owner


def _keys_explain(args: argparse.Namespace) -> int:
    status = 0
    explained: list[Explained] = []
    texts: list[str] = []
    for text in args.keys:
        try:
            parsed = parse_key(text)
        except KeyFormatError as exc:
            print(f"hybridkv: error: invalid key {text!r}: {exc}", file=sys.stderr)
            status = BAD_INPUT
            continue
        owner = pool.owner_of(text)
        explained.append(Explained(text, owner.format, msgspec.structs.asdict(parsed), owner))
        namespace = (
            "(folded into the layout digest)" if owner.namespace is None else owner.namespace
        )
        texts.append(f"{explain(parsed)}\n{'namespace':<10}  {namespace or '(default)'}")
    if explained:
        _emit(args, explained, "\n\n".join(texts))
    return status


def _doctor(args: argparse.Namespace) -> int:
    config_path = args.mooncake_config or os.environ.get(MOONCAKE_CONFIG_ENV)
    report = doctor.diagnose(config_path, args.kv_transfer_config, args.master_http)
    _emit(
        args,
        {**msgspec.structs.asdict(report), "exit_status": report.exit_status},
        doctor.render(report),
    )
    return report.exit_status


# -- parser --------------------------------------------------------------------------


def _version() -> str:
    try:
        return metadata.version("hybridkv-integration")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", help="print JSON for scripts")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--mooncake-config",
        metavar="PATH",
        help=f"Mooncake JSON config (default: ${MOONCAKE_CONFIG_ENV})",
    )
    where.add_argument(
        "--master-http",
        metavar="HOST:PORT",
        help="the master's admin endpoint, its --metrics_port (default: the config's "
        "master host, port 9003)",
    )
    select = argparse.ArgumentParser(add_help=False)
    select.add_argument("--model", help="a model as vLLM was given it (path or hub id)")
    select.add_argument(
        "--namespace",
        help="the connector's namespace ('' for the default); selects single-group keys",
    )
    select.add_argument("--layout", help="a layout digest; selects hybrid keys")

    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="The operator's tool for a hybridkv deployment and its Mooncake pool.",
        epilog="Exit status: 0 done, 1 pool or host not ready, 2 bad input.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser(
        "doctor",
        parents=[output, where],
        help="validate settings, check the Mooncake client and master, say what would happen",
    )
    check.add_argument(
        "--kv-transfer-config",
        metavar="JSON|PATH",
        help="vLLM's --kv-transfer-config value, or a file holding it",
    )
    check.set_defaults(run=_doctor)

    pool_parser = commands.add_parser("pool", help="what the pool holds, and removing it")
    pool_commands = pool_parser.add_subparsers(dest="pool_command", required=True)
    pool_commands.add_parser(
        "status", parents=[output, where], help="master, segments, capacity and use"
    ).set_defaults(run=_pool_status)
    listing = pool_commands.add_parser(
        "ls", parents=[output, where, select], help="list keys (filtered)"
    )
    listing.add_argument("--group", type=int, help="a KV cache group id")
    listing.add_argument("-l", "--long", action="store_true", help="with sizes and owners")
    listing.set_defaults(run=_pool_ls)
    usage = pool_commands.add_parser(
        "du", parents=[output, where, select], help="objects and bytes per owner"
    )
    usage.add_argument("--group", type=int, help="a KV cache group id")
    usage.add_argument(
        "--by",
        choices=("model", "namespace", "group"),
        default="group",
        help="summing level (default: group)",
    )
    usage.set_defaults(run=_pool_du)
    evict = pool_commands.add_parser(
        "evict",
        parents=[output, where],
        help="remove one model's objects (forced: leases and readers do not stop it)",
    )
    evict.add_argument("--model", required=True, help="a model as vLLM was given it")
    evict.add_argument(
        "--namespace", help="only this namespace's single-group keys ('' for the default)"
    )
    evict.add_argument("--layout", help="only this layout's hybrid keys")
    evict.add_argument("--dry-run", action="store_true", help="say what would be removed")
    evict.add_argument("-v", "--verbose", action="store_true", help="print every key")
    evict.set_defaults(run=_pool_evict)

    keys_parser = commands.add_parser("keys", help="read object keys")
    keys_commands = keys_parser.add_subparsers(dest="keys_command", required=True)
    explaining = keys_commands.add_parser(
        "explain", parents=[output], help="print the fields of each key"
    )
    explaining.add_argument("keys", nargs="+", metavar="KEY")
    explaining.set_defaults(run=_keys_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; expected failures print one line and set the exit status."""
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except CliError as exc:
        print(f"hybridkv: error: {exc}", file=sys.stderr)
        return exc.status
    except (MasterUnreachableError, StoreError) as exc:
        print(f"hybridkv: error: {exc}", file=sys.stderr)
        return NOT_READY
