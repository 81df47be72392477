"""What operators ask of the system: status, trace (of an event or of a request), and
dead-letter list / replay / discard.

Plain functions over the repositories; the CLI formats what they return.
"""

from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Row

from email_platform.common.lanes import LANES
from email_platform.common.timeutil import as_utc, isoformat, utcnow
from email_platform.store import (
    attempts,
    circuits,
    dead_letters,
    email_events,
    lane_pauses,
    messages,
    metrics_queries,
    outbox,
)

#: The percentiles of ``status``'s publish-to-accepted latency.
LATENCY_PERCENTILES = (50, 95, 99)


def status(
    engine: Engine, now: datetime | None = None, *, latency_minutes: int = 15
) -> dict[str, Any]:
    """The ``email-platform status --json`` object (docs/operating.md, docs/metrics.md).

    A lane's ``depth`` and ``oldest_age_s`` are its due work only, as ``/metrics`` counts it
    (one query, ``metrics_queries.lane_queues``): an event whose ``send_after`` is ahead is
    ``scheduled``, not backlog.
    """
    now = now or utcnow()
    since = now - timedelta(minutes=latency_minutes)
    lane_names = [lane.value for lane in LANES]
    with engine.connect() as connection:
        events = outbox.counts_by_status(connection)
        message_counts = messages.counts_by_status(connection)
        queues = metrics_queries.lane_queues(connection, lane_names, now)
        workers = metrics_queries.live_lane_workers(
            connection, now - timedelta(seconds=metrics_queries.WORKER_STALE_S)
        )
        by_reason = dead_letters.open_by_reason(connection)
        latency = messages.accepted_latency_percentiles(connection, since, LATENCY_PERCENTILES)
        not_closed = circuits.not_closed(connection, now)
        pauses = lane_pauses.all_rows(connection)
    lanes: dict[str, dict[str, Any]] = {}
    for lane in lane_names:
        queue = queues.get(lane, metrics_queries.LaneQueue())
        oldest = as_utc(queue.oldest_due_at)
        pause = pauses.get(lane)
        lanes[lane] = {
            "depth": queue.due,
            # Seconds the oldest due event has waited since it became due (its send_after, or
            # its publish): what a slow lane makes a reader wait.
            "oldest_age_s": round(max(0.0, (now - oldest).total_seconds()), 3) if oldest else None,
            "scheduled": queue.scheduled,
            "in_flight": queue.in_flight,
            # Lane-worker runs not ended whose heartbeat is recent: 0 with workers: 0 (batch
            # runs) or when nothing runs them.
            "workers_alive": workers.get(lane, 0),
            # Who paused the lane (an operator, or ``brake:...``), why and since when; null
            # while it is not paused. A sensor stopped in the UI shows in ``lanes status``.
            "paused": None
            if pause is None or pause.resumed_at is not None
            else {
                "by": pause.paused_by,
                "reason": pause.reason,
                "since": isoformat(pause.paused_at),
            },
        }
    return {
        "events": events,
        "messages": message_counts,
        "lanes": lanes,
        "dead_letters": {"open": sum(by_reason.values()), "by_reason": by_reason},
        "latency": _latency_report(latency, latency_minutes),
        # Providers whose circuit breaker turns a sending process away: processes per state.
        "circuits": circuits.by_provider(not_closed),
    }


def _latency_report(found: dict[str, tuple[int, dict[int, float]]], minutes: int) -> dict[str, Any]:
    """Per lane: messages accepted in the window and their publish-to-accepted percentiles in
    seconds (None without any)."""
    lanes: dict[str, dict[str, Any]] = {}
    known = [lane.value for lane in LANES]
    for lane in [*known, *sorted(set(found) - set(known))]:
        accepted, values = found.get(lane, (0, {}))
        lanes[lane] = {"accepted": accepted} | {
            f"p{p}_s": round(values[p], 3) if p in values else None for p in LATENCY_PERCENTILES
        }
    return {"window_minutes": minutes, "lanes": lanes}


