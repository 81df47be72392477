"""The metrics' reads of ``email_outbox``, ``dead_letters`` and ``lane_workers``.

Kept apart from those tables' own modules only so that several changes can land at once; every
query here walks an index or a small table, because a scrape runs every few seconds.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Column, Connection, and_, case, func, select

from email_platform.db.schema import dead_letters, email_attempts, email_outbox, lane_workers

PENDING, IN_FLIGHT = "pending", "in_flight"
OPEN = "open"
#: A worker whose last heartbeat is older than this is not counted alive (the lane sensors use
#: the same 60 s before they call a worker dead); /metrics and ``status`` both read it.
WORKER_STALE_S = 60.0


@dataclass(frozen=True)
class LaneQueue:
    """One lane's outbox: due now (the backlog), waiting for a later ``send_after``, held."""

    due: int = 0
    oldest_due_at: datetime | None = None
    scheduled: int = 0
    in_flight: int = 0


def lane_queues(
    connection: Connection, lanes: Sequence[str], now: datetime
) -> dict[str, LaneQueue]:
    """Per lane, the pending and in-flight events split by whether they are due at ``now``.

    A pending event whose ``available_at`` (its ``send_after``) is still ahead is not backlog:
    nothing may send it yet. One range over the (lane, status, available_at) index.
    """
    pending = email_outbox.c.status == PENDING
    due = and_(pending, email_outbox.c.available_at <= now)
    rows = connection.execute(
        select(
            email_outbox.c.lane,
            func.sum(case((due, 1), else_=0)),
            func.min(case((due, email_outbox.c.available_at))),
            func.sum(case((and_(pending, email_outbox.c.available_at > now), 1), else_=0)),
            func.sum(case((email_outbox.c.status == IN_FLIGHT, 1), else_=0)),
        )
        .where(
            email_outbox.c.lane.in_(list(lanes)),
            email_outbox.c.status.in_([PENDING, IN_FLIGHT]),
        )
        .group_by(email_outbox.c.lane)
    ).all()
    return {
        lane: LaneQueue(int(n_due or 0), oldest, int(scheduled or 0), int(held or 0))
        for lane, n_due, oldest, scheduled, held in rows
    }


def settled_id(
    connection: Connection, id_column: Column, time_column: Column, before: datetime
) -> int:
    """The highest id of an append-only table up to which every row is older than ``before``.

    Counts up to that id can be kept and never read again: a row below it was written (and, for
    any transaction shorter than the margin, committed) before ``before``. One short range over
    the time column's index, or the primary key's maximum when nothing is that recent.
    """
    # ``+ 0``: PostgreSQL would otherwise answer min(id) by walking the primary key from the
    # oldest row, filtering on time, across the whole table.
    first_recent = connection.execute(
        select(func.min(id_column + 0)).where(time_column >= before)
    ).scalar()
    if first_recent is not None:
        return int(first_recent) - 1
    return int(connection.execute(select(func.max(id_column))).scalar() or 0)


def dead_letter_counts(
    connection: Connection, after_id: int, upto_id: int | None
) -> dict[tuple[str, str], int]:
    """Dead letters ever written with ``after_id < id <= upto_id``, by (lane, reason)."""
    query = select(dead_letters.c.lane, dead_letters.c.reason, func.count()).where(
        dead_letters.c.dead_letter_id > after_id
    )
    if upto_id is not None:
        query = query.where(dead_letters.c.dead_letter_id <= upto_id)
    rows = connection.execute(query.group_by(dead_letters.c.lane, dead_letters.c.reason)).all()
    return {(lane, reason): int(n) for lane, reason, n in rows}


def settled_dead_letter_id(connection: Connection, before: datetime) -> int:
    return settled_id(connection, dead_letters.c.dead_letter_id, dead_letters.c.created_at, before)


def open_dead_letters(connection: Connection) -> dict[tuple[str, str], int]:
    """Open dead letters by (lane, reason), over the status index (few rows stay open)."""
    rows = connection.execute(
        select(dead_letters.c.lane, dead_letters.c.reason, func.count())
        .where(dead_letters.c.status == OPEN)
        .group_by(dead_letters.c.lane, dead_letters.c.reason)
    ).all()
    return {(lane, reason): int(n) for lane, reason, n in rows}


def live_lane_workers(connection: Connection, beat_since: datetime) -> dict[str, int]:
    """Worker runs per lane not ended and with a heartbeat at or after ``beat_since``.

    ``lane_workers`` holds one row per worker run (a few per lane per hour), so this scan is
    small.
    """
    rows = connection.execute(
        select(lane_workers.c.lane, func.count())
        .where(lane_workers.c.ended_at.is_(None), lane_workers.c.heartbeat_at >= beat_since)
        .group_by(lane_workers.c.lane)
    ).all()
    return {lane: int(n) for lane, n in rows}


def settled_attempt_id(connection: Connection, before: datetime) -> int:
    return settled_id(connection, email_attempts.c.attempt_id, email_attempts.c.finished_at, before)
