"""Reads and writes of ``email_events``: normalized provider events, each stored once."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.db.schema import email_event_deletions, email_events
from email_platform.store.bulk import rows_in


def add(connection: Connection, values: dict[str, Any]) -> bool:
    """Store one provider event; False if (provider, provider_event_id) is already there."""
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


def delete_for_inbox_rows(connection: Connection, inbox_ids: list[int]) -> int:
    """Forget what these stored webhooks produced, so they can be normalized afresh."""
    return connection.execute(
        delete(email_events).where(email_events.c.inbox_id.in_(inbox_ids))
    ).rowcount


def purge_deletion_records(connection: Connection, *, deleted_before: datetime) -> int:
    """Drop the records of rows deleted before ``deleted_before``: the warehouse reads them
    within minutes, and rebuilds from scratch daily anyway."""
    return connection.execute(
        delete(email_event_deletions).where(email_event_deletions.c.deleted_at < deleted_before)
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
