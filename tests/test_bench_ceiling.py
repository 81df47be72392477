"""The ceiling's provider calls, against the sandbox over real HTTP: a transient failure is
made again at once, at most ``CALL_TRIES`` times, so one refused keep-alive connection does not
end a benchmark run (it once stopped the ceiling after 5,000 of 20,000 messages)."""

import pytest

from bench.ceiling import CALL_TRIES, _call
from email_platform.errors import TransientError
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


def test_a_call_that_fails_every_try_raises_the_transient_error(sandbox):
    provider = SandboxProvider(sandbox.base_url, max_connections=1, timeout_s=5, batch_max=1)
    try:
        with pytest.raises(TransientError):
            _call(provider, [_email(f"jane+503x{CALL_TRIES}@example.org", "k1")])
    finally:
        provider.close()
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 0 and stats["requests"] == CALL_TRIES
