"""Reads and writes of ``dead_letters``: what could not be sent, why, and what became of it."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, func, insert, select, update

from email_platform.db.schema import dead_letters
from email_platform.store.bulk import rows_in

OPEN, REPLAYED, DISCARDED, EXPIRED, SUPPRESSED = (
    "open",
    "replayed",
    "discarded",
    "expired",
    "suppressed",
)


def add(connection: Connection, values: dict[str, Any]) -> None:
    connection.execute(insert(dead_letters).values(status=OPEN, **values))


def list_letters(
    connection: Connection,
    *,
    status: str | None = OPEN,
    reason: str | None = None,
    lane: str | None = None,
    event_id: str | None = None,
    run_id: str | None = None,
    limit: int | None = None,
) -> list[Row]:
    query = select(dead_letters).order_by(dead_letters.c.dead_letter_id)
    if status:
        query = query.where(dead_letters.c.status == status)
    if reason:
        query = query.where(dead_letters.c.reason == reason)
    if lane:
        query = query.where(dead_letters.c.lane == lane)
    if event_id:
        query = query.where(dead_letters.c.event_id == event_id)
    if run_id:
        query = query.where(dead_letters.c.run_id == run_id)
    if limit:
        query = query.limit(limit)
    return list(connection.execute(query).all())


def for_ids(connection: Connection, ids: Sequence[int]) -> list[Row]:
    return list(
        connection.execute(
            select(dead_letters)
            .where(dead_letters.c.dead_letter_id.in_(list(ids)))
            .order_by(dead_letters.c.dead_letter_id)
        ).all()
    )


def resolve_for_messages(
    connection: Connection,
    message_ids: Sequence[int],
    *,
    status: str,
    run_id: str | None,
    now: datetime,
) -> None:
    """Close the open dead letters of messages a replay sent (or found expired)."""
    if message_ids:
        connection.execute(
            update(dead_letters)
            .where(dead_letters.c.message_id.in_(list(message_ids)), dead_letters.c.status == OPEN)
            .values(status=status, resolved_at=now, resolved_by_run_id=run_id)
        )


def resolve_for_events(
    connection: Connection,
    event_ids: Sequence[str],
    *,
    status: str,
    run_id: str | None,
    now: datetime,
    only_without_message: bool = True,
) -> None:
    if not event_ids:
        return
    query = update(dead_letters).where(
        dead_letters.c.event_id.in_(list(event_ids)), dead_letters.c.status == OPEN
    )
    if only_without_message:
        query = query.where(dead_letters.c.message_id.is_(None))
    connection.execute(query.values(status=status, resolved_at=now, resolved_by_run_id=run_id))


def open_message_ids(connection: Connection, event_ids: Sequence[str]) -> list[int]:
    rows = connection.execute(
        select(dead_letters.c.message_id).where(
            dead_letters.c.event_id.in_(list(event_ids)),
            dead_letters.c.status == OPEN,
            dead_letters.c.message_id.is_not(None),
        )
    ).all()
    return sorted({row.message_id for row in rows})


def open_event_ids_of_runs(connection: Connection, run_ids: Sequence[str]) -> list[str]:
    """Events with an open dead letter recorded by one of ``run_ids``, in id order."""
    rows = connection.execute(
        select(dead_letters.c.event_id)
        .where(dead_letters.c.run_id.in_(list(run_ids)), dead_letters.c.status == OPEN)
        .distinct()
        .order_by(dead_letters.c.event_id)
    )
    return list(rows.scalars())


def discard(connection: Connection, ids: Sequence[int], now: datetime) -> int:
    return connection.execute(
        update(dead_letters)
        .where(dead_letters.c.dead_letter_id.in_(list(ids)), dead_letters.c.status == OPEN)
        .values(status=DISCARDED, resolved_at=now)
    ).rowcount


def open_by_reason(connection: Connection) -> dict[str, int]:
    rows = connection.execute(
        select(dead_letters.c.reason, func.count())
        .where(dead_letters.c.status == OPEN)
        .group_by(dead_letters.c.reason)
    ).all()
    return {reason: n for reason, n in rows}


def for_event(connection: Connection, event_id: str) -> list[Row]:
    return list_letters(connection, status=None, event_id=event_id)


def for_erasure(
    connection: Connection, message_ids: Sequence[int], event_ids: Sequence[str]
) -> list[Row]:
    """The dead letters of these messages, and of these events."""
    rows = {
        row.dead_letter_id: row
        for row in [
            *rows_in(connection, dead_letters, "message_id", message_ids),
            *rows_in(connection, dead_letters, "event_id", event_ids),
        ]
    }
    return [rows[key] for key in sorted(rows)]


def anonymize(connection: Connection, dead_letter_id: int, values: dict[str, Any]) -> None:
    connection.execute(
        update(dead_letters).where(dead_letters.c.dead_letter_id == dead_letter_id).values(**values)
    )
