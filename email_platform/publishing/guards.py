"""What ``publish()`` checks against the outbox, in the caller's transaction: one event per
idempotency key, each route's rate limit and its authorization hook.

The checks run where the producer can still act on the answer (show "too many resets, try in
12 minutes"), and they hold across processes: each key is locked for the rest of the caller's
transaction (``db.locks``), so two publishers of the same key or the same rate-limited account
queue, and the second sees what the first committed.
"""

from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from email_platform.common.errors import EventRefusedError, RateLimitedError
from email_platform.common.timeutil import as_utc
from email_platform.db.locks import lock_for_transaction
from email_platform.mail.routes import EventDraft, Route, RouteTable
from email_platform.store import outbox

#: Names the field of an error: ``name`` for publish(), ``events[i].name`` for publish_many().
FieldName = Callable[[int, str], str]


def published_before(connection: Connection, rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The first event of each of ``rows``' idempotency keys that is already in the outbox.

    The rule: an idempotency key names one event. Publishing it again (a retried request)
    writes nothing and returns the first event's id. The keys stay locked until the caller's
    transaction ends, so a concurrent publisher of the same key waits and then finds it.
    """
    keys = sorted({row["idempotency_key"] for row in rows if row["idempotency_key"]})
    for key in keys:
        lock_for_transaction(connection, f"email_outbox.idempotency_key:{key}")
    return outbox.first_events_with_keys(connection, keys)


def check(
    connection: Connection,
    routes: RouteTable,
    rows: Sequence[dict[str, Any]],
    now: datetime,
    field: FieldName,
) -> None:
    """Raise ``EventRefusedError`` or ``RateLimitedError`` for the first row a route refuses."""
    routed = [_routes_of(routes, row["event_type"]) for row in rows]
    for index, (row, event_routes) in enumerate(zip(rows, routed, strict=True)):
        for route in event_routes:
            if route.authorize is not None:
                _authorize(route, row, field(index, "event"))
    limited = sorted(
        {
            (route.name, row["aggregate_id"])
            for row, event_routes in zip(rows, routed, strict=True)
            for route in event_routes
            if route.rate_limit is not None
        }
    )
    if not limited:
        return
    # Sorted, so two publishers of overlapping batches take the locks in the same order.
    for name, aggregate_id in limited:
        lock_for_transaction(connection, f"rate_limit:{name}:{aggregate_id}")
    in_batch: Counter[tuple[str, str]] = Counter()
    windows: dict[tuple[str, str], tuple[int, datetime | None]] = {}
    for index, (row, event_routes) in enumerate(zip(rows, routed, strict=True)):
        for route in event_routes:
            limit = route.rate_limit
            if limit is None:
                continue
            key = (route.name, row["aggregate_id"])
            if key not in windows:
                since = now - timedelta(seconds=limit.per_s)
                event_types = sorted({r.event_type for r in routes.routes if r.name == route.name})
                windows[key] = outbox.recent_publications(
                    connection, event_types, row["aggregate_id"], since
                )
            published, oldest = windows[key]
            if published + in_batch[key] >= limit.max_events:
                retry_at = (as_utc(oldest) if oldest else now) + timedelta(seconds=limit.per_s)
                wait_s = max(1.0, (retry_at - now).total_seconds())
                raise RateLimitedError(
                    field(index, "aggregate_id"),
                    f"route {route.name} allows {limit.max_events} event(s) per {limit.per_s}s "
                    f"for one aggregate_id; this one has reached it: retry in {wait_s:.0f}s",
                    route=route.name,
                    retry_after_s=wait_s,
                )
            in_batch[key] += 1


def _routes_of(routes: RouteTable, event_type: str) -> list[Route]:
    seen: dict[str, Route] = {}
    for route in routes.routes:
        if route.event_type == event_type:
            seen.setdefault(route.name, route)
    return list(seen.values())


def _authorize(route: Route, row: dict[str, Any], field: str) -> None:
    assert route.authorize is not None
    draft = EventDraft(
        event_type=row["event_type"],
        event_version=row["event_version"],
        aggregate_id=row["aggregate_id"],
        payload=row["payload"],
        metadata=row["event_metadata"],
        producer=row.get("producer"),
    )
    verdict = route.authorize(draft)
    if verdict is None or verdict is True:
        return
    reason = verdict if isinstance(verdict, str) and verdict else "no reason given"
    raise EventRefusedError(
        field, f"refused by route {route.name}'s authorization hook: {reason}", route=route.name
    )
