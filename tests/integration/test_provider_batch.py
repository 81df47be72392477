"""Batch calls to the provider: many messages in one HTTP request, each under its own key.

The sandbox adapter sends up to ``batch_max`` messages a call to ``POST /v1/send/batch``. Each
message keeps its own outcome (accepted, transient with Retry-After, permanent), a failure of
the whole call is every message's transient failure, and because the provider honours every
message's idempotency key, retrying a call whose answer was lost sends nothing twice. The send
path and the lane worker are run against the real sandbox over HTTP, on SQLite and PostgreSQL.
"""

import dataclasses
import threading

import httpx
import pytest
from sqlalchemy import Engine

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, ProviderRejectedError, TransientError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane, LaneConfig
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.sandbox import SandboxProvider
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sending.worker import LaneWorker
from tests.support import (
    attempts_of,
    batch_sender,
    dead_letters_of,
    event,
    messages_of,
    sandbox_messages,
    sandbox_stats,
    signup,
)


def _email(n: int, to: str | None = None) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=n,
        event_id=f"01JBATCH{n:018d}",
        idempotency_key=f"01JBATCH{n:018d}:welcome",
        sender="Example <no-reply@example.com>",
        to=to or f"u{n}@example.com",
        subject="Welcome",
        text="Hi",
        html=None,
        template="welcome",
        lane="bulk",
    )


# ---- the adapter --------------------------------------------------------------------------------


def test_send_many_maps_each_message_to_its_own_outcome(sandbox):
    provider = SandboxProvider(sandbox.base_url, batch_max=10)
    emails = [
        _email(1),
        _email(2, "slow+429x1@example.com"),
        _email(3, "down+500x1@example.com"),
        _email(4, "nope+reject@example.com"),
    ]
    first = provider.send_many(emails)
    assert isinstance(first[0], Accepted) and first[0].status_code == 200
    assert isinstance(first[1], TransientError) and first[1].status_code == 429
    assert first[1].retry_after_s == pytest.approx(0.2)  # the fixture's Retry-After
    assert isinstance(first[2], TransientError) and first[2].status_code == 500
    assert isinstance(first[3], ProviderRejectedError) and first[3].code == "invalid_recipient"
    second = provider.send_many(emails)
    assert [type(r) for r in second] == [Accepted, Accepted, Accepted, ProviderRejectedError]
    # The first message's second attempt got its first answer back: one acceptance per key.
    assert second[0] == first[0]
    accepted = sandbox_messages(sandbox.base_url)
    assert sorted(m["idempotency_key"] for m in accepted) == sorted(
        e.idempotency_key for e in emails[:3]
    )
    assert sandbox_stats(sandbox.base_url)["batch_requests"] == 2
    provider.close()


def test_a_lost_answer_fails_every_message_transiently_and_the_retry_doubles_nothing():
    with SandboxServer(SandboxConfig(timeout_delay_s=1.0)) as url:
        provider = SandboxProvider(url, batch_max=10, timeout_s=0.3)
        emails = [_email(1), _email(2, "b+accepttimeoutx1@example.com"), _email(3)]
        lost = provider.send_many(emails)
        assert all(isinstance(r, TransientError) for r in lost)
        retried = provider.send_many(emails)
        assert all(isinstance(r, Accepted) for r in retried)
        stats = sandbox_stats(url)
        # All three were accepted by the lost call; the retry replayed their answers.
        assert stats["accepted"] == 3 and stats["repeated_keys"] == 3
        provider.close()


def test_a_failed_or_unreadable_batch_answer_is_every_message_transient_failure():
    answers = iter(
        [
            httpx.Response(503, json={"error": {"code": "server_error", "message": "down"}}),
            httpx.Response(429, headers={"Retry-After": "7"}, json={"error": {}}),
            httpx.Response(200, content=b"<html>"),
            httpx.Response(200, json={"results": [{"status": 200, "id": "only-one"}]}),
            httpx.Response(401, json={"error": {"code": "unauthorized", "message": "bad"}}),
        ]
    )
    provider = SandboxProvider(
        "http://provider.test",
        batch_max=5,
        transport=httpx.MockTransport(lambda request: next(answers)),
    )
    emails = [_email(1), _email(2)]
    down = provider.send_many(emails)
    assert [(type(r), r.status_code) for r in down] == [(TransientError, 503)] * 2
    limited = provider.send_many(emails)
    assert [r.retry_after_s for r in limited] == [7.0, 7.0]
    for _ in range(2):  # not JSON; one result for two messages
        unreadable = provider.send_many(emails)
        assert [r.code for r in unreadable] == ["unreadable_response"] * 2
    refused = provider.send_many(emails)
    assert all(isinstance(r, ProviderRejectedError) and r.status_code == 401 for r in refused)


