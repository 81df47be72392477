"""``cancel()`` and ``email-platform cancel`` through the real send path, on SQLite and
PostgreSQL: a pending event is cancelled and never sent, an accepted one is reported sent
(never "cancelled"), one a run holds is reported in flight and not touched, and a cancel racing
a lane worker never leaves an event both cancelled and sent (docs/cancel.md, invariant 2)."""

import dataclasses
import json
import threading
import uuid
from datetime import timedelta

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, update

from email_platform import CancelStatus, cancel, publish
from email_platform.cli.app import main
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane, LaneConfig
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_outbox
from email_platform.providers.sandbox import SandboxProvider
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sending.worker import LaneWorker
from email_platform.store import outbox
from tests.hostile_support import hostile_settings, hostile_text
from tests.support import batch_sender, event, messages_of, run_send, sandbox_messages, signup


def _later(engine: Engine, user_id: str, **kwargs) -> str:  # type: ignore[no-untyped-def]
    """A receipt-like event due in a day: pending until then."""
    return signup(engine, user_id, send_after=utcnow() + timedelta(days=1), **kwargs)


def _cancel(engine: Engine, **kwargs):  # type: ignore[no-untyped-def]
    with engine.begin() as connection:
        return cancel(connection, **kwargs)


def test_a_pending_event_cancelled_is_never_sent(engine, database_url, sandbox):
    cancelled = _later(engine, "u1")
    kept = signup(engine, "u2")
    result = _cancel(engine, event_id=cancelled)
    assert result.status is CancelStatus.CANCELLED and result.cancelled
    assert result.event_id == cancelled and result.event_status == "cancelled"
    assert result.sent_messages == ()
    # Even when a run is asked to send it (its send_after long passed, say): the claim skips it.
    with engine.begin() as connection:
        connection.execute(
            update(email_outbox)
            .where(email_outbox.c.event_id == cancelled)
            .values(available_at=utcnow() - timedelta(days=1))
        )
    assert run_send(database_url, sandbox.base_url, "transactional", [cancelled, kept]).success
    assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [kept]
    row = event(engine, cancelled)
    assert (row.status, row.resolution) == ("cancelled", "cancelled")
    assert messages_of(engine, cancelled) == []
    # Asked again: finished, nothing cancelled twice.
    again = _cancel(engine, event_id=cancelled)
    assert again.status is CancelStatus.ALREADY_FINISHED and not again.cancelled


def test_cancel_is_in_the_callers_transaction_and_takes_the_idempotency_key(engine):
    event_id = _later(engine, "u1", idempotency_key="order-7-receipt")
    with engine.connect() as connection, connection.begin() as transaction:
        result = cancel(connection, idempotency_key="order-7-receipt")
        assert result.status is CancelStatus.CANCELLED and result.event_id == event_id
        transaction.rollback()  # the refund failed: nothing was cancelled either
    assert event(engine, event_id).status == "pending"
    # The refund and the cancel commit together.
    with engine.begin() as connection:
        publish(
            connection,
            event_type="user.signed_up",
            aggregate_id="u9",
            payload={"user_id": "u9", "email": "u9@example.com", "first_name": "Al"},
            idempotency_key="order-7-receipt",
        )  # the same key names the same event: nothing new to send
        assert cancel(connection, idempotency_key="order-7-receipt").cancelled
    assert event(engine, event_id).status == "cancelled"


def test_unknown_ids_and_keys_are_reported_as_such(engine):
    assert _cancel(engine, event_id="01JUNKNOWN0000000000000000").status is CancelStatus.UNKNOWN
    unknown = _cancel(engine, idempotency_key="no-such-key")
    assert unknown.status is CancelStatus.UNKNOWN and unknown.event_id is None


def test_exactly_one_of_event_id_and_idempotency_key(engine):
    with engine.begin() as connection:
        with pytest.raises(TypeError, match="exactly one"):
            cancel(connection)
        with pytest.raises(TypeError, match="exactly one"):
            cancel(connection, event_id="a", idempotency_key="b")
        with pytest.raises(TypeError, match="expected a str"):
            cancel(connection, event_id=7)  # type: ignore[arg-type]


