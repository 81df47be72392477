"""Reads and writes of ``provider_circuits``: each sending process's circuit-breaker state.

The breaker lives in the sending process (``providers.circuit``); this table is how the
alerts sensor, ``status`` and the metrics see it from elsewhere. A run writes its row at each
transition and deletes its rows when it ends; a killed run's row is ignored once it is older
than the caller's ``stale_s`` and its run sends no heartbeat (``lane_workers``).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, insert, or_, select, update

from email_platform import logs
from email_platform.db.schema import lane_workers, provider_circuits
from email_platform.timeutil import utcnow

CLOSED = "closed"
#: A circuit row of a process that is not a live lane worker counts this long after its last
#: change (a batch run's breaker lives minutes; a killed run never deletes its row).
STALE_S = 300.0


@dataclass(frozen=True)
class CircuitView:
    provider: str
    holder: str
    lane: str | None
    state: str
    changed_at: datetime
    opened_at: datetime | None


def record(
    connection: Connection,
    *,
    provider: str,
    holder: str,
    lane: str | None,
    state: str,
    now: datetime,
) -> None:
    """The circuit of ``provider`` in the process ``holder`` is now ``state``."""
    opened = {"opened_at": now} if state == "open" else {}
    if state == CLOSED:
        opened = {"opened_at": None}
    changed = connection.execute(
        update(provider_circuits)
        .where(provider_circuits.c.provider == provider, provider_circuits.c.holder == holder)
        .values(state=state, changed_at=now, lane=lane, **opened)
    ).rowcount
    if not changed:
        connection.execute(
            insert(provider_circuits).values(
                provider=provider,
                holder=holder,
                lane=lane,
                state=state,
                changed_at=now,
                opened_at=now if state == "open" else None,
            )
        )


def forget(connection: Connection, holder: str) -> int:
    """The process ``holder`` ended: its circuits no longer exist."""
    return connection.execute(
        delete(provider_circuits).where(provider_circuits.c.holder == holder)
    ).rowcount


def not_closed(
    connection: Connection, now: datetime, stale_s: float = STALE_S
) -> list[CircuitView]:
    """Circuits open or half-open in a process still alive: its row changed within
    ``stale_s``, or it is a lane worker that heart-beat within ``stale_s`` and has not ended."""
    since = now - timedelta(seconds=stale_s)
    live_worker = (
        select(lane_workers.c.run_id)
        .where(lane_workers.c.ended_at.is_(None), lane_workers.c.heartbeat_at >= since)
        .scalar_subquery()
    )
    rows = connection.execute(
        select(provider_circuits)
        .where(
            and_(
                provider_circuits.c.state != CLOSED,
                or_(
                    provider_circuits.c.changed_at >= since,
                    provider_circuits.c.holder.in_(live_worker),
                ),
            )
        )
        .order_by(provider_circuits.c.provider, provider_circuits.c.holder)
    ).all()
    return [
        CircuitView(r.provider, r.holder, r.lane, r.state, r.changed_at, r.opened_at) for r in rows
    ]


def listener(
    engine: Engine, *, holder: str, lane: str | None, log: logging.Logger | Any
) -> Callable[[str, str, str], None]:
    """A breaker's ``on_change`` that writes each transition as the process ``holder``'s row.

    Called from a send thread: a database that cannot take the row is logged, never raised
    (the breaker works without its mirror; only the alert and the metric miss it).
    """

    def changed(provider: str, old: str, new: str) -> None:
        try:
            with engine.begin() as connection:
                record(
                    connection, provider=provider, holder=holder, lane=lane, state=new, now=utcnow()
                )
        except Exception as exc:
            log.warning(
                f"circuit of provider {provider} is {new}, but the database did not take it: "
                f"{type(exc).__name__}",
                **logs.fields(provider=provider, run_id=holder, lane=lane),
            )

    return changed


def by_provider(views: list[CircuitView]) -> dict[str, dict[str, int]]:
    """Per provider, how many processes hold its circuit in each state (open, half_open)."""
    counts: dict[str, dict[str, int]] = {}
    for view in views:
        states = counts.setdefault(view.provider, {})
        states[view.state] = states.get(view.state, 0) + 1
    return counts
