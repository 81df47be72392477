"""Keep-alive HTTP/1.1 connections on asyncio, for hundreds of provider requests in flight.

A run keeps as many requests in flight as its lane's ``concurrency``. With a provider that
answers in 100 ms, one message a call, that count sets the speed, and a thread per request
spends more CPU handing the GIL around than sending. httpx's ``AsyncClient`` is slower still
at high concurrency. So the HTTP adapters send through this small client instead: one event
loop, a pool of connections per origin, ``httptools`` (the C parser uvicorn uses, installed
with it) reading the answers.

It speaks only what the adapters need: one request at a time per connection, bodies with a
length (chunked and read-to-close answers are read too), TLS through the adapter's SSL context.
The request's bytes are those httpx sends on the blocking path (``HttpProvider._wire`` fills a
template httpx built once, or ``encode`` writes out an ``httpx.Request``), and the answer comes
back as an ``httpx.Response``, so the adapters read it as before. Failures are raised as
httpx's exceptions, which ``classify_exception`` and the failover's "definitely not accepted"
test already know.
"""

import asyncio
import select
import ssl
from collections.abc import Callable
from typing import cast

import httptools
import httpx

#: What the event loop buffers for writing before it tells the protocol to wait.
_WRITE_BUFFER_HIGH = 64 * 1024
#: An idle connection older than this is closed rather than reused: servers close theirs
#: after a few seconds (uvicorn 5 s, httpx's own expiry is 5 s), and a request written as the
#: server hangs up fails with no answer.
KEEPALIVE_EXPIRY_S = 4.0
#: A connection idle this long is checked for a hang-up its loop has not handled yet before it
#: is reused (one ``select`` call: too dear for every request, and a server hardly closes a
#: connection within a second of answering on it without saying so).
HANG_UP_CHECK_AFTER_S = 1.0


class _Connection(asyncio.Protocol):
    """One keep-alive connection: a request written, its answer parsed, then the next."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]] | None = None
        self.closed = False
        self.reusable = True
        #: Loop time when the connection went back to the pool.
        self.idle_since = 0.0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._started = False
        self._until_close = False

    # ---- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # an answer nobody asked for: the connection is out of step
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the provider asked to switch protocols"))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"unreadable answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        if self._started and self._until_close:
            self.on_message_complete()  # an answer without a length ends with its connection
        elif self._started:
            self._fail(httpx.RemoteProtocolError("the provider closed the connection mid-answer"))
        else:
            # What httpcore raises when the server hangs up before answering.
            self._fail(httpx.RemoteProtocolError("server disconnected without sending a response"))

    # ---- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._started = True
        self._headers = []
        self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        names = {name.lower() for name, _ in self._headers}
        self._until_close = b"content-length" not in names and b"transfer-encoding" not in names

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._started = False
        if not self.parser.should_keep_alive():
            self.reusable = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), self._headers, b"".join(self._body)))

    # ---- used by the pool ---------------------------------------------------------------

    def _fail(self, error: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def hung_up(self) -> bool:
        """Whether the idle socket has something to read: the server's EOF (or bytes nobody
        asked for) that the loop has not handled yet, e.g. after this process was starved of
        CPU. httpcore checks the same before it reuses a connection."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    async def exchange(
        self, payload: bytes, timeout_s: float
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        assert self.transport is not None
        waiter = asyncio.get_running_loop().create_future()
        self.waiter = waiter
        self.transport.write(payload)
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            self.close()  # its answer may still come: the connection cannot be reused
            raise httpx.ReadTimeout(f"no answer within {timeout_s:g}s") from None
        except BaseException:
            self.close()  # interrupted mid-exchange: the connection is out of step
            raise


class OriginPool:
    """Keep-alive connections to one origin (scheme, host, port), used from one event loop.

    At most ``max_connections`` requests are in flight at once; a request waits for a slot up
    to the timeout, then fails as httpx's ``PoolTimeout`` (transient), as the sync path does.
    The most recently used idle connection goes first: it is the likeliest to be alive.
    """

    def __init__(
        self,
        url: httpx.URL,
        *,
        max_connections: int,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.host = url.host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl_context = ssl_context if url.scheme == "https" else None
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max(1, max_connections))
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._closed = False

    async def send(self, payload: bytes) -> httpx.Response:
        """Send one request's bytes (``encode`` or ``HttpProvider``'s template) and read its
        answer."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no free connection to the provider") from None
        try:
            connection = self._idle_connection() or await self._connect()
            status, headers, body = await connection.exchange(payload, self.timeout_s)
            if connection.reusable and not connection.closed and not self._closed:
                connection.idle_since = self.loop.time()
                self._idle.append(connection)
            else:
                self._forget(connection)
        finally:
            self._slots.release()
        # Built from the raw bytes the way the sync client builds it: ``Content-Encoding`` is
        # decoded, and the adapter's ``accepted`` / ``classify`` read it as they always did.
        return httpx.Response(status, headers=headers, content=body)

    def _idle_connection(self) -> _Connection | None:
        now = self.loop.time()
        while self._idle:
            connection = self._idle.pop()
            idle_s = now - connection.idle_since
            if connection.closed or idle_s > KEEPALIVE_EXPIRY_S:
                self._forget(connection)
                continue
            if idle_s < HANG_UP_CHECK_AFTER_S or not connection.hung_up():
                return connection
            self._forget(connection)
        return None

    async def _connect(self) -> _Connection:
        if self._closed:
            raise RuntimeError("the provider's connections are closed")
        try:
            async with asyncio.timeout(self.timeout_s):
                _, connection = await self.loop.create_connection(
                    _Connection,
                    self.host,
                    self.port,
                    ssl=self.ssl_context,
                    server_hostname=self.host if self.ssl_context else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection within {self.timeout_s:g}s") from None
        except OSError as exc:
            # ``ConnectError`` with the OS error as its cause: a definite refusal to the failover.
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        assert connection.transport is not None
        connection.transport.set_write_buffer_limits(high=_WRITE_BUFFER_HIGH)
        self._all.add(connection)
        return connection

    def _forget(self, connection: _Connection) -> None:
        connection.close()
        self._all.discard(connection)

    def close(self) -> None:
        """Close every connection (from the pool's event loop)."""
        self._closed = True
        self._idle = []
        for connection in list(self._all):
            connection.close()
        self._all.clear()

    def close_threadsafe(self) -> None:
        """``close`` from any thread: on the pool's loop if it still runs, else here."""
        if self.loop.is_closed():
            self._closed = True
            return
        try:
            self.loop.call_soon_threadsafe(self.close)
        except RuntimeError:  # the loop closed meanwhile; its transports went with it
            self._closed = True


def encode(request: httpx.Request) -> bytes:
    """The request as HTTP/1.1 bytes: its method, target, headers (Host included) and body."""
    head = [request.method.encode(), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        head += [name, b": ", checked(value), b"\r\n"]
    head.append(b"\r\n")
    return b"".join(head) + request.content


def checked(value: bytes) -> bytes:
    """``value`` if it can be a header value; what h11 raises on the blocking path if not (a
    line break would start a header of its own)."""
    if b"\r" in value or b"\n" in value or b"\0" in value:
        raise httpx.LocalProtocolError("Illegal header value")
    return value


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (with uvicorn's standard extras), else asyncio's."""
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # e.g. Windows: asyncio's own loop works, a little slower
        pass
    return factory()


__all__ = ["OriginPool", "checked", "encode", "new_event_loop"]
