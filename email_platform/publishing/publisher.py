"""``publish()``: the one call product code makes, inside its own transaction."""

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from email_platform.common.errors import (
    InvalidPayloadError,
    NotInTransactionError,
    PublishError,
    UnknownEventVersionError,
)
from email_platform.common.ids import new_ulid
from email_platform.common.lanes import Lane
from email_platform.common.timeutil import utcnow
from email_platform.mail import addressing, locales
from email_platform.mail.routes import RouteTable, configured_routes
from email_platform.observability import tracing
from email_platform.publishing import guards, schemas, validation
from email_platform.store import outbox


def _routes(routes: object) -> RouteTable:
    if routes is None:
        # EMAIL_PLATFORM_ROUTES, the table the worker reads too; unset, a ConfigurationError.
        return configured_routes()
    if not isinstance(routes, RouteTable):
        raise TypeError(f"routes must be a RouteTable, got {type(routes).__name__}")
    return routes


def publish(
    connection: Connection | Session,
    *,
    event_type: str,
    aggregate_id: str,
    payload: Mapping[str, Any],
    event_version: int | None = None,
    occurred_at: datetime | None = None,
    send_after: datetime | None = None,
    expires_at: datetime | None = None,
    idempotency_key: str | None = None,
    priority: str | Lane | None = None,
    metadata: Mapping[str, Any] | None = None,
    routes: RouteTable | None = None,
    trace_id: str | None = None,
    correlation_id: str | None = None,
    producer: str | None = None,
) -> str:
    """Write one event to the outbox in the caller's open transaction and return its id.

    Raises a ``PublishError`` (a ``ValueError`` naming the field) for anything the caller can fix,
    among them ``RateLimitedError`` and ``EventRefusedError`` from the event's routes (see
    ``guards``). Never commits, never opens a transaction of its own, never touches the network:
    if the caller's transaction rolls back, the event never existed. An ``idempotency_key``
    names one event: publishing it again writes nothing and returns the first event's id.
    """
    routes = _routes(routes)
    now = utcnow()
    row = _event_row(
        routes,
        now,
        event_type=event_type,
        aggregate_id=aggregate_id,
        payload=payload,
        event_version=event_version,
        occurred_at=occurred_at,
        send_after=send_after,
        expires_at=expires_at,
        idempotency_key=idempotency_key,
        priority=priority,
        metadata=metadata,
        trace_id=trace_id,
        correlation_id=correlation_id,
        producer=producer,
    )
    bound = _bound_connection(connection)
    first = guards.published_before(bound, [row])
    if row["idempotency_key"] in first:
        return first[row["idempotency_key"]]
    guards.check(bound, routes, [row], now, lambda _index, name: name)
    outbox.insert_event(bound, row)
    return row["event_id"]


def publish_many(
    connection: Connection | Session,
    events: Iterable[Mapping[str, Any]],
    *,
    routes: RouteTable | None = None,
) -> list[str]:
    """``publish()`` for many events at once (a campaign's fan-out), with one multi-row insert.

    Each item holds ``publish()``'s keyword arguments (``event_type``, ``aggregate_id``,
    ``payload``, ...). The same rules as ``publish()``: the caller's open transaction, no commit,
    no network. All or nothing: every event is checked before any is written, and a
    ``PublishError`` names the first bad one as ``events[i].<field>``. Returns the event ids in
    order. Measured on PostgreSQL, 1,000 events per transaction: 0.12-0.14 ms of CPU per event
    against 0.76-0.92 ms with ``publish()`` in a loop (one statement per event).
    """
    bound = _bound_connection(connection)
    routes = _routes(routes)
    now = utcnow()
    rows: list[dict[str, Any]] = []
    if isinstance(events, str | bytes | Mapping) or not isinstance(events, Iterable):
        raise PublishError("events", "must be a list of mappings of publish() arguments")
    for index, fields in enumerate(events):
        if not isinstance(fields, Mapping):
            raise PublishError(f"events[{index}]", "must be a mapping of publish() arguments")
        try:
            rows.append(_event_row(routes, now, **fields))
        except PublishError as error:
            raise error.with_field(f"events[{index}].{error.field}") from None
        except TypeError as error:  # a missing or unknown argument, as publish() would raise
            raise PublishError(f"events[{index}]", str(error)) from None
    # One event per idempotency key: a key already published (or repeated in this batch)
    # gives the first event's id and writes nothing.
    first = guards.published_before(bound, rows)
    fresh: list[dict[str, Any]] = []
    positions: list[int] = []
    event_ids: list[str] = []
    for index, row in enumerate(rows):
        key = row["idempotency_key"]
        if key and key in first:
            event_ids.append(first[key])
            continue
        if key:
            first[key] = row["event_id"]
        fresh.append(row)
        positions.append(index)
        event_ids.append(row["event_id"])
    guards.check(
        bound, routes, fresh, now, lambda index, name: f"events[{positions[index]}].{name}"
    )
    # Every event is checked before any is written: one statement, all or nothing.
    outbox.insert_events(bound, fresh)
    return event_ids


