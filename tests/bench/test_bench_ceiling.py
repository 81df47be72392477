"""The ceiling's provider calls, against the sandbox over real HTTP: a transient failure is
made again at once, at most ``CALL_TRIES`` times, so one refused keep-alive connection does not
end a benchmark run (it once stopped the ceiling after 5,000 of 20,000 messages)."""

import asyncio

import pytest

from bench.ceiling import CALL_TRIES, _call
from email_platform.common.errors import TransientError
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.sandbox import SandboxProvider
from tests.support import sandbox_stats


def _email(to: str, key: str) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=0,
        event_id=key,
        idempotency_key=key,
        sender="Bench <no-reply@example.com>",
        to=to,
        subject="Hello",
        text="Hi",
        html=None,
        template="welcome",
        lane="bulk",
    )


@pytest.mark.parametrize("batch_max", [1, 10])
def test_a_call_that_fails_transiently_is_made_again_until_accepted(sandbox, batch_max):
    provider = SandboxProvider(
        sandbox.base_url, max_connections=2, timeout_s=5, batch_max=batch_max
    )
    try:
        if batch_max == 1:
            emails = [_email(f"jane+503x{CALL_TRIES - 1}@example.org", "k1")]
        else:
            emails = [_email("ann@example.org", "k1"), _email("bob+500x1@example.org", "k2")]
        results = _call(provider, emails)
    finally:
        provider.close()
    assert [type(r) for r in results] == [Accepted] * len(emails)
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == len(emails)
    # A batch is made again whole: the message accepted the first time goes again with its
    # key, and the sandbox answers it from what it stored (the real path retries only what
    # failed; the ceiling keeps it simple).
    assert stats["repeated_keys"] == (0 if batch_max == 1 else 1)


def test_the_loop_client_makes_a_batch_call_again_when_one_of_its_messages_failed(sandbox):
    from bench.ceiling import _call_async
    from email_platform.providers.async_http import new_event_loop

    provider = SandboxProvider(sandbox.base_url, max_connections=2, timeout_s=5, batch_max=10)
    emails = [_email("ann@example.org", "k1"), _email("bob+500x1@example.org", "k2")]
    loop = new_event_loop()
    try:
        results = loop.run_until_complete(_call_async(provider, emails))
    finally:
        provider.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    assert [type(r) for r in results] == [Accepted, Accepted]
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 2 and stats["requests"] == 2 and stats["repeated_keys"] == 1


def test_a_call_that_fails_every_try_raises_the_transient_error(sandbox):
    provider = SandboxProvider(sandbox.base_url, max_connections=1, timeout_s=5, batch_max=1)
    try:
        with pytest.raises(TransientError):
            _call(provider, [_email(f"jane+503x{CALL_TRIES}@example.org", "k1")])
    finally:
        provider.close()
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 0 and stats["requests"] == CALL_TRIES


def test_the_loop_client_sends_every_chunk_once_with_calls_in_flight_together(sandbox):
    """``--client loop``: chunks go out from tasks on one event loop through the adapter's
    async path, a transient failure made again, every message accepted once."""
    from bench.ceiling import _send_on_loop
    from email_platform.providers.async_http import new_event_loop

    provider = SandboxProvider(sandbox.base_url, max_connections=4, timeout_s=5, batch_max=1)
    assert provider.async_ready
    tos = [f"user{i}@example.org" for i in range(11)] + ["eve+503x1@example.org"]
    chunks = [[(_Event(f"e{i}"), _Route(), _email(to, f"k{i}"))] for i, to in enumerate(tos)]
    loop = new_event_loop()
    try:
        rows = loop.run_until_complete(_send_on_loop(provider, chunks, in_flight=4))
    finally:
        provider.close()
        loop.close()
    assert sorted(row["event_id"] for row in rows) == sorted(f"e{i}" for i in range(12))
    assert all(row["provider_message_id"] for row in rows)
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 12 and stats["repeated_keys"] == 0
    assert stats["requests"] == 13  # the 503 once, then accepted


class _Event:
    def __init__(self, event_id: str) -> None:
        self.event_id, self.lane = event_id, "bulk"


class _Route:
    name, template = "welcome", "welcome"
