"""Reads and writes of ``dead_letters``: what could not be sent, why, and what became of it.

Also how the ``dlq list`` inbox shows a letter (``summary``): with the message and event it
names, and never an address.
"""

import hashlib
import hmac
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, and_, case, delete, func, insert, select, update

from email_platform.db.schema import dead_letters, email_messages, email_outbox
from email_platform.store.bulk import one_of, rows_in

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
            .where(
                one_of(connection, dead_letters.c.message_id, message_ids),
                dead_letters.c.status == OPEN,
            )
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
        one_of(connection, dead_letters.c.event_id, event_ids), dead_letters.c.status == OPEN
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


# ---- retention and the expiry sweep (email_platform.operating.retention) -------------------------


def delete_resolved(connection: Connection, *, resolved_before: datetime, limit: int) -> int:
    """Delete at most ``limit`` dead letters (the oldest resolved) closed before
    ``resolved_before``; an open letter is never old enough."""
    oldest = (
        select(dead_letters.c.dead_letter_id)
        .where(_resolved_before(resolved_before))
        .order_by(dead_letters.c.resolved_at, dead_letters.c.dead_letter_id)
        .limit(limit)
    )
    return connection.execute(
        delete(dead_letters).where(
            dead_letters.c.dead_letter_id.in_(oldest.scalar_subquery()),
            dead_letters.c.status != OPEN,
        )
    ).rowcount


def count_resolved(connection: Connection, *, resolved_before: datetime) -> int:
    return int(
        connection.execute(select(func.count()).where(_resolved_before(resolved_before))).scalar()
    )


def _resolved_before(when: datetime) -> Any:
    return and_(dead_letters.c.status != OPEN, dead_letters.c.resolved_at < when)


def _expiry() -> Any:
    """A letter's time to live: its message's ``expires_at`` (the event's, or the route's TTL,
    whichever is first), or the event's when it failed before any message existed."""
    return case(
        (dead_letters.c.message_id.is_(None), email_outbox.c.expires_at),
        else_=email_messages.c.expires_at,
    )


def _with_message_and_event(*columns: Any) -> Any:
    return select(*columns).select_from(
        dead_letters.outerjoin(
            email_messages, email_messages.c.message_id == dead_letters.c.message_id
        ).outerjoin(email_outbox, email_outbox.c.event_id == dead_letters.c.event_id)
    )


def _past_expiry(now: datetime, ids: Sequence[int] | None) -> Any:
    query = _with_message_and_event(
        dead_letters.c.dead_letter_id,
        dead_letters.c.event_id,
        dead_letters.c.message_id,
        _expiry().label("expires_at"),
    ).where(dead_letters.c.status == OPEN, _expiry() <= now)
    if ids is not None:
        query = query.where(dead_letters.c.dead_letter_id.in_(list(ids)))
    return query.order_by(dead_letters.c.dead_letter_id)


def open_past_expiry(
    connection: Connection, now: datetime, *, ids: Sequence[int] | None = None, limit: int = 5000
) -> list[Row]:
    """Open letters whose message (or event) expired by ``now``: what the sweep closes. On
    PostgreSQL the letters are locked, skipping any another transaction holds."""
    query = _past_expiry(now, ids).limit(limit)
    if connection.dialect.name == "postgresql":
        query = query.with_for_update(of=dead_letters, skip_locked=True)
    return list(connection.execute(query).all())


def count_past_expiry(connection: Connection, now: datetime) -> int:
    query = _past_expiry(now, None).subquery()
    return int(connection.execute(select(func.count()).select_from(query)).scalar())


def mark_expired(
    connection: Connection, ids: Sequence[int], now: datetime, run_id: str | None = None
) -> int:
    """Close these letters as ``expired`` (only those still open)."""
    if not ids:
        return 0
    return connection.execute(
        update(dead_letters)
        .where(dead_letters.c.dead_letter_id.in_(list(ids)), dead_letters.c.status == OPEN)
        .values(status=EXPIRED, resolved_at=now, resolved_by_run_id=run_id)
    ).rowcount


def events_with_open_letters(connection: Connection, event_ids: Sequence[str]) -> set[str]:
    if not event_ids:
        return set()
    return set(
        connection.execute(
            select(dead_letters.c.event_id).where(
                dead_letters.c.event_id.in_(list(event_ids)), dead_letters.c.status == OPEN
            )
        ).scalars()
    )


# ---- the dead-letter inbox (``email-platform dlq list``) ------------------------------------


