"""What every `hybridkv` command shares: exit statuses, errors, where the pool is, output."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

import msgspec

from hybridkv.integration.cli import pool
from hybridkv.integration.cli.master_http import (
    MasterHttp,
    default_address,
)
from hybridkv.integration.config import MOONCAKE_CONFIG_ENV
from hybridkv.keys import KeyFormatError, model_name
from hybridkv.transport.config import MooncakeConfig

BAD_INPUT = 2
NOT_READY = 1


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
