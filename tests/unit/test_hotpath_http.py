"""``HttpProvider`` lends each concurrent send a keep-alive client of its own.

The bound is still ``max_connections`` requests in flight; a send that waits longer than the
timeout for a free client fails transiently (as httpx's pool timeout did); the base URL's path
prefix is kept when the request path is joined to it; a closed provider sends nothing.
"""

import threading
import time

import httpx
import pytest

from email_platform.common.errors import TransientError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.sandbox import SandboxProvider


def _email(n: int) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=n,
        event_id=f"01JEVENT{n:018d}",
        idempotency_key=f"01JEVENT{n:018d}:welcome",
        sender="Example <no-reply@example.com>",
        to=f"u{n}@example.com",
        subject="Welcome",
        text="Hi",
        html=None,
        template="welcome",
        lane="transactional",
    )


def _accept(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"id": f"sbx_{request.headers['idempotency-key']}"})


def test_concurrent_sends_never_exceed_max_connections():
    in_flight, peak, lock = 0, 0, threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.02)
        with lock:
            in_flight -= 1
        return _accept(request)

    provider = SandboxProvider(
        "http://sandbox.test", max_connections=3, transport=httpx.MockTransport(handler)
    )
    results: list[str] = []

    def send_two(n: int) -> None:
        for k in (2 * n, 2 * n + 1):
            results.append(provider.send(_email(k)).provider_message_id)

    threads = [threading.Thread(target=send_two, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    provider.close()
    assert peak == 3
    assert sorted(results) == sorted(f"sbx_{_email(k).idempotency_key}" for k in range(24))


def test_waiting_longer_than_the_timeout_for_a_connection_is_transient():
    release = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        release.wait(5)
        return _accept(request)

    provider = SandboxProvider(
        "http://sandbox.test",
        max_connections=1,
        timeout_s=0.2,
        transport=httpx.MockTransport(handler),
    )
    holder = threading.Thread(target=provider.send, args=(_email(1),))
    holder.start()
    time.sleep(0.05)  # the only connection is now busy
    started = time.monotonic()
    with pytest.raises(TransientError):
        provider.send(_email(2))
    assert time.monotonic() - started < 2
    release.set()
    holder.join()
    # The connection came back: the next send goes through.
    assert provider.send(_email(3)).provider_message_id == f"sbx_{_email(3).idempotency_key}"
    provider.close()


@pytest.mark.parametrize("base_url", ["http://provider.test/api", "http://provider.test/api/"])
def test_request_path_is_joined_to_the_base_url_path(base_url: str):
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return _accept(request)

    provider = SandboxProvider(base_url, transport=httpx.MockTransport(handler))
    provider.send(_email(1))
    provider.send(_email(2))
    provider.close()
    assert seen == ["http://provider.test/api/v1/send"] * 2


def test_close_refuses_further_sends():
    gate = threading.Barrier(4)

    def handler(request: httpx.Request) -> httpx.Response:
        gate.wait(5)  # four sends in flight at once: four clients
        return _accept(request)

    provider = SandboxProvider(
        "http://sandbox.test", max_connections=4, transport=httpx.MockTransport(handler)
    )
    threads = [threading.Thread(target=provider.send, args=(_email(n),)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    provider.close()
    assert provider.client.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        provider.send(_email(5))
