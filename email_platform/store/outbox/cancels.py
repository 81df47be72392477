"""A producer's ``cancel()`` on ``email_outbox``: only an event no run holds and none sent yet
(pending, or dead and waiting for a replay) is cancelled, by one conditional update, so the
cancel and the claim (``claims.claim``, a replay's included) exclude each other: whichever
writes the row first wins and the other finds it no longer pending or dead."""

from datetime import datetime

from sqlalchemy import Connection, Row, select, update

from email_platform.db.schema import email_outbox as outbox
from email_platform.store.outbox.states import CANCELLED, DEAD, PENDING

#: The resolution of an event a producer cancelled (erasure's is ``erased``).
CANCELLED_BY_PRODUCER = "cancelled"


def cancel_if_unsent(connection: Connection, event_id: str, now: datetime) -> bool:
    """Cancel ``event_id`` if it is pending or dead (no replay may send it then); whether it was.

    One statement: on PostgreSQL a claim holding the row lock makes it wait and re-check the
    status when the claim commits (then it is in flight, and this cancels nothing); a cancel
    that locked the row first is skipped by the claim's SKIP LOCKED and, once committed, is
    no longer pending for any later claim. SQLite serializes the two writers.
    """
    return bool(
        connection.execute(
            update(outbox)
            .where(outbox.c.event_id == event_id, outbox.c.status.in_((PENDING, DEAD)))
            .values(
                status=CANCELLED,
                resolution=CANCELLED_BY_PRODUCER,
                done_at=now,
                claimed_by=None,
                lease_expires_at=None,
                requested_at=None,
            )
        ).rowcount
    )


def state_of(connection: Connection, event_id: str) -> Row | None:
    """The event's status, resolution and holder (None: no such event)."""
    return connection.execute(
        select(outbox.c.event_id, outbox.c.status, outbox.c.resolution, outbox.c.claimed_by).where(
            outbox.c.event_id == event_id
        )
    ).first()
