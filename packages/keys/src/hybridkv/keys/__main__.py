"""``python -m hybridkv.keys explain KEY...``: what a key in a pool names.

Operators listing a Mooncake pool see opaque strings; this prints their fields, and for a
malformed key the field that is wrong (exit status 2, like any usage error).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from ._keys import HYBRID_TAG, BlockKey, HybridKey, KeyFormatError, parse_key

_RENDERING_ORDER = ("model", "layout", "pp_rank", "group", "block_size", "block_hash", "head")


def explain(key: BlockKey | HybridKey) -> str:
    """One ``field  value`` line per field, the format first, then as the key spells them."""
    values = msgspec.structs.asdict(key)
    fields = {
        "format": HYBRID_TAG if isinstance(key, HybridKey) else "single-group",
        **{name: values[name] for name in _RENDERING_ORDER if name in values},
    }
    width = max(len(name) for name in fields)
    return "\n".join(
        f"{name:<{width}}  {'-' if value is None else value}" for name, value in fields.items()
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.keys", description="Read hybridkv / Mooncake object keys."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    explain_command = commands.add_parser("explain", help="print the fields of each key")
    explain_command.add_argument("keys", nargs="+", metavar="KEY")
    args = parser.parse_args(argv)
    status = 0
    reports = []
    for text in args.keys:
        try:
            reports.append(explain(parse_key(text)))
        except KeyFormatError as exc:
            print(f"error: invalid key {text!r}: {exc}", file=sys.stderr)
            status = 2
    if reports:
        print("\n\n".join(reports))
    return status


if __name__ == "__main__":
    sys.exit(main())