def test_an_accepted_message_is_reported_sent_never_cancelled(engine, database_url, sandbox):
    event_id = signup(engine, "u1")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    (accepted,) = sandbox_messages(sandbox.base_url, event_id)
    result = _cancel(engine, event_id=event_id)
    assert result.status is CancelStatus.ALREADY_SENT and not result.cancelled
    (sent,) = result.sent_messages
    assert (sent.route, sent.provider, sent.provider_message_id) == (
        "welcome",
        "sandbox",
        accepted["id"],
    )
    assert event(engine, event_id).status == "done"
    assert "already sent" in result.describe() and accepted["id"] in result.describe()


def test_a_run_that_died_after_a_send_gives_back_a_partly_sent_event(engine, database_url, sandbox):
    event_id = signup(engine, "u1")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    # As release_run leaves the event of a run that died after its provider call.
    with engine.begin() as connection:
        connection.execute(
            update(email_outbox)
            .where(email_outbox.c.event_id == event_id)
            .values(status="pending", resolution=None, done_at=None)
        )
    result = _cancel(engine, event_id=event_id)
    assert result.status is CancelStatus.PARTLY_SENT and result.cancelled
    assert [m.message_id for m in result.sent_messages] == [
        m.message_id for m in messages_of(engine, event_id)
    ]
    assert event(engine, event_id).status == "cancelled"


def test_an_event_a_run_holds_is_in_flight_and_left_to_the_run(engine, database_url, sandbox):
    event_id = signup(engine, "u1")
    with engine.begin() as connection:
        (_claimed,) = outbox.claim(connection, [event_id], run_id="run-1", lease_s=60, now=utcnow())
    result = _cancel(engine, event_id=event_id)
    assert result.status is CancelStatus.IN_FLIGHT and not result.cancelled
    assert result.claimed_by == "run-1" and event(engine, event_id).status == "in_flight"
    # The run still holds it and sends it.
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    provider = SandboxProvider(sandbox.base_url)
    try:
        outcome = batch_sender(engine, provider, lane).run([event_id], run_id="run-1")
    finally:
        provider.close()
    assert outcome.sent == 1 and event(engine, event_id).status == "done"
    assert _cancel(engine, event_id=event_id).status is CancelStatus.ALREADY_SENT


def test_suppressed_mail_is_finished_not_sent(engine, database_url, sandbox):
    from email_platform.store import suppressions

    with engine.begin() as connection:
        suppressions.add(
            connection, "u1@example.com", reason="hard_bounce", source="test", now=utcnow()
        )
    event_id = signup(engine, "u1")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    result = _cancel(engine, event_id=event_id)
    assert result.status is CancelStatus.ALREADY_FINISHED and result.sent_messages == ()
    assert (result.event_status, result.resolution) == ("done", event(engine, event_id).resolution)


def _racing_lane() -> LaneConfig:
    return dataclasses.replace(
        DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL],
        batch_size=4,
        concurrency=4,
        worker_poll_s=0.01,
        worker_idle_s=0.3,
        worker_lifetime_s=60,
    )


