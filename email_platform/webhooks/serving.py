"""Serving the receiver to the internet: bounded headers, bounded read time.

Anyone can connect to a webhook URL, so a request is bounded before it reaches the app:

* at most ``MAX_HEADER_BYTES`` of headers and at most ``MAX_HEADERS`` headers (431, whether the
  block arrives whole or in pieces);
* a client must finish its request line and headers within ``HEADER_TIMEOUT_S`` of connecting
  (or of its previous response), and may pause at most ``BODY_TIMEOUT_S`` between body chunks
  (408): a client that sends half a request and stops is disconnected, not waited for.

``uvicorn_options()`` gives ``uvicorn.Config`` these settings; ``RequestLimits`` is the ASGI
middleware ``create_receiver_app`` wraps its app in, so the header count and read time hold
under any ASGI server.
"""

import asyncio
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 100
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0


class _RememberingConnection(h11.Connection):
    """An h11 connection that keeps the protocol error it raised, for its status hint."""

    refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.refused = error
            raise


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for a request's line and headers.

    uvicorn times out idle keep-alive connections, not a request that stops half way through
    its headers (slowloris); this closes such a connection after ``HEADER_TIMEOUT_S``. It also
    answers a refused request with h11's status hint (431 for a header block over the receive
    buffer) where uvicorn answers every refusal with a 400.
    """

    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _RememberingConnection(
            h11.SERVER, self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES
        )

    def send_400_response(self, msg: str) -> None:
        refused = getattr(self.conn, "refused", None)
        status = getattr(refused, "error_status_hint", 400)
        if status == 400:
            super().send_400_response(msg)
            return
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        response = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
        for event in (response, h11.Data(data=msg.encode("ascii")), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # waiting for (the rest of) a request's headers
        else:
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is None:
            self._header_deadline = self.loop.call_later(
                self.header_timeout_s, self._headers_too_slow
            )

    def _disarm_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class RequestLimits:
    """ASGI middleware: too many or too large headers get a 431, a stalled body a 408."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_headers: int = MAX_HEADERS,
        max_header_bytes: int = MAX_HEADER_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        if len(headers) > self.max_headers:
            await _answer(send, 431, b'{"error": "too many headers"}')
            return
        # h11 bounds only a header block that arrives in pieces; one that arrives whole is
        # counted here, with the same answer.
        if sum(len(name) + len(value) for name, value in headers) > self.max_header_bytes:
            await _answer(send, 431, b'{"error": "headers too large"}')
            return
        started = False
        stalled = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def bounded_receive() -> Message:
            # A stalled body reads as the client gone: the app stops waiting for it.
            nonlocal stalled
            try:
                return await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                stalled = True
                return {"type": "http.disconnect"}

        await self.app(scope, bounded_receive, tracking_send)
        if stalled and not started:
            await _answer(send, 408, b'{"error": "request body too slow"}')


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def uvicorn_options() -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that bound what one client can make it hold."""
    return {
        "http": BoundedH11Protocol,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "timeout_keep_alive": 5,
    }
