"""The fault harness's stream and checker (``bench.faults``), which the drains in
``tests/proof/faults/`` rely on: each defect the checker exists to catch, planted in a
database, is counted, so a drain that reports nothing lost, doubled or wrong could have.
"""

from datetime import timedelta

from sqlalchemy import insert, update

from bench.faults.checker import check
from bench.faults.stream import Stream, prepare
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_attempts, email_messages, email_outbox
from tests.support import run_send, sandbox_messages


def _stream(engine, total: int = 60) -> Stream:  # type: ignore[no-untyped-def]
    prepare(engine)  # the product's users table, which signups write to
    stream = Stream(engine, total=total, per_s=10_000, seed=3)
    stream.run()
    return stream


def test_the_stream_owes_only_events_whose_transaction_committed(engine):
    """Found by the large drain: a commit PostgreSQL refused as it restarted raised after the
    event was written in the transaction, and the stream had already counted it owed, so the
    checker called an event that never existed lost."""
    from sqlalchemy import event as sa_event
    from sqlalchemy.exc import OperationalError

    commits = {"n": 0}

    def refuse_the_third(_connection) -> None:  # type: ignore[no-untyped-def]
        commits["n"] += 1
        if commits["n"] == 3:
            raise OperationalError("COMMIT", {}, Exception("server closed the connection"))

    sa_event.listen(engine, "commit", refuse_the_third)
    try:
        stream = _stream(engine, total=10)
    finally:
        sa_event.remove(engine, "commit", refuse_the_third)
    assert stream.expected.refused == 1
    with engine.connect() as connection:
        stored = set(
            connection.execute(
                email_outbox.select().with_only_columns(email_outbox.c.event_id)
            ).scalars()
        )
    assert set(stream.expected.fates) == stored and len(stored) == 9


def test_the_checker_counts_an_unfinished_event_as_lost(engine):
    stream = _stream(engine)
    assert stream.expected.refused == 0 and stream.expected.kinds["signup"] > 0
    verdict = check(engine, stream.expected, [], 0)
    # Nothing was sent: every event is still pending.
    assert verdict.lost == len(stream.expected.fates)


def test_the_checker_passes_a_clean_send_and_catches_each_planted_defect(
    engine, database_url, sandbox
):
    stream = _stream(engine)
    by_lane: dict[str, list[str]] = {}
    with engine.connect() as connection:
        for event_id, lane in connection.execute(
            email_outbox.select().with_only_columns(email_outbox.c.event_id, email_outbox.c.lane)
        ):
            by_lane.setdefault(lane, []).append(event_id)
    for lane, event_ids in by_lane.items():
        # Past send_after and their expiry (1 ms after it): the expiring digests are due and
        # expired, as they are 2 s after publishing.
        with engine.begin() as connection:
            connection.execute(
                update(email_outbox)
                .where(email_outbox.c.available_at > utcnow())
                .values(
                    available_at=utcnow() - timedelta(seconds=1),
                    expires_at=utcnow() - timedelta(seconds=1) + timedelta(milliseconds=1),
                )
            )
        run_send(database_url, sandbox.base_url, lane, event_ids)
    accepted = sandbox_messages(sandbox.base_url)
    clean = check(engine, stream.expected, accepted, 0)
    assert (clean.lost, clean.doubled, clean.wrong) == (0, 0, 0), clean.details

    with engine.begin() as connection:
        sent = connection.execute(
            email_messages.select().where(email_messages.c.status == "sent").limit(1)
        ).one()
        suppressed = connection.execute(
            email_messages.select().where(email_messages.c.status == "suppressed").limit(1)
        ).first()
        # A second sender recorded the same acceptance.
        connection.execute(
            insert(email_attempts).values(
                message_id=sent.message_id,
                event_id=sent.event_id,
                run_id="another-run",
                attempt_no=9,
                started_at=utcnow(),
                finished_at=utcnow(),
                outcome="accepted",
            )
        )
        # An event left in flight by a dead run.
        connection.execute(
            update(email_outbox)
            .where(email_outbox.c.event_id == stream_first_sent(stream, sent.event_id))
            .values(status="in_flight")
        )
    planted = check(engine, stream.expected, accepted, 0)
    assert planted.doubled == 1, planted.details
    assert planted.lost == 1, planted.details
    if suppressed is not None:
        with engine.begin() as connection:
            connection.execute(
                update(email_messages)
                .where(email_messages.c.message_id == suppressed.message_id)
                .values(status="sent")
            )
        assert check(engine, stream.expected, accepted, 0).wrong == 1
    # The provider accepting one message under two keys is doubled too.
    twice = [
        *accepted,
        {**accepted[0], "idempotency_key": "other:" + accepted[0]["idempotency_key"]},
    ]
    assert check(engine, stream.expected, twice, 0).doubled == planted.doubled + 1


def stream_first_sent(stream: Stream, but_not: str) -> str:
    """A sent-fated event other than ``but_not``."""
    return next(e for e, fate in stream.expected.fates.items() if fate == "sent" and e != but_not)
