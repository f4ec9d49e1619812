"""`hybridkv`: the operator's tool for a hybridkv deployment and its Mooncake pool.

Commands: `doctor` (are these settings and this host ready), `pool status|ls|du|evict`
(what the pool holds, whose it is, removing one model's objects), `keys explain` and
`router` (prefill/decode disaggregation in front of vLLM servers).
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
from typing import Any

import msgspec

from hybridkv.integration import router
from hybridkv.integration.cli import doctor, pool
from hybridkv.integration.cli.common import BAD_INPUT, NOT_READY, CliError, _emit
from hybridkv.integration.cli.master_http import MasterUnreachableError
from hybridkv.integration.cli.pool_commands import _pool_du, _pool_evict, _pool_ls, _pool_status
from hybridkv.integration.config import MOONCAKE_CONFIG_ENV
from hybridkv.keys import KeyFormatError, parse_key
from hybridkv.keys.__main__ import explain
from hybridkv.transport.errors import StoreError

__all__ = ["main"]


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

    routing = commands.add_parser(
        "router", help="an OpenAI-compatible front for prefill/decode disaggregation"
    )
    router.add_arguments(routing)
    routing.set_defaults(run=router.serve)
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
