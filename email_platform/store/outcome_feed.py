"""The outcome feed's reads of ``email_events``: provider outcomes in id order, joined to their
message (route) and event (aggregate), up to a watermark below which every id is settled.

Ids are taken when a row is inserted and become visible when its transaction commits, so on
PostgreSQL a reader that saw id 12 may later see 11 appear: a cursor at 12 would skip it. Every
insert into ``email_events`` holds a shared advisory lock on the feed for its transaction
(``hold_for_insert``, called by ``email_events.add``); the reader takes that lock exclusively
for a moment, which waits out every inserting transaction in progress, and reads the greatest
id then: every id at or below it is committed or never will be. SQLite has one writer at a time,
so its ids commit in order.
"""

import hashlib
from typing import Any

from sqlalchemy import Connection, Row, func, select, text

from email_platform.common.errors import ConfigurationError
from email_platform.db.schema import email_events as events
from email_platform.db.schema import email_messages as messages
from email_platform.db.schema import email_outbox as outbox

#: The provider event types offered to the product.
OUTCOME_KINDS = ("delivered", "bounced", "complained", "unsubscribed")

# A stable 63-bit advisory lock key (db.locks derives its keys the same way).
_LOCK_KEY = (
    int.from_bytes(hashlib.blake2b(b"email_events.feed", digest_size=8).digest(), "big") >> 1
)


def hold_for_insert(connection: Connection) -> None:
    """Before inserting into ``email_events``: the shared side of the feed's lock, held until
    the transaction ends (re-entrant, and cheap: inserters never wait for each other)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock_shared(:key)"), {"key": _LOCK_KEY})


def settled_watermark(connection: Connection) -> int:
    """The greatest ``email_event_id`` at or below which no insert is still uncommitted."""
    if connection.dialect.name != "postgresql":
        return int(connection.execute(select(func.max(events.c.email_event_id))).scalar() or 0)
    isolation = connection.execute(text("SELECT current_setting('transaction_isolation')"))
    if isolation.scalar() != "read committed":
        # A snapshot older than the lock would miss what the lock waited for.
        raise ConfigurationError(
            "read_outcomes() needs a READ COMMITTED transaction on PostgreSQL (the default)"
        )
    # A session lock, released at once rather than at the caller's commit: ingestion waits
    # only as long as this read takes, however long the caller's transaction lasts.
    connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _LOCK_KEY})
    try:
        highest = connection.execute(select(func.max(events.c.email_event_id))).scalar()
        connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _LOCK_KEY})
    except BaseException:
        # An aborted transaction cannot unlock; closing the session frees the lock, so a
        # pooled connection never keeps ingestion waiting.
        connection.invalidate()
        raise
    return int(highest or 0)


def outcomes_between(connection: Connection, after: int, upto: int, limit: int) -> list[Row]:
    """Provider outcomes with ``after < email_event_id <= upto`` that name an event, in id
    order, at most ``limit``; with the message's route and the event's aggregate id."""
    query: Any = (
        select(
            events.c.email_event_id,
            events.c.provider,
            events.c.provider_event_id,
            events.c.event_type,
            events.c.occurred_at,
            events.c.event_id,
            events.c.message_id,
            events.c.provider_message_id,
            events.c.recipient,
            events.c.bounce_type,
            messages.c.route,
            outbox.c.aggregate_id,
            outbox.c.event_type.label("source_event_type"),
        )
        .select_from(
            events.outerjoin(messages, messages.c.message_id == events.c.message_id).outerjoin(
                outbox, outbox.c.event_id == events.c.event_id
            )
        )
        .where(
            events.c.email_event_id > after,
            events.c.email_event_id <= upto,
            events.c.event_type.in_(OUTCOME_KINDS),
            events.c.event_id.is_not(None),
        )
        .order_by(events.c.email_event_id)
        .limit(limit)
    )
    return list(connection.execute(query).all())
