"""What one client can make the webhook receiver hold is bounded, on a real uvicorn server.

A slow client that sends half its headers and stops is disconnected; one that stops sending
its body gets a 408; too many headers or too large a header block get a 431; and none of
them stops a good webhook, sent meanwhile, from being stored. The receiver runs as
``webhooks serve`` runs it (``serving.uvicorn_options``), with the deadlines shortened.
"""

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import Engine, func, select

from email_platform.db.schema import webhook_inbox
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.webhooks.receiver import create_receiver_app
from email_platform.webhooks.serving import MAX_HEADERS, BoundedH11Protocol, RequestLimits
from email_platform.webhooks.standard import sign

SECRET = "whsec_" + "c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seQ=="  # base64("secret-key-for-tests-only")
SETTINGS = {"sandbox_webhook_secret": SECRET}


class _QuickHeaders(BoundedH11Protocol):
    header_timeout_s = 0.5


@pytest.fixture
def receiver(engine: Engine) -> Iterator[str]:
    app = create_receiver_app(engine, settings=SETTINGS)
    bounded = RequestLimits(app.app, body_timeout_s=0.5)
    server = BackgroundServer(bounded, http=_QuickHeaders, h11_max_incomplete_event_size=16 * 1024)
    yield server.start()
    server.stop()


def _stored(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(webhook_inbox)).scalar_one()


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _good(url: str, n: int) -> httpx.Response:
    event = {
        "id": f"evt_{n}",
        "type": "email.delivered",
        "created_at": "2026-11-29T14:22:18Z",
        "data": {"message_id": f"sbx_{n}", "to": "jane@example.com", "metadata": {}},
    }
    body = json.dumps(event).encode()
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "webhook-id": f"msg_{n}",
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(SECRET, f"msg_{n}", timestamp, body),
    }
    return httpx.post(f"{url}/webhooks/sandbox", content=body, headers=headers)


def test_half_sent_headers_are_cut_off_and_good_webhooks_still_land(receiver, engine):
    slow = _raw(receiver)
    slow.sendall(b"POST /webhooks/sandbox HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert _good(receiver, 1).status_code == 200  # served meanwhile
    started = time.monotonic()
    slow.settimeout(5)
    assert slow.recv(1024) == b""  # the server closed the connection
    assert time.monotonic() - started < 3
    slow.close()
    assert _stored(engine) == 1


def test_a_body_that_stops_arriving_gets_a_408(receiver, engine):
    slow = _raw(receiver)
    slow.sendall(
        b'POST /webhooks/sandbox HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"type"'
    )
    slow.settimeout(5)
    answer = slow.recv(4096)
    slow.close()
    assert answer.startswith(b"HTTP/1.1 408")
    assert _stored(engine) == 0


def test_too_many_headers_get_a_431(receiver, engine):
    headers = {f"x-h{i}": "v" for i in range(MAX_HEADERS + 1)}
    answer = httpx.post(f"{receiver}/webhooks/sandbox", content=b"{}", headers=headers)
    assert answer.status_code == 431
    assert _stored(engine) == 0


def test_an_oversized_header_arriving_in_pieces_gets_a_431(receiver, engine):
    slow = _raw(receiver)
    slow.sendall(b"POST /webhooks/sandbox HTTP/1.1\r\nHost: x\r\nX-Big: ")
    answer = b""
    try:
        for _ in range(64):
            slow.sendall(b"v" * 1024)
        slow.settimeout(5)
        answer = slow.recv(4096)
    except (ConnectionResetError, BrokenPipeError):
        # The server answered and closed while this client was still sending: refused too.
        answer = b"HTTP/1.1 431 (connection closed mid-send)"
    finally:
        slow.close()
    assert answer.startswith(b"HTTP/1.1 431")
    assert _stored(engine) == 0


def test_an_oversized_header_block_gets_a_431(receiver, engine):
    answer = httpx.post(
        f"{receiver}/webhooks/sandbox", content=b"{}", headers={"x-big": "v" * (64 * 1024)}
    )
    assert answer.status_code == 431
    assert _stored(engine) == 0
    assert _good(receiver, 2).status_code == 200
    assert _stored(engine) == 1