def _row(row: Row | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {k: (isoformat(v) if isinstance(v, datetime) else v) for k, v in row._mapping.items()}


def trace(
    engine: Engine, event_id: str, *, warehouse_path: str | None = None
) -> dict[str, Any] | None:
    """The whole chain of one event, or None if no such event exists.

    With a ``warehouse_path`` whose file exists, the event's funnel rows come along (as of the
    warehouse's last refresh).
    """
    with engine.connect() as connection:
        event = outbox.get_event(connection, event_id)
        if event is None:
            return None
        event_attempts = attempts.for_event(connection, event_id)
        chain = []
        for message in messages.for_events(connection, [event_id]):
            chain.append(
                {
                    **_row(message),
                    "attempts": [
                        _row(a) for a in event_attempts if a.message_id == message.message_id
                    ],
                }
            )
        letters = dead_letters.for_event(connection, event_id)
        provider_events = email_events.for_event(connection, event_id)
    return {
        "event": _row(event),
        "messages": chain,
        "provider_events": [
            {k: v for k, v in _row(e).items() if k != "raw"} for e in provider_events
        ],
        "dead_letters": [_row(d) for d in letters],
        "funnel": _funnel(warehouse_path, event_id),
    }


#: What ``trace_request`` shows of each event and message (``trace EVENT_ID`` shows all).
_REQUEST_EVENT_FIELDS = (
    "event_id",
    "event_type",
    "event_version",
    "lane",
    "status",
    "resolution",
    "published_at",
    "done_at",
    "trace_id",
    "correlation_id",
    "producer",
)
_REQUEST_MESSAGE_FIELDS = (
    "message_id",
    "route",
    "template",
    "status",
    "delivery_status",
    "provider",
    "provider_message_id",
    "sent_at",
    "locale",
    "is_test",
)


def trace_request(
    engine: Engine,
    *,
    trace_id: str | None = None,
    correlation_id: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """The events one request published (by its trace id, its correlation id, or both), in
    publish order, each with its messages; at most ``limit`` events."""
    with engine.connect() as connection:
        events = outbox.events_by_trace(
            connection, trace_id=trace_id, correlation_id=correlation_id, limit=limit
        )
        by_event: dict[str, list[dict[str, Any]]] = {e.event_id: [] for e in events}
        for message in messages.for_events(connection, list(by_event)):
            by_event[message.event_id].append(_fields(message, _REQUEST_MESSAGE_FIELDS))
    return [
        {**_fields(event, _REQUEST_EVENT_FIELDS), "messages": by_event[event.event_id]}
        for event in events
    ]


def _fields(row: Row, names: Sequence[str]) -> dict[str, Any]:
    values = _row(row) or {}
    return {name: values.get(name) for name in names}


def select_dead_letters(
    connection: Connection,
    *,
    ids: Sequence[int] = (),
    reason: str | None = None,
    lane: str | None = None,
    event_id: str | None = None,
    everything: bool = False,
) -> list[Row]:
    if ids:
        return [d for d in dead_letters.for_ids(connection, ids) if d.status == dead_letters.OPEN]
    if not (reason or lane or event_id or everything):
        raise ValueError("say which dead letters: ids, --reason, --lane, --event or --all")
    return dead_letters.list_letters(connection, reason=reason, lane=lane, event_id=event_id)


def requeue_dead_letters(engine: Engine, letters: Sequence[Row]) -> list[str]:
    """Put the events of ``letters`` back in the outbox with their messages reopened.

    The lane sensor requests them again; the send path reuses each message's idempotency key,
    sends nothing already accepted, turns anything past ``expires_at`` into ``expired`` and
    closes the dead letter when its message is finally sent.
    """
    event_ids = sorted({d.event_id for d in letters})
    message_ids = sorted({d.message_id for d in letters if d.message_id is not None})
    with engine.begin() as connection:
        messages.reopen(connection, message_ids, utcnow())
        outbox.requeue(connection, event_ids)
    return event_ids


def discard_dead_letters(engine: Engine, ids: Sequence[int]) -> int:
    with engine.begin() as connection:
        return dead_letters.discard(connection, ids, utcnow())


def _funnel(warehouse_path: str | None, event_id: str) -> list[dict[str, Any]] | None:
    if not warehouse_path or not Path(warehouse_path).exists():
        return None
    from email_platform.warehouse import funnel_row

    return [
        {k: (isoformat(v) if isinstance(v, datetime) else v) for k, v in row.items()}
        for row in funnel_row(warehouse_path, event_id)
    ]