def test_batch_size_is_checked():
    with pytest.raises(ConfigurationError, match="1 to 500"):
        SandboxProvider("http://provider.test", batch_max=0)
    with pytest.raises(ConfigurationError, match="1 to 500"):
        SandboxProvider("http://provider.test", batch_max=501)
    settings = ProviderSettings.from_env({"EMAIL_PLATFORM_SANDBOX_BATCH_MAX": "lots"})
    with pytest.raises(ConfigurationError, match="whole number"):
        SandboxProvider.from_settings(settings, max_connections=1)
    settings = ProviderSettings.from_env({"EMAIL_PLATFORM_SANDBOX_BATCH_MAX": "1"})
    assert SandboxProvider.from_settings(settings, max_connections=1).batch_max == 1
    provider = SandboxProvider("http://provider.test", batch_max=2)
    with pytest.raises(ValueError, match="takes 2"):
        provider.send_many([_email(1), _email(2), _email(3)])


# ---- the send path and the lane worker ----------------------------------------------------------


def _lane(**changes) -> LaneConfig:  # type: ignore[no-untyped-def]
    base = dict(
        batch_size=50,
        concurrency=2,
        worker_poll_s=0.02,
        worker_idle_s=0.5,
        worker_lifetime_s=60,
        retry_delay_s=0.05,
        max_retry_delay_s=1.0,
        max_retries=3,
    )
    return dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], **{**base, **changes})


def test_a_batch_goes_out_in_calls_of_batch_max_each_message_recorded_once(engine, sandbox):
    ids = [signup(engine, f"u{i}") for i in range(45)]
    provider = SandboxProvider(sandbox.base_url, batch_max=10, max_connections=2)
    outcome = batch_sender(engine, provider, _lane()).run(ids, run_id="run-1")
    assert outcome.sent == 45
    stats = sandbox_stats(sandbox.base_url)
    # 45 messages, at most 10 a call: five calls, each message offered once.
    assert (stats["batch_requests"], stats["send_attempts"], stats["accepted"]) == (5, 45, 45)
    by_key = {m["idempotency_key"]: m for m in sandbox_messages(sandbox.base_url)}
    for event_id in ids:
        (message,) = messages_of(engine, event_id)
        (attempt,) = attempts_of(engine, event_id)
        assert message.status == "sent" and event(engine, event_id).status == "done"
        assert attempt.provider_message_id == by_key[message.idempotency_key]["id"]
        assert by_key[message.idempotency_key]["metadata"]["event_id"] == event_id
    provider.close()


def test_a_batch_fills_its_calls_before_it_spreads_them(engine, sandbox):
    ids = [signup(engine, f"u{i}") for i in range(25)]
    provider = SandboxProvider(sandbox.base_url, batch_max=10, max_connections=8)
    outcome = batch_sender(engine, provider, _lane(concurrency=8)).run(ids, run_id="run-1")
    assert outcome.sent == 25
    # Calls of 10, 10 and 5, not eight calls of three or four: every call costs a request
    # against the provider's limit, and a fuller call takes about as long.
    stats = sandbox_stats(sandbox.base_url)
    assert (stats["batch_requests"], stats["send_attempts"]) == (3, 25)


def test_a_batch_more_than_one_call_carries_fills_its_calls_even_with_calls_to_spare(
    engine, sandbox
):
    """25 messages could each have one of 30 calls in flight, but one call cannot carry them
    all: three calls, not 25 (a bulk lane's first claim of 256 went out as 256 calls)."""
    ids = [signup(engine, f"u{i}") for i in range(25)]
    provider = SandboxProvider(sandbox.base_url, batch_max=10, max_connections=30)
    outcome = batch_sender(engine, provider, _lane(concurrency=30)).run(ids, run_id="run-1")
    assert outcome.sent == 25
    stats = sandbox_stats(sandbox.base_url)
    assert (stats["batch_requests"], stats["send_attempts"]) == (3, 25)


def test_a_batch_one_call_could_carry_gets_a_call_per_message_when_calls_allow(engine, sandbox):
    """Five messages, eight calls in flight: each its own call, all in one round trip."""
    ids = [signup(engine, f"u{i}") for i in range(5)]
    provider = SandboxProvider(sandbox.base_url, batch_max=10, max_connections=8)
    outcome = batch_sender(engine, provider, _lane(concurrency=8)).run(ids, run_id="run-1")
    assert outcome.sent == 5
    stats = sandbox_stats(sandbox.base_url)
    assert (stats["batch_requests"], stats["send_attempts"]) == (0, 5)


