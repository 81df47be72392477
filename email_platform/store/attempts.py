"""Reads and writes of ``email_attempts``: one row per provider call, kept forever for trace."""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, func, select, update

from email_platform.db.schema import email_attempts as attempts
from email_platform.store.bulk import insert_rows, rows_in


def add(connection: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Record provider calls, a whole group of them in one statement."""
    insert_rows(connection, attempts, rows)


def for_event(connection: Connection, event_id: str) -> list[Row]:
    return list(
        connection.execute(
            select(attempts).where(attempts.c.event_id == event_id).order_by(attempts.c.attempt_id)
        ).all()
    )


def count_by_outcome(connection: Connection) -> dict[str, int]:
    rows = connection.execute(
        select(attempts.c.outcome, func.count()).group_by(attempts.c.outcome)
    ).all()
    return {outcome: n for outcome, n in rows}


def for_erasure(
    connection: Connection, message_ids: Sequence[int], event_ids: Sequence[str]
) -> list[Row]:
    """The attempts of these messages, and of these events."""
    rows = {
        row.attempt_id: row
        for row in [
            *rows_in(connection, attempts, "message_id", message_ids),
            *rows_in(connection, attempts, "event_id", event_ids),
        ]
    }
    return [rows[key] for key in sorted(rows)]


def set_error(connection: Connection, attempt_id: int, error: str | None) -> None:
    connection.execute(
        update(attempts).where(attempts.c.attempt_id == attempt_id).values(error=error)
    )
