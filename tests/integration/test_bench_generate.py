"""The bench's history generator: the history a seed makes stays the one it made before it
wrote in chunks, and a history written in many chunks has the same shape (counts, status mix,
provider events in arrival order, delivery statuses as ingestion keeps them, late opens)."""

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, inspect, text

from bench.generate import generate
from bench.history_rows import BULK_TABLES
from email_platform.webhooks.vocabulary import combine

END = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _counts(engine: Engine, sql: str) -> dict:
    with engine.connect() as connection:
        return {row[0]: row[1] for row in connection.execute(text(sql))}


def _scalar(engine: Engine, sql: str) -> int:
    with engine.connect() as connection:
        return connection.execute(text(sql)).scalar_one()


def test_a_seed_makes_the_history_it_made_before_chunks(engine: Engine) -> None:
    """Figures of the generator as it was before it wrote in chunks (seed 7, 1,500 messages
    over three days, then 100 with late opens): one chunk is that same history."""
    first = generate(engine, messages=1500, days=3, end=END - timedelta(hours=1))
    assert (first.messages, first.attempts, first.provider_events) == (1500, 1659, 6595)
    assert (first.dead_letters, first.deferred, first.statuses_raised) == (9, 1218, 0)
    assert _counts(engine, "SELECT status, count(*) FROM email_messages GROUP BY status") == {
        "dead": 9, "duplicate": 7, "expired": 4, "sent": 1469, "suppressed": 11,
    }  # fmt: skip
    events = "SELECT event_type, count(*) FROM email_events GROUP BY event_type"
    assert _counts(engine, events) == {
        "queued": 1469, "sent": 1469, "delivered": 1436, "bounced": 25, "opened": 1866,
        "clicked": 321, "complained": 3, "unsubscribed": 6,
    }  # fmt: skip
    later = generate(engine, messages=100, days=0.005, end=END, seed=9,
                     late_events_for_existing=40, steady_state=True)  # fmt: skip
    assert (later.messages, later.attempts, later.deferred) == (100, 117, 196)
    # Late opens for older messages: the 40 asked for plus the 196 this batch defers.
    late = _scalar(engine, "SELECT count(*) FROM email_events WHERE message_id <= 1500 "
                   f"AND email_event_id > {first.provider_events}")  # fmt: skip
    assert late == 236
    assert later.statuses_raised > 0


def _utc(at: datetime | str) -> datetime:
    """SQLite gives UTC text (raw SQL), PostgreSQL an aware datetime."""
    at = datetime.fromisoformat(at) if isinstance(at, str) else at
    return at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)


def test_a_history_written_in_chunks_keeps_its_shape(engine: Engine) -> None:
    def index_names() -> set[str]:
        inspector = inspect(engine)
        return {i["name"] for t in BULK_TABLES for i in inspector.get_indexes(t)}

    indexes = index_names()
    made = generate(engine, messages=3000, days=2, end=END, chunk=700)
    assert index_names() == indexes  # dropped for the bulk load, made again after it
    assert _scalar(engine, "SELECT count(*) FROM email_outbox") == 3000
    assert _scalar(engine, "SELECT max(message_id) - min(message_id) + 1 FROM email_messages")
    assert _scalar(engine, "SELECT count(*) FROM email_messages") == 3000
    assert _scalar(engine, "SELECT sum(attempts) FROM email_messages") == made.attempts
    assert _scalar(engine, "SELECT count(*) FROM email_attempts") == made.attempts
    dead = "SELECT count(*) FROM email_messages WHERE status = 'dead'"
    assert (
        _scalar(engine, dead)
        == made.dead_letters
        == _scalar(engine, "SELECT count(*) FROM dead_letters")
    )
    statuses = _counts(engine, "SELECT status, count(*) FROM email_messages GROUP BY status")
    assert 0.96 < statuses["sent"] / 3000 < 0.995
    assert set(statuses) == {"sent", "dead", "suppressed", "duplicate", "expired"}
    with engine.connect() as connection:
        events = connection.execute(
            text(
                "SELECT email_event_id, message_id, event_type, received_at FROM email_events "
                "ORDER BY email_event_id"
            )
        ).all()
        delivery = {
            m: status
            for m, status in connection.execute(
                text("SELECT message_id, delivery_status FROM email_messages")
            )
        }
    assert len(events) == made.provider_events
    assert 4 < made.provider_events / 3000 < 6  # about five a message
    received = [_utc(e.received_at) for e in events]
    assert received == sorted(received)  # ids follow arrival across chunks
    assert max(received) <= END
    # The status each message holds is what ingestion makes of its events in arrival order,
    # also for messages whose late events were written with a later chunk.
    folded: dict[int, str | None] = defaultdict(lambda: None)
    for event in events:
        if event.message_id is not None:
            folded[event.message_id] = combine(folded[event.message_id], event.event_type)
    assert {m: folded[m] for m in delivery} == delivery
    # Opens go on long after the send: the last chunk's messages have opens still to come.
    assert made.deferred > 0
