"""The send loop of ``BatchSender`` without Dagster, on SQLite and PostgreSQL.

Send threads hand their outcomes to the run thread, which records them in groups. Whatever the
grouping, every outcome of a batch is recorded (accepted, transient, permanent), a retry sends
only what is still pending under the same idempotency key, and a configuration error stops the
sending at once, keeping what was already accepted and dead-lettering nothing.
"""

import dataclasses
import threading
from collections import Counter

from sqlalchemy import Engine, select

from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.db.schema import dead_letters, email_attempts
from email_platform.providers.base import Accepted, EmailProvider, OutgoingEmail
from email_platform.providers.sandbox import SandboxProvider
from email_platform.sending.batch import BatchSender
from tests.support import attempts_of, batch_sender, event, messages_of, sandbox_messages, signup


def _sender(engine: Engine, provider: EmailProvider, concurrency: int) -> BatchSender:
    lane = dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], concurrency=concurrency)
    return batch_sender(engine, provider, lane)


def test_every_outcome_of_a_concurrent_batch_is_recorded_once(engine, sandbox):
    plain = [signup(engine, f"p{i}") for i in range(40)]
    rejected = [signup(engine, f"r{i}", email=f"r{i}+reject@example.com") for i in range(5)]
    flaky = [signup(engine, f"f{i}", email=f"f{i}+503x1@example.com") for i in range(5)]
    ids = plain + rejected + flaky
    provider = SandboxProvider(sandbox.base_url, max_connections=8, timeout_s=5)
    try:
        sender = _sender(engine, provider, concurrency=8)
        first = sender.run(ids, run_id="run-1")
        assert (first.sent, first.dead, len(first.transient)) == (40, 5, 5)

        accepted = {m["idempotency_key"]: m for m in sandbox_messages(sandbox.base_url)}
        assert len(accepted) == 40
        for event_id in plain:
            (message,) = messages_of(engine, event_id)
            (attempt,) = attempts_of(engine, event_id)
            assert (message.status, message.attempts) == ("sent", 1)
            assert attempt.outcome == "accepted" and attempt.run_id == "run-1"
            assert message.provider_message_id == attempt.provider_message_id
            assert accepted[message.idempotency_key]["id"] == message.provider_message_id
            assert event(engine, event_id).status == "done"
        for event_id in rejected:
            (message,) = messages_of(engine, event_id)
            (attempt,) = attempts_of(engine, event_id)
            assert message.status == "dead" and attempt.outcome == "permanent"
            assert attempt.http_status == 422
            assert event(engine, event_id).status == "dead"
        for event_id in flaky:
            (message,) = messages_of(engine, event_id)
            (attempt,) = attempts_of(engine, event_id)
            assert (message.status, message.attempts) == ("pending", 1)
            assert attempt.outcome == "transient" and attempt.http_status == 503
            assert event(engine, event_id).status == "in_flight"

        # The retry of the same run sends only the five still pending, under their keys.
        retry = sender.run(ids, run_id="run-1")
        assert (retry.sent, retry.dead, retry.transient) == (5, 0, [])
    finally:
        provider.close()

    keys = Counter(m["idempotency_key"] for m in sandbox_messages(sandbox.base_url))
    assert len(keys) == 45 and set(keys.values()) == {1}
    for event_id in flaky:
        (message,) = messages_of(engine, event_id)
        assert (message.status, message.attempts) == ("sent", 2)
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["transient", "accepted"]
        assert message.idempotency_key in keys
        assert event(engine, event_id).status == "done"
    with engine.connect() as connection:
        letters = connection.execute(select(dead_letters)).all()
        attempts = connection.execute(select(email_attempts)).all()
    assert sorted(d.event_id for d in letters) == sorted(rejected)
    assert len(attempts) == 55  # one row per provider call, never two for one call


class _BrokenAfter:
    """A provider whose settings break after ``good`` accepted sends."""

    name = "sandbox"

    def __init__(self, good: int) -> None:
        self.good = good
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def send(self, email: OutgoingEmail) -> Accepted:
        with self._lock:
            self.calls.append(email.idempotency_key)
            if len(self.calls) > self.good:
                raise ConfigurationError("EMAIL_PLATFORM_SANDBOX_API_KEY is wrong")
            return Accepted(f"id-{len(self.calls)}", 200)

    def close(self) -> None:
        pass


def test_configuration_error_stops_sending_and_keeps_what_was_accepted(engine):
    ids = [signup(engine, f"u{i}") for i in range(6)]
    provider = _BrokenAfter(good=2)
    sender = _sender(engine, provider, concurrency=1)
    try:
        sender.run(ids, run_id="run-1")
        raise AssertionError("a configuration error must fail the attempt")
    except ConfigurationError:
        pass

    assert len(provider.calls) == 3  # no send after the one that failed
    statuses = [messages_of(engine, event_id)[0].status for event_id in ids]
    assert statuses == ["sent", "sent", "pending", "pending", "pending", "pending"]
    assert [len(attempts_of(engine, event_id)) for event_id in ids] == [1, 1, 0, 0, 0, 0]
    with engine.connect() as connection:
        assert connection.execute(select(dead_letters)).all() == []
