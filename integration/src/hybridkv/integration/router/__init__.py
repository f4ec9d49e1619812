"""`hybridkv router`: an OpenAI-compatible front for prefill/decode disaggregation.

Each `/v1/completions` and `/v1/chat/completions` request goes to a prefill server (a
vLLM instance with `kv_role: kv_producer`) with `max_tokens=1`, then, as sent, to a
decode server (`kv_role: kv_consumer`, `consumer_is_to_load: true`) that loads the
prompt's KV from the pool; its reply, streamed or not, goes back unchanged. Several
servers of each kind are taken in turn. The HTTP stack (FastAPI, uvicorn, httpx) is
vLLM's own; it is imported only when the router runs, so the `hybridkv` command keeps
working on hosts without it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

__all__ = ["add_arguments", "main", "serve"]


def _server_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"not a server URL (http://HOST:PORT): {text!r}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(
            f"a server URL is its base, without a path (http://HOST:PORT): {text!r}"
        )
    return text.rstrip("/")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port (0 to 65535): {text!r}")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        type=_server_url,
        metavar="URL",
        help="prefill servers' base URLs (kv_producer), taken in turn",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        required=True,
        type=_server_url,
        metavar="URL",
        help="decode servers' base URLs (kv_consumer), taken in turn",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=_port, default=8000, help="port to listen on")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level",
    )


def serve(args: argparse.Namespace) -> int:
    """Run the router until interrupted."""
    try:
        import uvicorn

        from hybridkv.integration.router.app import build_app
    except ImportError as exc:
        print(
            f"hybridkv router: error: {exc}; install FastAPI, uvicorn and httpx "
            "(they come with vLLM, or: pip install 'hybridkv-integration[router]')",
            file=sys.stderr,
        )
        return 1
    app = build_app(args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hybridkv router", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(parser)
    return serve(parser.parse_args(argv))