def _event_row(
    routes: RouteTable,
    now: datetime,
    *,
    event_type: str,
    aggregate_id: str,
    payload: Mapping[str, Any],
    event_version: int | None = None,
    occurred_at: datetime | None = None,
    send_after: datetime | None = None,
    expires_at: datetime | None = None,
    idempotency_key: str | None = None,
    priority: str | Lane | None = None,
    metadata: Mapping[str, Any] | None = None,
    trace_id: str | None = None,
    correlation_id: str | None = None,
    producer: str | None = None,
) -> dict[str, Any]:
    """The checked outbox row of one event; raises ``PublishError`` for what the caller must fix."""
    started_ns = tracing.now_ns()
    event_type = validation.check_event_type(event_type)
    aggregate_id = validation.check_aggregate_id(aggregate_id)
    clean_payload = validation.check_payload(payload)
    clean_metadata = validation.check_metadata(metadata)
    lane_override = validation.check_priority(priority)
    occurred_at = validation.check_aware("occurred_at", occurred_at)
    send_after = validation.check_aware("send_after", send_after)
    expires_at = validation.check_aware("expires_at", expires_at)
    idempotency_key = validation.check_idempotency_key(idempotency_key)
    trace_id = validation.check_trace_id(trace_id)
    correlation_id = validation.check_correlation_id(correlation_id)
    producer = validation.check_producer(producer)
    if event_version is None:
        event_version = routes.default_version(event_type)
    event_version = validation.check_event_version(event_version)

    _check_routed_fields(
        routes, event_type, event_version, clean_payload, idempotency_key or "x" * 26
    )
    # After the routes' own checks, whose errors are the more precise (an address, a header),
    # the declared contract: what else the schema of this version requires.
    schemas.check_payload(routes, event_type, event_version, clean_payload)

    available_at = send_after or now
    if expires_at is not None and expires_at <= available_at:
        raise PublishError("expires_at", "must be later than send_after (or now)")
    event_id = new_ulid()
    lane = (lane_override or routes.lane_for(event_type) or Lane.TRANSACTIONAL).value
    # The caller's span, if one is current: the email's spans continue its trace. A trace id
    # the caller gave wins over the span's (it may name the request in another tracer).
    trace_context, span_trace_id = tracing.publish_context(
        started_ns,
        {
            "email.event_id": event_id,
            "email.event_type": event_type,
            "email.lane": lane,
            "email.correlation_id": correlation_id,
            "email.producer": producer,
        },
    )
    return {
        "event_id": event_id,
        "event_type": event_type,
        "event_version": event_version,
        "aggregate_id": aggregate_id,
        "occurred_at": occurred_at or now,
        "published_at": now,
        "payload": clean_payload,
        "event_metadata": clean_metadata,
        "lane": lane,
        "available_at": available_at,
        "expires_at": expires_at,
        "idempotency_key": idempotency_key,
        "status": outbox.PENDING,
        "trace_id": trace_id or span_trace_id,
        "correlation_id": correlation_id,
        "producer": producer,
        "trace_context": trace_context,
    }


def _check_routed_fields(
    routes: RouteTable, event_type: str, version: int, payload: dict[str, Any], base_key: str
) -> None:
    """What the event's routes will read at send time, checked now on the upcast payload."""
    published_version = version
    try:
        version, payload = routes.upcast(event_type, version, dict(payload))
    except UnknownEventVersionError:
        return  # dead-lettered as unknown_event_version at send time, as documented
    except Exception as exc:  # an upcaster that cannot read this payload would fail later
        raise InvalidPayloadError(
            "payload", f"cannot be upcast to the routed version of {event_type}: {exc}"
        ) from None
    event_routes = routes.for_event(event_type, version)
    for field in sorted({f for r in event_routes for f in r.header_fields}):
        validation.check_no_line_breaks(f"payload.{field}", payload.get(field))
    for route in event_routes:
        if route.recipient_field:
            field = route.recipient_field
            if field not in payload:
                raise InvalidPayloadError(f"payload.{field}", f"is required by {event_type} routes")
            validation.check_address(f"payload.{field}", payload[field])
        lookup = route.recipient_lookup_field
        if lookup and not payload.get(lookup):
            raise InvalidPayloadError(
                f"payload.{lookup}", f"is required by route {route.name} to look the recipient up"
            )
        if route.locale_field:
            locales.check_locale(f"payload.{route.locale_field}", payload.get(route.locale_field))
        validation.check_message_key("idempotency_key", base_key, route.name)
        if route.provider_template is not None:
            route.provider_template.check_payload(route.name, payload)
        addressing.check_payload(route, payload)
        if route.dedupe_key:
            try:
                key = route.dedupe_key_for(payload)
            except KeyError as exc:
                raise InvalidPayloadError(
                    f"payload.{exc.args[0]}",
                    f"is required by route {route.name} (dedupe key {route.dedupe_key!r})",
                ) from None
            except Exception as exc:  # a format the payload's values cannot fill
                raise InvalidPayloadError(
                    "payload", f"route {route.name} dedupes on {route.dedupe_key!r}: {exc}"
                ) from None
            if key is not None:
                validation.check_dedupe_key("payload", key)
    if version != published_version:  # the upcasters' output must match the routed schema
        schemas.check_payload(
            routes, event_type, version, payload, after=f"upcast from v{published_version}"
        )


def _bound_connection(connection: Connection | Session) -> Connection:
    if isinstance(connection, Session):
        # The session's own transaction (begun implicitly if need be) is the caller's.
        return connection.connection()
    if not isinstance(connection, Connection):
        raise TypeError("publish() takes a SQLAlchemy Connection or Session")
    if not connection.in_transaction():
        raise NotInTransactionError(
            "publish() must be called inside the caller's transaction "
            "(e.g. `with engine.begin() as connection:`), next to the business write"
        )
    return connection
