"""Reads and writes of ``webhook_inbox``: raw bodies in, claimed batches out."""

import hashlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, and_, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.common.text import text_problem
from email_platform.db.schema import webhook_inbox as inbox
from email_platform.store.bulk import rows_in, text_holds_any

PENDING, IN_FLIGHT, PROCESSED, MALFORMED, FAILED = (
    "pending",
    "in_flight",
    "processed",
    "malformed",
    "failed",
)


def store(
    connection: Connection,
    *,
    provider: str,
    delivery_id: str | None,
    headers: dict[str, str],
    body: str,
    now: datetime,
    status: str = PENDING,
    error: str | None = None,
) -> int | None:
    """Insert a received body; None if this provider delivery id is already stored."""
    delivery_id = _storable_delivery_id(delivery_id)
    values: dict[str, Any] = {
        "provider": provider,
        "delivery_id": delivery_id,
        "headers": headers,
        "body": body,
        "received_at": now,
        "status": status,
        "error": error,
    }
    try:
        with connection.begin_nested():
            return connection.execute(
                insert(inbox).values(**values).returning(inbox.c.inbox_id)
            ).scalar_one()
    except IntegrityError:
        if delivery_id is None:
            raise
        return None


def _storable_delivery_id(delivery_id: str | None) -> str | None:
    """A delivery id the column holds: an over-long or unstorable one becomes its SHA-256, so
    a repeat of the same delivery still finds it."""
    if delivery_id is None:
        return None
    limit = inbox.c.delivery_id.type.length
    if len(delivery_id) <= limit and text_problem(delivery_id) is None:
        return delivery_id
    raw = delivery_id.encode("utf-8", "surrogatepass")
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def find_requestable(
    connection: Connection, now: datetime, request_timeout_s: int, limit: int
) -> Sequence[Row]:
    stale = now - timedelta(seconds=request_timeout_s)
    return connection.execute(
        select(inbox.c.inbox_id, inbox.c.request_count)
        .where(
            or_(
                and_(
                    inbox.c.status == PENDING,
                    or_(inbox.c.requested_at.is_(None), inbox.c.requested_at < stale),
                ),
                and_(inbox.c.status == IN_FLIGHT, inbox.c.lease_expires_at < now),
            )
        )
        .order_by(inbox.c.inbox_id)
        .limit(limit)
    ).all()


def mark_requested(connection: Connection, inbox_ids: Sequence[int], now: datetime) -> None:
    connection.execute(
        update(inbox)
        .where(inbox.c.inbox_id.in_(list(inbox_ids)))
        .values(requested_at=now, request_count=inbox.c.request_count + 1)
    )


def claim(
    connection: Connection,
    inbox_ids: Sequence[int],
    *,
    run_id: str,
    lease_s: int,
    now: datetime,
) -> list[Row]:
    claimable = and_(
        inbox.c.inbox_id.in_(list(inbox_ids)),
        or_(
            inbox.c.status == PENDING,
            and_(
                inbox.c.status == IN_FLIGHT,
                or_(inbox.c.claimed_by == run_id, inbox.c.lease_expires_at < now),
            ),
        ),
    )
    if connection.dialect.name == "postgresql":
        locked = select(inbox.c.inbox_id).where(claimable).with_for_update(skip_locked=True)
        target = inbox.c.inbox_id.in_(locked.scalar_subquery())
    else:
        target = claimable
    rows = connection.execute(
        update(inbox)
        .where(target)
        .values(
            status=IN_FLIGHT, claimed_by=run_id, lease_expires_at=now + timedelta(seconds=lease_s)
        )
        .returning(*inbox.c)
    ).all()
    return sorted(rows, key=lambda r: r.inbox_id)


def finish(
    connection: Connection, inbox_id: int, *, status: str, error: str | None, now: datetime
) -> None:
    connection.execute(
        update(inbox)
        .where(inbox.c.inbox_id == inbox_id)
        .values(status=status, error=error, processed_at=now, lease_expires_at=None)
    )


