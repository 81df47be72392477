"""Reads and writes of ``suppressions``: addresses that must not be mailed."""

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import Connection, insert, select, update

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
    """Suppress ``address``; returns False if it already was (the strongest reason stays)."""
    key = normalize(address)
    current = connection.execute(
        select(suppressions.c.reason).where(suppressions.c.address == key)
    ).scalar()
    if current is not None:
        if STRENGTH.get(reason, 0) > STRENGTH.get(current, 0):
            connection.execute(
                update(suppressions)
                .where(suppressions.c.address == key)
                .values(reason=reason, source=source, event_id=event_id)
            )
        return False
    connection.execute(
        insert(suppressions).values(
            address=key, reason=reason, source=source, event_id=event_id, created_at=now
        )
    )
    return True


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
