"""A TCP relay that adds a fixed delay each way: added round-trip time without netem.

This machine's kernel has no `netem` queueing discipline (nor any other that delays), so
latency is added in user space instead. A segment holder advertises the relay's address as
its own (`--hostname`) while listening on every address of its host; the relay, on a host
of its own, listens on the holder's ports and forwards each connection to the holder,
holding every chunk `delay` seconds in each direction. Everything that reaches the holder's
memory (the handshake and the data transfers) then pays the added round trip.

Run: `python delay_relay.py LISTEN_ADDRESS TARGET_ADDRESS ONE_WAY_DELAY_S PORT...`; it
prints "relaying" once it listens.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

CHUNK = 1 << 20


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy `source` to `sink`, each chunk sent `delay_s` after it arrived (order kept)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        while True:
            data = await source.read(CHUNK)
            await queue.put((time.monotonic() + delay_s, data))
            if not data:
                return

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                sink.close()
                return
            sink.write(data)
            await sink.drain()

    await asyncio.gather(receive(), send(), return_exceptions=True)


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _relay(
    target: str,
    port: int,
    delay_s: float,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(target, port)
    except OSError:
        writer.close()
        return
    _no_delay(writer)
    _no_delay(upstream_writer)
    await asyncio.gather(
        _pump(reader, upstream_writer, delay_s),
        _pump(upstream_reader, writer, delay_s),
        return_exceptions=True,
    )


async def serve(listen: str, target: str, delay_s: float, ports: list[int]) -> None:
    for port in ports:
        await asyncio.start_server(
            lambda r, w, p=port: _relay(target, p, delay_s, r, w), listen, port
        )
    print("relaying", ports, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    listen_address, target_address, one_way_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    asyncio.run(serve(listen_address, target_address, one_way_s, [int(p) for p in sys.argv[4:]]))
