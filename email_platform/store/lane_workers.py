"""Reads and writes of ``lane_workers``: a worker run's heartbeat and how it ended."""

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Connection, Row, insert, select, update

from email_platform.db.schema import lane_workers


def beat(connection: Connection, run_id: str, lane: str, now: datetime) -> None:
    """Record that the worker ``run_id`` is alive (its first beat creates the row)."""
    updated = connection.execute(
        update(lane_workers).where(lane_workers.c.run_id == run_id).values(heartbeat_at=now)
    ).rowcount
    if not updated:
        connection.execute(
            insert(lane_workers).values(run_id=run_id, lane=lane, started_at=now, heartbeat_at=now)
        )


def end(connection: Connection, run_id: str, reason: str, now: datetime) -> None:
    connection.execute(
        update(lane_workers)
        .where(lane_workers.c.run_id == run_id)
        .values(ended_at=now, end_reason=reason[:200])
    )


def heartbeats(connection: Connection, run_ids: Sequence[str]) -> dict[str, Row]:
    """Each of ``run_ids`` that has beaten at least once: its last heartbeat and its end."""
    if not run_ids:
        return {}
    rows = connection.execute(
        select(lane_workers.c.run_id, lane_workers.c.heartbeat_at, lane_workers.c.ended_at).where(
            lane_workers.c.run_id.in_(list(run_ids))
        )
    ).all()
    return {row.run_id: row for row in rows}