def release_run(connection: Connection, run_id: str) -> int:
    return connection.execute(
        update(inbox)
        .where(inbox.c.claimed_by == run_id, inbox.c.status == IN_FLIGHT)
        .values(status=PENDING, lease_expires_at=None, requested_at=None)
    ).rowcount


def make_requestable(connection: Connection, inbox_ids: Sequence[int], max_requests: int) -> int:
    """Pending webhooks of a run that died before claiming them: requestable again at once,
    as ``outbox.make_requestable`` does for events (fewer than ``max_requests`` requests only,
    so doomed runs do not loop tightly)."""
    total = 0
    ids = list(inbox_ids)
    for start in range(0, len(ids), 500):
        total += connection.execute(
            update(inbox)
            .where(
                inbox.c.inbox_id.in_(ids[start : start + 500]),
                inbox.c.status == PENDING,
                inbox.c.request_count < max_requests,
            )
            .values(requested_at=None)
        ).rowcount
    return total


def counts_by_status(connection: Connection) -> dict[str, int]:
    rows = connection.execute(select(inbox.c.status, func.count()).group_by(inbox.c.status)).all()
    return {status: n for status, n in rows}


def reprocessable_ids(connection: Connection, *, since: datetime | None = None) -> list[int]:
    query = select(inbox.c.inbox_id).where(inbox.c.status.in_([PROCESSED, FAILED, MALFORMED]))
    if since is not None:
        query = query.where(inbox.c.received_at >= since)
    return list(connection.execute(query).scalars())


def requeue(connection: Connection, inbox_ids: list[int]) -> int:
    """Send stored bodies through normalization again (after a mapping fix)."""
    if not inbox_ids:
        return 0
    return connection.execute(
        update(inbox)
        .where(inbox.c.inbox_id.in_(inbox_ids))
        .values(status=PENDING, requested_at=None, processed_at=None, error=None)
    ).rowcount


# ---- erasure (email_platform.operating.erasure) --------------------------------------------------


def mentioning(connection: Connection, terms: Sequence[str]) -> list[Row]:
    """Stored bodies that hold one of ``terms`` somewhere (a scan; the caller reads them)."""
    if not terms:
        return []
    return list(connection.execute(select(inbox).where(text_holds_any(inbox.c.body, terms))))


def for_ids(connection: Connection, inbox_ids: Sequence[int]) -> list[Row]:
    return rows_in(connection, inbox, "inbox_id", inbox_ids)


def anonymize(connection: Connection, inbox_id: int, values: dict[str, Any]) -> None:
    connection.execute(update(inbox).where(inbox.c.inbox_id == inbox_id).values(**values))


# ---- retention (email_platform.operating.retention) ----------------------------------------------


def delete_processed(connection: Connection, *, received_before: datetime, limit: int) -> int:
    """Past retention, at most ``limit`` rows (the oldest ids): one bounded transaction.

    Only ``processed`` rows: pending and in-flight ones are still to be applied, and
    malformed or failed ones wait for ``webhooks reprocess`` after a mapping fix.
    """
    # Rows another purge is deleting are skipped, not waited for (PostgreSQL; SQLite writes
    # one at a time anyway): concurrent ingestion runs each purge their own.
    oldest = (
        select(inbox.c.inbox_id)
        .where(inbox.c.status == PROCESSED, inbox.c.received_at < received_before)
        .order_by(inbox.c.inbox_id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return connection.execute(
        delete(inbox).where(
            inbox.c.inbox_id.in_(oldest.scalar_subquery()), inbox.c.status == PROCESSED
        )
    ).rowcount


def count_processed(connection: Connection, *, received_before: datetime) -> int:
    return int(
        connection.execute(
            select(func.count()).where(
                inbox.c.status == PROCESSED, inbox.c.received_at < received_before
            )
        ).scalar()
    )
