"""Reads and writes of ``suppressions``: addresses that must not be mailed."""

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.db.schema import suppressions

HARD_BOUNCE, COMPLAINT, UNSUBSCRIBE, MANUAL = "hard_bounce", "complaint", "unsubscribe", "manual"
# The strongest reason is kept, so the result does not depend on which event came first.
STRENGTH = {UNSUBSCRIBE: 1, HARD_BOUNCE: 2, COMPLAINT: 3, MANUAL: 4}


def normalize(address: str) -> str:
    return address.strip().lower()


def add(
    connection: Connection,
    address: str,
    *,
    reason: str,
    source: str,
    now: datetime,
    event_id: str | None = None,
) -> bool:
    """Suppress ``address``; returns False if it already was (the strongest reason stays).

    Safe under concurrent writers: the insert is the arbiter (a racing loser's unique
    violation is caught in a savepoint), and a reason replaces only a weaker one, in the
    UPDATE's own WHERE, which PostgreSQL re-checks on a row another transaction just changed.
    """
    key = normalize(address)
    current = connection.execute(
        select(suppressions.c.reason).where(suppressions.c.address == key)
    ).scalar()
    if current is None:
        try:
            with connection.begin_nested():
                connection.execute(
                    insert(suppressions).values(
                        address=key, reason=reason, source=source, event_id=event_id, created_at=now
                    )
                )
            return True
        except IntegrityError:
            pass  # inserted by another transaction since the read
    strength = STRENGTH.get(reason, 0)
    if strength > 0:
        as_strong = [name for name, value in STRENGTH.items() if value >= strength]
        connection.execute(
            update(suppressions)
            .where(suppressions.c.address == key, suppressions.c.reason.not_in(as_strong))
            .values(reason=reason, source=source, event_id=event_id)
        )
    return False


def reasons_for(connection: Connection, addresses: Iterable[str]) -> dict[str, str]:
    keys = sorted({normalize(a) for a in addresses})
    found: dict[str, str] = {}
    for start in range(0, len(keys), 500):
        rows = connection.execute(
            select(suppressions.c.address, suppressions.c.reason).where(
                suppressions.c.address.in_(keys[start : start + 500])
            )
        ).all()
        found.update({address: reason for address, reason in rows})
    return found