def inbox(
    connection: Connection,
    *,
    status: str | None = OPEN,
    reason: str | None = None,
    lane: str | None = None,
    limit: int | None = 100,
) -> list[Row]:
    """Letters, oldest first, each with what its listing summarizes: the message's template
    and recipient, the event's type and payload, and the letter's expiry."""
    query = _with_message_and_event(
        dead_letters,
        email_messages.c.template,
        email_messages.c.recipient,
        email_outbox.c.event_type,
        email_outbox.c.event_version,
        email_outbox.c.payload,
        _expiry().label("expires_at"),
    ).order_by(dead_letters.c.dead_letter_id)
    if status:
        query = query.where(dead_letters.c.status == status)
    if reason:
        query = query.where(dead_letters.c.reason == reason)
    if lane:
        query = query.where(dead_letters.c.lane == lane)
    if limit:
        query = query.limit(limit)
    return list(connection.execute(query).all())


def mask_address(address: Any, tag_key: bytes | None = None) -> str | None:
    """``jane@example.com`` -> ``j***@example.com``: never the address. Anything that is not
    one (no ``@``) is ``***``.

    With ``tag_key``, a short keyed hash of the whole address follows (``j***@example.com
    #5e0c1a``): ``jane@`` and ``jim@`` then read apart, the same address reads the same in every
    letter, and without the database's key no guessed address can be checked against it.
    """
    if not isinstance(address, str) or not address.strip():
        return None
    local, at, domain = address.strip().rpartition("@")
    domain = _one_line(domain.lower(), 255)
    if not at or not local or not domain:
        masked = "***"
    else:
        first = local[0] if local[0].isascii() and local[0].isalnum() else "*"
        masked = f"{first}***@{domain}"
    if tag_key is None:
        return masked
    return f"{masked} #{recipient_tag(address, tag_key)}"


def recipient_tag(address: str, tag_key: bytes) -> str:
    """Six hex digits of HMAC-SHA256 over the trimmed, lowercased address."""
    normal = address.strip().lower().encode("utf-8", "surrogatepass")
    return hmac.new(tag_key, normal, hashlib.sha256).hexdigest()[:6]


def tag_key(connection: Connection, now: datetime) -> bytes:
    """The database's key of recipient tags (made on first use, so the tags stay the same from
    one listing to the next)."""
    from email_platform.store import privacy_keys

    return privacy_keys.ensure(connection, privacy_keys.RECIPIENT_TAG, now)


def summary(row: Row, now: datetime, tag_key: bytes | None = None) -> dict[str, Any]:
    """One letter of ``inbox`` as the listing shows it: no address in any field (the recipient
    masked, with its tag when ``tag_key`` is given)."""
    from email_platform.common.timeutil import as_utc, isoformat
    from email_platform.observability.redaction import loggable

    recipient = row.recipient
    if recipient is None and isinstance(row.payload, dict):
        recipient = row.payload.get("email") if isinstance(row.payload.get("email"), str) else None
    expires_at = as_utc(row.expires_at)
    event_type = None
    if row.event_type is not None:
        event_type = f"{_one_line(row.event_type, 200)} v{row.event_version}"
    return {
        "dead_letter_id": row.dead_letter_id,
        "status": row.status,
        "lane": row.lane,
        "reason": _one_line(row.reason, 60),
        "error_code": _one_line(row.error_code, 100) if row.error_code else None,
        "error": _one_line(loggable(_unmentioned(row.last_error or "", recipient), recipient), 500),
        "attempts": row.attempts,
        "event_id": row.event_id,
        "message_id": row.message_id,
        "run_id": row.run_id,
        "created_at": isoformat(row.created_at),
        "resolved_at": isoformat(row.resolved_at),
        "template": _one_line(row.template, 100) if row.template else None,
        "event_type": event_type,
        "recipient": mask_address(recipient, tag_key),
        "expires_at": isoformat(expires_at),
        "past_expiry": bool(row.status == OPEN and expires_at is not None and expires_at <= now),
    }


def _one_line(text: str, limit: int) -> str:
    """``text`` fit for one terminal line: control characters (newlines, escapes) become
    spaces, and past ``limit`` characters it is cut."""
    cleaned = "".join(c if c.isprintable() else " " for c in text)
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "…"


def _unmentioned(text: str, address: str | None) -> str:
    """``text`` without ``address`` anywhere in it (any case): ``loggable`` spares an address
    glued to other text, which in a listing is as readable as any other."""
    if not address or not address.strip():
        return text
    return re.sub(re.escape(address.strip()), "[address]", text, flags=re.IGNORECASE)