def _worker(engine: Engine, provider, lane: LaneConfig, run_id: str) -> LaneWorker:  # type: ignore[no-untyped-def]
    return LaneWorker(
        sender=batch_sender(engine, provider, lane), engine=engine, lane=lane, run_id=run_id
    )


def test_a_worker_retries_only_the_messages_of_a_batch_that_failed(engine, sandbox):
    plain = [signup(engine, f"u{i}") for i in range(6)]
    limited = signup(engine, "r1", email="r1+429x1@example.com")
    flaky = signup(engine, "f1", email="f1+503x2@example.com")
    rejected = signup(engine, "x1", email="x1+reject@example.com")
    provider = SandboxProvider(sandbox.base_url, batch_max=20, max_connections=2)
    result = _worker(engine, provider, _lane(), "worker-1").run()
    assert result.totals["sent"] == 8 and result.totals["dead_lettered"] == 1
    for event_id in plain:
        assert len(attempts_of(engine, event_id)) == 1
    assert [a.outcome for a in attempts_of(engine, limited)] == ["transient", "accepted"]
    assert [a.outcome for a in attempts_of(engine, flaky)] == [
        "transient",
        "transient",
        "accepted",
    ]
    (letter,) = dead_letters_of(engine, rejected)
    assert letter.error_code == "invalid_recipient"
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 8 and stats["repeated_keys"] == 0
    provider.close()


def test_a_batch_whose_answer_is_lost_is_retried_and_every_message_sent_once(engine):
    with SandboxServer(SandboxConfig(timeout_delay_s=1.5)) as url:
        ids = [signup(engine, f"u{i}") for i in range(9)]
        ids.append(signup(engine, "slow", email="slow+accepttimeoutx1@example.com"))
        provider = SandboxProvider(url, batch_max=10, max_connections=1, timeout_s=0.5)
        result = _worker(engine, provider, _lane(concurrency=1), "worker-1").run()
        assert result.totals["sent"] == 10 and result.totals.get("dead_lettered", 0) == 0
        stats = sandbox_stats(url)
        # The lost call had accepted all ten; the retry under the same keys got their answers.
        assert stats["accepted"] == 10 and stats["repeated_keys"] == 10
        by_key = {m["idempotency_key"]: m["id"] for m in sandbox_messages(url)}
        for event_id in ids:
            (message,) = messages_of(engine, event_id)
            outcomes = [a.outcome for a in attempts_of(engine, event_id)]
            assert outcomes == ["transient", "accepted"]
            assert message.provider_message_id == by_key[message.idempotency_key]
        provider.close()


class _CancelDuringCall(SandboxProvider):
    """The run is asked to stop while its first batch call is in flight."""

    def __init__(self, base_url: str, cancel: threading.Event) -> None:
        super().__init__(base_url, batch_max=10, max_connections=1, timeout_s=5)
        self.cancel = cancel

    def send_many(self, emails):  # type: ignore[no-untyped-def]
        self.cancel.set()  # what SIGINT/SIGTERM does inside the worker op
        return super().send_many(emails)


def test_a_worker_stopped_mid_call_records_that_call_and_gives_back_the_rest(engine, sandbox):
    ids = [signup(engine, f"u{i}") for i in range(40)]
    lane = _lane(concurrency=1)
    placeholder = SandboxProvider(sandbox.base_url)
    first = _worker(engine, placeholder, lane, "worker-1")
    first.sender.provider = _CancelDuringCall(sandbox.base_url, first.sender.cancel)
    placeholder.close()
    result = first.run()
    assert result.reason == "canceled"
    accepted = {m["idempotency_key"] for m in sandbox_messages(sandbox.base_url)}
    assert len(accepted) == 10  # the one call in flight; no other started
    # Claims start at a round of calls (one call of 10) and double: the batch in flight and
    # the 20 prepared behind it were held; the other ten were never claimed.
    held = [i for i in ids if messages_of(engine, i)]
    assert len(held) == 10 + 20
    for event_id in held:
        (message,) = messages_of(engine, event_id)
        assert (message.status == "sent") == (message.idempotency_key in accepted)
    assert result.released == 20
    provider = SandboxProvider(sandbox.base_url, batch_max=10)
    _worker(engine, provider, _lane(), "worker-2").run()
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 40 and stats["repeated_keys"] == 0
    assert all(event(engine, i).status == "done" for i in ids)
    provider.close()
