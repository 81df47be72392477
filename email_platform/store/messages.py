"""Reads and writes of ``email_messages``: one row per event x route, and its status machine."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.db.schema import email_messages as messages

PENDING, SENT, SUPPRESSED, EXPIRED, DUPLICATE, DEAD = (
    "pending",
    "sent",
    "suppressed",
    "expired",
    "duplicate",
    "dead",
)
MESSAGE_STATUSES = (PENDING, SENT, SUPPRESSED, EXPIRED, DUPLICATE, DEAD)
TERMINAL = frozenset({SENT, SUPPRESSED, EXPIRED, DUPLICATE, DEAD})


def for_events(connection: Connection, event_ids: Sequence[str]) -> list[Row]:
    rows: list[Row] = []
    for start in range(0, len(event_ids), 500):
        chunk = list(event_ids[start : start + 500])
        rows.extend(
            connection.execute(
                select(messages)
                .where(messages.c.event_id.in_(chunk))
                .order_by(messages.c.message_id)
            ).all()
        )
    return rows


def get(connection: Connection, message_id: int) -> Row | None:
    return connection.execute(select(messages).where(messages.c.message_id == message_id)).first()


def create(connection: Connection, values: dict[str, Any]) -> Row:
    """Insert a message; a taken dedupe key makes it a ``duplicate`` instead.

    The unique index on ``dedupe_key`` is the arbiter, so two runs racing on the same key
    cannot both win. The savepoint keeps the caller's transaction usable after the conflict.
    """
    dedupe_key = values.get("dedupe_key")
    if dedupe_key is not None:
        try:
            with connection.begin_nested():
                return _insert(connection, values)
        except IntegrityError:
            holder = connection.execute(
                select(messages.c.message_id).where(messages.c.dedupe_key == dedupe_key)
            ).scalar()
            if holder is None:
                raise
            values = {
                **values,
                "dedupe_key": None,
                "status": DUPLICATE,
                "last_error": f"dedupe key {dedupe_key!r} already used by message {holder}",
            }
    return _insert(connection, values)


def _insert(connection: Connection, values: dict[str, Any]) -> Row:
    return connection.execute(insert(messages).values(**values).returning(*messages.c)).one()


def set_status(
    connection: Connection,
    message_id: int,
    status: str,
    now: datetime,
    *,
    last_error: str | None = None,
    **extra: Any,
) -> None:
    connection.execute(
        update(messages)
        .where(messages.c.message_id == message_id)
        .values(status=status, updated_at=now, last_error=last_error, **extra)
    )


def record_attempt(
    connection: Connection,
    message_id: int,
    now: datetime,
    *,
    accepted: bool,
    provider: str,
    provider_message_id: str | None,
    error: str | None,
) -> None:
    values: dict[str, Any] = {
        "attempts": messages.c.attempts + 1,
        "updated_at": now,
        "provider": provider,
        "last_error": error,
    }
    if accepted:
        values.update(status=SENT, provider_message_id=provider_message_id, sent_at=now)
    connection.execute(update(messages).where(messages.c.message_id == message_id).values(**values))


def reopen_dead(connection: Connection, event_ids: Sequence[str], now: datetime) -> list[int]:
    """A replay gives dead messages another go, with the idempotency key they already have."""
    rows = connection.execute(
        update(messages)
        .where(messages.c.event_id.in_(list(event_ids)), messages.c.status == DEAD)
        .values(status=PENDING, updated_at=now)
        .returning(messages.c.message_id)
    ).all()
    return [row.message_id for row in rows]


def counts_by_status(connection: Connection) -> dict[str, int]:
    rows = connection.execute(
        select(messages.c.status, func.count()).group_by(messages.c.status)
    ).all()
    counts = dict.fromkeys(MESSAGE_STATUSES, 0)
    counts.update({status: n for status, n in rows})
    return counts
