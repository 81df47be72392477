"""Reads and writes of ``provider_circuits``: each sending process's circuit-breaker state.

The breaker lives in the sending process (``providers.circuit``); this table is how the
alerts sensor, ``status`` and the metrics see it from elsewhere. A run writes its row at each
transition and deletes its rows when it ends; a killed run's row is ignored once it is older
than the caller's ``stale_s`` and its run sends no heartbeat (``lane_workers``).
"""

import contextlib
import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from email_platform.common.timeutil import as_utc, utcnow
from email_platform.db.schema import lane_workers, provider_circuits
from email_platform.observability import logs

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
    """The circuit of ``provider`` in the process ``holder`` is now ``state``.

    One statement (an upsert), so two writers of one row never collide; ``opened_at`` keeps the
    first opening while the circuit stays open or probing, and is cleared when it closes.
    """
    opened_at = None if state == CLOSED else now
    row = {
        "provider": provider,
        "holder": holder,
        "lane": lane,
        "state": state,
        "changed_at": now,
        "opened_at": opened_at,
    }
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(provider_circuits).values(**row)
    kept_opening = (
        None if state == CLOSED else func.coalesce(provider_circuits.c.opened_at, opened_at)
    )
    connection.execute(
        statement.on_conflict_do_update(
            index_elements=[provider_circuits.c.provider, provider_circuits.c.holder],
            set_={"lane": lane, "state": state, "changed_at": now, "opened_at": kept_opening},
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
        CircuitView(
            r.provider, r.holder, r.lane, r.state, as_utc(r.changed_at), as_utc(r.opened_at)
        )
        for r in rows
    ]


class CircuitMirror:
    """Mirrors one process's breakers into ``provider_circuits`` as the run ``holder``.

    The breaker calls it (``on_circuit_change``) from a send thread with the provider's name
    and a way to read the breaker's state; the row is written from one background thread, so
    a send never waits for the database, and with the state read at write time, so the last
    write is the breaker's latest state whatever order the notifications came in. A write the
    database refuses is logged, never raised: the breaker works without its mirror.
    """

    def __init__(
        self, engine: Engine, *, holder: str, lane: str | None, log: logging.Logger | Any
    ) -> None:
        self.engine, self.holder, self.lane, self.log = engine, holder, lane, log
        self._writer = futures.ThreadPoolExecutor(1, thread_name_prefix="circuit-mirror")
        self._closed = False

    def __call__(self, provider: str, current_state: Callable[[], str]) -> None:
        if self._closed:
            return
        # Closed meanwhile (the run is ending): nothing left to mirror.
        with contextlib.suppress(RuntimeError):
            self._writer.submit(self._write, provider, current_state)

    def _write(self, provider: str, current_state: Callable[[], str]) -> None:
        state = current_state()
        try:
            with self.engine.begin() as connection:
                record(
                    connection,
                    provider=provider,
                    holder=self.holder,
                    lane=self.lane,
                    state=state,
                    now=utcnow(),
                )
        except Exception as exc:
            self.log.warning(
                f"circuit of provider {provider} is {state}, but the database did not take "
                f"it: {type(exc).__name__}",
                **logs.fields(provider=provider, run_id=self.holder, lane=self.lane),
            )

    def close(self, *, forget_rows: bool) -> None:
        """Write what is queued; with ``forget_rows`` (the run ends), delete this run's rows."""
        self._closed = True
        self._writer.shutdown(wait=True)
        if not forget_rows:
            return
        try:
            with self.engine.begin() as connection:
                forget(connection, self.holder)
        except Exception as exc:  # the row goes stale instead (``not_closed``)
            self.log.warning(f"could not clear this run's circuit rows: {type(exc).__name__}")


def delete_stale(connection: Connection, now: datetime, *, dry_run: bool = False) -> int:
    """Rows ``not_closed`` no longer counts (a killed run's, older than ``STALE_S`` and not a
    live worker's); ``dry_run`` counts them."""
    since = now - timedelta(seconds=STALE_S)
    live_worker = (
        select(lane_workers.c.run_id)
        .where(lane_workers.c.ended_at.is_(None), lane_workers.c.heartbeat_at >= since)
        .scalar_subquery()
    )
    stale = and_(
        provider_circuits.c.changed_at < since, provider_circuits.c.holder.not_in(live_worker)
    )
    if dry_run:
        return int(
            connection.execute(
                select(func.count()).select_from(provider_circuits).where(stale)
            ).scalar()
        )
    return connection.execute(delete(provider_circuits).where(stale)).rowcount


def by_provider(views: list[CircuitView]) -> dict[str, dict[str, int]]:
    """Per provider, how many processes hold its circuit in each state (open, half_open)."""
    counts: dict[str, dict[str, int]] = {}
    for view in views:
        states = counts.setdefault(view.provider, {})
        states[view.state] = states.get(view.state, 0) + 1
    return counts
