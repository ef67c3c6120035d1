"""A counting TCP relay for the Postgres wire protocol: what each driver really sends.

:class:`WireTap` listens on 127.0.0.1, relays every connection to the real
server and reads the client's side of the protocol (v3, unencrypted: connect
through it with SSL and GSS encryption disabled). While ``recording`` is on,
it notes one entry per round trip, that is per message after which the client
waits for the server's ReadyForQuery:

* a simple ``Query`` ('Q'): ``"<sql>"``;
* an extended-protocol batch ended by ``Sync`` ('S'): the text of the
  statement it executed (``Bind`` of a prepared statement, looked up by name
  in the ``Parse`` messages seen earlier on that connection), or
  ``"prepare: <sql>"`` for a batch that only parsed/described one.

It is a diagnostic for the benchmarks, never used while timing: it counts
round trips alike for every driver (psycopg's implicit ``BEGIN``, asyncpg's
explicit ``BEGIN`` and prepared statements, the pool's pre-ping) because it
sees the bytes, not the driver's API.

:func:`start_delay_relay` is the other relay here: a separate process that
holds every chunk of bytes for a fixed time in each direction, so that a
benchmark can see how the drivers behave when each round trip takes as long
as it does over a network (the server itself is on this machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102


def _cstring(body: bytes, start: int) -> tuple[str, int]:
    end = body.index(b"\x00", start)
    return body[start:end].decode("utf-8", "replace"), end + 1


class WireTap:
    """A relay on ``127.0.0.1:port`` to ``host:port`` of the server; see the module doc.

    Attributes:
        port: the relay's port (connect to it instead of the server's).
        trips: the round trips noted while ``recording`` was on.
        recording: switch; entries are noted only while it is True.
    """

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self.trips: list[str] = []
        self.recording = False
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.port: int = server.sockets[0].getsockname()[1]
        self._server = server
        ready.set()
        self._loop.run_forever()

    @contextmanager
    def record(self) -> Iterator[list[str]]:
        """Note the round trips of the block; yields the list they go into (cleared first)."""
        self.trips.clear()
        self.recording = True
        try:
            yield self.trips
        finally:
            self.recording = False

    def close(self) -> None:
        """Stop relaying: close the listener and every relayed connection, end the thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection(*self._target)

        async def server_to_client() -> None:
            try:
                while data := await s_reader.read(65536):
                    c_writer.write(data)
                    await c_writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                c_writer.close()

        back = asyncio.ensure_future(server_to_client())
        # Shutdown cancels this task: it then ends quietly (a cancelled
        # connection callback is otherwise logged by asyncio's streams).
        try:
            await self._client_to_server(c_reader, s_writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            s_writer.close()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({back}, timeout=5)

    async def _client_to_server(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # Untyped startup messages (SSL / GSS requests, then the startup packet).
        while True:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            rest = await reader.readexactly(length - 8)
            writer.write(head + rest)
            await writer.drain()
            if code == _CANCEL_REQUEST:
                return
            if code not in (_SSL_REQUEST, _GSSENC_REQUEST):
                break
        statements: dict[str, str] = {}
        parsed: str | None = None
        bound: str | None = None
        while True:
            head = await reader.readexactly(5)
            kind, length = head[:1], struct.unpack("!i", head[1:])[0]
            body = await reader.readexactly(length - 4)
            writer.write(head + body)
            if kind == b"Q":
                sql, _ = _cstring(body, 0)
                self._note(sql)
                await writer.drain()
            elif kind == b"P":
                name, at = _cstring(body, 0)
                sql, _ = _cstring(body, at)
                statements[name] = parsed = sql
            elif kind == b"B":
                _portal, at = _cstring(body, 0)
                name, _ = _cstring(body, at)
                bound = statements.get(name, f"<statement {name!r}>")
            elif kind == b"S":
                if bound is not None:
                    self._note(bound)
                elif parsed is not None:
                    self._note(f"prepare: {parsed}")
                else:
                    self._note("<sync>")
                parsed = bound = None
                await writer.drain()
            elif kind == b"X":
                await writer.drain()
                return

    def _note(self, entry: str) -> None:
        if self.recording:
            self.trips.append(" ".join(entry.split()))


# --------------------------------------------------------------------------
# A relay that adds latency (run in its own process)


async def _delayed_pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it arrived, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    sender = asyncio.ensure_future(send())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((loop.time() + delay, data))
    except ConnectionError:
        pass
    finally:
        queue.put_nowait((0.0, b""))
        await sender


async def _serve_delayed(host: str, port: int, delay: float) -> None:
    async def relay(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection(host, port)
        await asyncio.gather(
            _delayed_pump(c_reader, s_writer, delay), _delayed_pump(s_reader, c_writer, delay)
        )

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    # Runs until the parent closes our stdin (or dies).
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()


def start_delay_relay(host: str, port: int, rtt_ms: float) -> tuple[subprocess.Popen[str], int]:
    """Start a relay process adding ``rtt_ms / 2`` in each direction; returns it and its port.

    Close its stdin (``proc.stdin.close(); proc.wait()``) to stop it. The
    event loop's timers have a 1 ms granularity, so the added time per round
    trip is at least 2 ms above zero and rounds up: measure it.
    """
    proc = subprocess.Popen(
        [sys.executable, __file__, host, str(port), str(rtt_ms / 2000)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="relay to HOST:PORT, delaying every chunk")
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("delay_s", type=float, help="seconds added in each direction")
    ns = parser.parse_args()
    asyncio.run(_serve_delayed(ns.host, ns.port, ns.delay_s))
