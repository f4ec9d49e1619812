"""The segment holder's `/health` and `/metrics`, for probes and Prometheus.

`/health` answers 200 once the segment is mounted while the master accepts connections
(503 otherwise, saying which is missing); `/metrics` is Prometheus text: the bytes lent,
uptime, and both conditions as 0/1 gauges. Mooncake's client keeps saying it is healthy
with the master gone, so the master is checked by connecting to it.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.transport.master_address import parse_master_address


@dataclass
class HolderState:
    """What a holder reports: `mounted` is set once its segment is in the pool."""

    segment_bytes: int
    master_address: str
    mounted: bool = False
    started: float = field(default_factory=time.monotonic)

    def master_reachable(self) -> bool:
        return parse_master_address(self.master_address).reachable(timeout_s=0.5)

    def health(self) -> tuple[bool, str]:
        """(healthy, why): a probe's answer."""
        if not self.mounted:
            return False, "segment not mounted yet"
        if not self.master_reachable():
            return False, f"master {self.master_address} unreachable"
        return True, "ok"

    def metrics(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        gauges = (
            ("segment_bytes", "Bytes this holder lends to the pool", self.segment_bytes),
            ("uptime_seconds", "Seconds since the holder started", time.monotonic() - self.started),
            ("mounted", "1 once the segment is mounted", int(self.mounted)),
            (
                "master_reachable",
                "1 while the master accepts connections",
                int(self.master_reachable()),
            ),
        )
        lines = []
        for name, help_text, value in gauges:
            lines += [
                f"# HELP hybridkv_holder_{name} {help_text}",
                f"# TYPE hybridkv_holder_{name} gauge",
                f"hybridkv_holder_{name} {value}",
            ]
        return "\n".join(lines) + "\n"


def _handler(state: HolderState) -> type[http.server.BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[int, str, str]]] = {
        "/health": lambda: _health_reply(state),
        "/metrics": lambda: (200, "text/plain; version=0.0.4; charset=utf-8", state.metrics()),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path.split("?", 1)[0])
            status, content_type, body = route() if route else (404, "text/plain", "not found\n")
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds would flood the holder's log

    return Handler


def _health_reply(state: HolderState) -> tuple[int, str, str]:
    healthy, why = state.health()
    return (200 if healthy else 503), "text/plain", why + "\n"


class HolderHttp:
    """The HTTP server, answering from a thread of its own until `close()`."""

    def __init__(self, host: str, port: int, state: HolderState) -> None:
        self._server = http.server.ThreadingHTTPServer((host, port), _handler(state))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="holder-http", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
