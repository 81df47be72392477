"""Reads and writes of ``email_events``: normalized provider events, each stored once."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.db.schema import email_event_deletions, email_events
from email_platform.store import outcome_feed
from email_platform.store.bulk import rows_in


def add(connection: Connection, values: dict[str, Any]) -> bool:
    """Store one provider event; False if (provider, provider_event_id) is already there."""
    outcome_feed.hold_for_insert(connection)  # before the id is taken: the feed's watermark
    try:
        with connection.begin_nested():
            connection.execute(insert(email_events).values(**values))
        return True
    except IntegrityError:
        return False


def for_event(connection: Connection, event_id: str) -> list[Row]:
    return list(
        connection.execute(
            select(email_events)
            .where(email_events.c.event_id == event_id)
            .order_by(email_events.c.occurred_at, email_events.c.email_event_id)
        ).all()
    )


def for_message(connection: Connection, message_id: int) -> list[Row]:
    return list(
        connection.execute(
            select(email_events)
            .where(email_events.c.message_id == message_id)
            .order_by(email_events.c.occurred_at, email_events.c.email_event_id)
        ).all()
    )


def provider_message_ids(connection: Connection, message_ids: list[int]) -> dict[int, str | None]:
    """For each of ``message_ids`` the provider has reported an event for: the provider's
    message id it names (None when the events name none)."""
    found: dict[int, str | None] = {}
    for start in range(0, len(message_ids), 500):
        rows = connection.execute(
            select(email_events.c.message_id, email_events.c.provider_message_id).where(
                email_events.c.message_id.in_(message_ids[start : start + 500])
            )
        ).all()
        for message_id, provider_message_id in rows:
            if found.get(message_id) is None:
                found[message_id] = provider_message_id
    return found


def types_for_message(connection: Connection, message_id: int) -> list[str]:
    return list(
        connection.execute(
            select(email_events.c.event_type).where(email_events.c.message_id == message_id)
        ).scalars()
    )


def for_inbox_rows(connection: Connection, inbox_ids: Sequence[int]) -> list[Row]:
    """The events these stored webhooks produced (``webhooks reprocess`` reads them first)."""
    return rows_in(connection, email_events, "inbox_id", inbox_ids)


def suppressing_for(connection: Connection, addresses: Sequence[str]) -> list[Row]:
    """Events to one of ``addresses`` (normalized) of a type that can suppress (a scan: only
    ``webhooks reprocess`` asks)."""
    wanted = sorted(set(addresses))
    found: list[Row] = []
    for start in range(0, len(wanted), 500):
        found.extend(
            connection.execute(
                select(email_events).where(
                    func.lower(email_events.c.recipient).in_(wanted[start : start + 500]),
                    email_events.c.event_type.in_(["bounced", "complained", "unsubscribed"]),
                )
            ).all()
        )
    return found


def delete_for_inbox_rows(connection: Connection, inbox_ids: list[int]) -> int:
    """Forget what these stored webhooks produced, so they can be normalized afresh."""
    return connection.execute(
        delete(email_events).where(email_events.c.inbox_id.in_(inbox_ids))
    ).rowcount


def for_erasure(
    connection: Connection,
    addresses: Sequence[str],
    message_ids: Sequence[int],
    event_ids: Sequence[str],
) -> list[Row]:
    """Provider events to one of ``addresses`` (normalized; a scan), or about these messages
    or events."""
    found = [
        *rows_in(connection, email_events, "message_id", message_ids),
        *rows_in(connection, email_events, "event_id", event_ids),
    ]
    wanted = sorted(set(addresses))
    for start in range(0, len(wanted), 500):
        found.extend(
            connection.execute(
                select(email_events).where(
                    func.lower(email_events.c.recipient).in_(wanted[start : start + 500])
                )
            ).all()
        )
    rows = {row.email_event_id: row for row in found}
    return [rows[key] for key in sorted(rows)]


def anonymize(connection: Connection, email_event_id: int, values: dict[str, Any]) -> None:
    connection.execute(
        update(email_events).where(email_events.c.email_event_id == email_event_id).values(**values)
    )


# ---- retention (email_platform.operating.retention) ----------------------------------------------
# The purge's deletions are no change of the data, only the operational store forgetting it:
# the trigger's records of them are removed in the same transaction. The warehouse keeps what
# it loaded until its daily full rebuild (as it keeps purged messages), and a record for each
# of ~1.5 provider events per purged email would only be another table to purge.


def count_for_events(connection: Connection, events: Any, message_ids: Any) -> int:
    """How many provider events name an event of ``events`` or a message of ``message_ids``
    (id queries: ``outbox.purgeable_query``, ``messages.ids_query``)."""
    from sqlalchemy import or_

    return int(
        connection.execute(
            select(func.count()).where(
                or_(
                    email_events.c.event_id.in_(events.scalar_subquery()),
                    email_events.c.message_id.in_(message_ids.scalar_subquery()),
                )
            )
        ).scalar()
    )


def delete_for(connection: Connection, event_ids: Sequence[str], message_ids: Sequence[int]) -> int:
    """Delete the provider events of these events and messages."""
    from email_platform.store.bulk import one_of

    found: set[int] = set()
    for column, values in (
        (email_events.c.event_id, list(event_ids)),
        (email_events.c.message_id, list(message_ids)),
    ):
        for start in range(0, len(values), 5000):
            found.update(
                connection.execute(
                    select(email_events.c.email_event_id).where(
                        one_of(connection, column, values[start : start + 5000])
                    )
                ).scalars()
            )
    return _delete_quietly(connection, sorted(found))


def orphans_query(received_before: datetime) -> Any:
    """``SELECT email_event_id`` of provider events received before ``received_before``
    whose message and event are both gone (or were never known), oldest first."""
    from sqlalchemy import exists

    from email_platform.db.schema import email_messages, email_outbox

    return (
        select(email_events.c.email_event_id)
        .where(
            email_events.c.received_at < received_before,
            ~exists().where(email_messages.c.message_id == email_events.c.message_id),
            ~exists().where(email_outbox.c.event_id == email_events.c.event_id),
        )
        .order_by(email_events.c.received_at, email_events.c.email_event_id)
    )


def delete_orphans(connection: Connection, received_before: datetime, limit: int) -> int:
    ids = list(connection.execute(orphans_query(received_before).limit(limit)).scalars())
    return _delete_quietly(connection, ids)


def count_of(connection: Connection, query: Any) -> int:
    return int(connection.execute(select(func.count()).select_from(query.subquery())).scalar())


def delete_deletion_records(connection: Connection, *, deleted_before: datetime, limit: int) -> int:
    """Past retention, at most ``limit`` rows (the oldest)."""
    oldest = (
        select(email_event_deletions.c.deletion_id)
        .where(email_event_deletions.c.deleted_at < deleted_before)
        .order_by(email_event_deletions.c.deletion_id)
        .limit(limit)
    )
    return connection.execute(
        delete(email_event_deletions).where(
            email_event_deletions.c.deletion_id.in_(oldest.scalar_subquery())
        )
    ).rowcount


def count_deletion_records(connection: Connection, *, deleted_before: datetime) -> int:
    return int(
        connection.execute(
            select(func.count()).where(email_event_deletions.c.deleted_at < deleted_before)
        ).scalar()
    )


def _delete_quietly(connection: Connection, ids: Sequence[int]) -> int:
    """Delete these rows, and the deletion records the trigger wrote for them just now."""
    from email_platform.store.bulk import one_of

    before = connection.execute(select(func.max(email_event_deletions.c.deletion_id))).scalar()
    total = 0
    for start in range(0, len(ids), 5000):
        chunk = list(ids[start : start + 5000])
        total += connection.execute(
            delete(email_events).where(one_of(connection, email_events.c.email_event_id, chunk))
        ).rowcount
        records = delete(email_event_deletions).where(
            one_of(connection, email_event_deletions.c.email_event_id, chunk)
        )
        if before is not None:
            records = records.where(email_event_deletions.c.deletion_id > before)
        connection.execute(records)
    return total
