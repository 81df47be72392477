"""A key that is not ASCII still travels as an ``Idempotency-Key`` header (Resend, the sandbox):
UTF-8 percent-encoded, the same on every attempt, so it is sent and deduplicated instead of
dead-lettered as ``unexpected`` (httpx refuses a non-ASCII header value with
``UnicodeEncodeError``, which is what happened before).
"""

import json

import httpx
import pytest

from email_platform.providers.base import OutgoingEmail, idempotency_header
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.sandbox.server import SandboxServer
from tests.support import sandbox_stats

KEYS = ["bestellung-größe-42", "注文-42", "Ärger:ä b"]


def outgoing(key: str, n: int = 1) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=n,
        event_id=f"01JKEY{n:020d}",
        idempotency_key=key,
        sender="Example <no-reply@example.com>",
        to=f"u{n}@example.com",
        subject="Welcome",
        text="Hi",
        html=None,
        template="welcome",
        lane="bulk",
    )


@pytest.mark.parametrize("key", ["01JDQ5Z3K8M9N0P1Q2R3S4T5V6:welcome", "a b%20c", "k" * 256])
def test_an_ascii_key_is_sent_as_it_is(key):
    assert idempotency_header(key) == key


def test_a_non_ascii_key_is_percent_encoded_the_same_way_every_time_and_stays_distinct():
    encoded = [idempotency_header(key) for key in KEYS]
    assert encoded == [idempotency_header(key) for key in KEYS]
    assert all(value.isascii() and value.isprintable() for value in encoded)
    assert len(set(encoded)) == len(KEYS)
    assert encoded[0] == "bestellung-gr%C3%B6%C3%9Fe-42"


@pytest.mark.parametrize("key", KEYS)
def test_resend_sends_a_non_ascii_key_encoded_and_its_tag_sanitized(key):
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"id": "re-1"})

    resend = ResendProvider(api_key="re_test", transport=httpx.MockTransport(answer))
    assert resend.send(outgoing(key)).provider_message_id == "re-1"
    resend.close()
    (request,) = seen
    assert request.headers["Idempotency-Key"] == idempotency_header(key)
    tags = {tag["name"]: tag["value"] for tag in json.loads(request.content)["tags"]}
    assert tags["idempotency_key"].isascii()


def test_the_sandbox_sends_a_non_ascii_key_once_whether_alone_or_in_a_batch():
    with SandboxServer() as url:
        provider = SandboxProvider(url, batch_max=10)
        try:
            first = provider.send(outgoing(KEYS[1]))
            again = provider.send(outgoing(KEYS[1]))  # a retry after a lost answer
            (batched,) = provider.send_many([outgoing(KEYS[1])])  # the retry as a batch call
        finally:
            provider.close()
        stats = sandbox_stats(url)
    assert first.provider_message_id == again.provider_message_id
    assert getattr(batched, "provider_message_id", None) == first.provider_message_id
    assert stats["accepted"] == 1 and stats["repeated_keys"] == 2