def test_cancel_racing_a_lane_worker_never_cancels_what_it_sends(engine, database_url):
    ids = [signup(engine, f"u{i}") for i in range(40)]
    lane = _racing_lane()
    with SandboxServer(SandboxConfig(latency_ms=30)) as sandbox_url:
        provider = SandboxProvider(sandbox_url, batch_max=1)
        worker = LaneWorker(
            sender=batch_sender(engine, provider, lane), engine=engine, lane=lane, run_id="w-1"
        )
        first_batch = threading.Event()
        worker.on_batch = lambda _: first_batch.set()
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            assert first_batch.wait(30)  # the worker is sending: now race it, newest first
            results = {event_id: _cancel(engine, event_id=event_id) for event_id in reversed(ids)}
        finally:
            thread.join(60)
            provider.close()
        assert not thread.is_alive()
        accepted = {m["metadata"]["event_id"] for m in sandbox_messages(sandbox_url)}
    statuses = {event_id: event(engine, event_id).status for event_id in ids}
    cancelled = {e for e, r in results.items() if r.cancelled}
    # Nothing is both cancelled and sent, and nothing is lost: every event ended one way.
    assert not cancelled & accepted
    assert cancelled == {e for e, s in statuses.items() if s == "cancelled"}
    assert accepted == {e for e, s in statuses.items() if s == "done"}
    assert cancelled | accepted == set(ids)
    # Each answer was true: what was in flight or sent went out, what was cancelled did not.
    for event_id, result in results.items():
        if result.status in (CancelStatus.IN_FLIGHT, CancelStatus.ALREADY_SENT):
            assert event_id in accepted
    assert cancelled and accepted  # the race was real: both sides won some


def _cli(database_url: str, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(
        main, ["cancel", *args], env={"EMAIL_PLATFORM_DATABASE_URL": database_url}
    )


def test_cli_cancels_by_id_and_key_and_exits_1_when_nothing_was_cancelled(
    engine, database_url, sandbox
):
    pending = _later(engine, "u1")
    keyed = _later(engine, "u2", idempotency_key="refund-2")
    sent = signup(engine, "u3")
    assert run_send(database_url, sandbox.base_url, "transactional", [sent]).success
    done = _cli(database_url, pending, sent, "--idempotency-key", "refund-2", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["cancelled"] == 2
    assert [(r["event_id"], r["status"]) for r in report["results"]] == [
        (pending, "cancelled"),
        (sent, "already_sent"),
        (keyed, "cancelled"),
    ]
    (message,) = report["results"][1]["sent_messages"]
    assert message["provider_message_id"] == messages_of(engine, sent)[0].provider_message_id
    nothing = _cli(database_url, sent, "01JUNKNOWN0000000000000000")
    assert nothing.exit_code == 1
    assert f"{sent}: already sent, not cancelled" in nothing.output
    assert "unknown event" in nothing.output and "cancelled 0 of 2" in nothing.output
    assert _cli(database_url).exit_code == 2  # nothing asked: a usage error


@hostile_settings(max_examples=60)
@given(
    value=st.one_of(hostile_text, st.sampled_from(["", "\x00" * 26, "01J" + "\ud800" * 23])),
    by_key=st.booleans(),
)
def test_any_text_gets_an_answer_never_an_exception(engine: Engine, value: str, by_key: bool):
    pending = _later(engine, f"h{uuid.uuid4().hex[:12]}") if not by_key else None
    kwargs = {"idempotency_key": value} if by_key else {"event_id": value}
    with engine.begin() as connection:
        result = cancel(connection, **kwargs)
        assert result.status is CancelStatus.UNKNOWN
        # The transaction is still usable, and nothing else was touched.
        if pending is not None:
            assert cancel(connection, event_id=pending).cancelled


def test_a_claim_skips_an_event_a_cancel_holds_and_both_orders_are_exclusive(engine):
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite serializes the two writers: the claim waits for the cancel's commit")
    first, second = _later(engine, "u1"), _later(engine, "u2")
    due = utcnow() + timedelta(days=2)
    with engine.connect() as cancelling:
        cancelling.begin()
        assert cancel(cancelling, event_id=first).cancelled  # not committed yet
        with engine.begin() as connection:  # a run claims while the cancel is open
            taken = outbox.claim(connection, [first, second], run_id="run-1", lease_s=60, now=due)
        assert [row.event_id for row in taken] == [second]  # SKIP LOCKED: not the held one
        cancelling.commit()
    # Claimed first, the other way round: the cancel finds it in flight and changes nothing.
    result = _cancel(engine, event_id=second)
    assert result.status is CancelStatus.IN_FLIGHT and result.claimed_by == "run-1"
    assert (event(engine, first).status, event(engine, second).status) == (
        "cancelled",
        "in_flight",
    )
