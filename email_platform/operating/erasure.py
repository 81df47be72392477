"""Erasure (GDPR Art. 17): one person's personal data out of every table the platform keeps.

``erase()`` finds the person's rows (by address, by aggregate id, or both), then in one
transaction cancels what was not sent yet, anonymizes every row analytics counts (the row, its
status and timestamps stay; the address, payload and free texts go), blanks the raw webhook
bodies, and keeps their suppression only as a keyed hash (``store.suppressions``), adding one if
there was none, so an erased person is never mailed again. With a ``warehouse_path`` whose file
exists it then rebuilds the DuckDB warehouse from scratch. Running it again erases nothing more
and succeeds.

What is found:

- events whose payload or metadata holds the address anywhere (any case, also percent-encoded
  in a URL), events of the aggregate id, and the events of every message to the address;
- the messages of those events and every message to the address, their attempts and dead
  letters, the provider events to the address or about those messages or events;
- stored webhook bodies that hold the address, or that produced one of those provider events.

With an aggregate id, the addresses its events were mailed to (their messages' recipients and
the routes' recipient fields) are erased as well.
"""

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Row

from email_platform.common.timeutil import utcnow
from email_platform.mail.routes import RouteTable, configured_routes
from email_platform.observability.redaction import mentions, scrub
from email_platform.publishing.validation import check_address
from email_platform.store import (
    attempts,
    dead_letters,
    email_events,
    inbox,
    messages,
    outbox,
    suppressions,
)

#: What an anonymized payload, metadata and webhook body become.
ERASED_JSON: dict[str, Any] = {"erased": True}
ERASED_BODY = '{"erased": true}'
#: The aggregate id of an erased event (it is the product's id of the person).
ERASED_AGGREGATE = "erased"
TABLES = (
    "email_outbox",
    "email_messages",
    "email_attempts",
    "dead_letters",
    "webhook_inbox",
    "email_events",
    "suppressions",
)
#: What erasure keeps, and why: printed by ``email-platform erase`` and stated in README.
KEPT = (
    "every event, message, attempt, dead letter and provider event row, with its type, "
    "status, timestamps, template, lane, provider and recipient domain: the analytics "
    "counts and rates stay right",
    "event, message, provider and run ids, which name no one once those rows are anonymized",
    "the suppression, as HMAC-SHA256 of the address under the platform's privacy key (reason "
    "'erased'): the address cannot be read back, yet mail to it stays suppressed",
)


@dataclass
class ErasureReport:
    """What one ``erase()`` changed: rows per table, and what it cancelled."""

    tables: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    #: Events and messages that were not sent yet, now ``cancelled``.
    cancelled_events: int = 0
    cancelled_messages: int = 0
    #: Of the cancelled events, those a run held in flight (fenced off before any send).
    cancelled_in_flight: int = 0
    #: Plain suppressions replaced by their hash, and hashed ones added for the unsuppressed.
    suppressions_hashed: int = 0
    suppressions_added: int = 0
    #: Distinct addresses erased (an aggregate id can stand for several).
    addresses: int = 0
    #: What became of the rows' old versions on disk (see ``_flush_old_versions``).
    storage: str = ""
    #: "rebuilt" (from scratch, just now), "no warehouse file", or "not asked".
    warehouse: str = "not asked"
    warehouse_path: str | None = None

    @property
    def total(self) -> int:
        return sum(self.tables.values())

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total, "kept": list(KEPT)}


@dataclass
class _Found:
    addresses: set[str]
    event_ids: set[str] = field(default_factory=set)
    message_ids: set[int] = field(default_factory=set)
    provider_events: list[Row] = field(default_factory=list)
    webhooks: list[Row] = field(default_factory=list)


def erase(
    engine: Engine,
    *,
    email: str | None = None,
    aggregate_id: str | None = None,
    now: datetime | None = None,
    warehouse_path: str | None = None,
    routes: RouteTable | None = None,
) -> ErasureReport:
    """Erase the person with address ``email`` and/or aggregate id ``aggregate_id``.

    Raises ``ValueError`` (an ``InvalidAddressError`` for a malformed address) before touching
    anything. ``routes`` name the recipient fields an aggregate's events carry (default: the
    configured table, ``EMAIL_PLATFORM_ROUTES``).
    """
    if not email and not aggregate_id:
        raise ValueError("say whom to erase: an email address, an aggregate id, or both")
    addresses = {suppressions.normalize(check_address("email", email))} if email else set()
    now = now or utcnow()
    report = ErasureReport()
    with engine.begin() as connection:
        if connection.dialect.name == "sqlite":
            # Freed and overwritten bytes are zeroed, not left in the file's free space.
            connection.exec_driver_sql("PRAGMA secure_delete = ON")
        found = _find(connection, addresses, aggregate_id, routes or configured_routes())
        _erase_found(connection, found, report, now)
    report.storage = _flush_old_versions(engine)
    if warehouse_path is not None:
        rebuild_warehouse(engine, warehouse_path, report)
    return report


# ---- finding the person's rows ---------------------------------------------------------------


def _find(
    connection: Connection, addresses: set[str], aggregate_id: str | None, routes: RouteTable
) -> _Found:
    found = _Found(set(addresses))
    if aggregate_id:
        found.event_ids.update(outbox.ids_for_aggregate(connection, aggregate_id))
        for event in outbox.for_ids(connection, sorted(found.event_ids)):
            for name in routes.recipient_fields_for(event.event_type):
                value = (event.payload or {}).get(name)
                if isinstance(value, str) and "@" in value:
                    found.addresses.add(suppressions.normalize(value))
        for message in messages.for_events(connection, sorted(found.event_ids)):
            if message.recipient:
                found.addresses.add(suppressions.normalize(message.recipient))
    for event in outbox.mentioning(connection, _prefilter_terms(found.addresses)):
        if any(
            _holds(v, a) for v in (event.payload, event.event_metadata) for a in found.addresses
        ):
            found.event_ids.add(event.event_id)
    for message in messages.to_addresses(connection, sorted(found.addresses)):
        found.message_ids.add(message.message_id)
        found.event_ids.add(message.event_id)
    found.provider_events = _provider_events(connection, found)
    linked = {row.inbox_id for row in found.provider_events if row.inbox_id is not None}
    webhooks = {row.inbox_id: row for row in inbox.for_ids(connection, sorted(linked))}
    for row in inbox.mentioning(connection, _prefilter_terms(found.addresses)):
        if any(mentions(row.body, address) for address in found.addresses):
            webhooks[row.inbox_id] = row
    found.webhooks = [webhooks[key] for key in sorted(webhooks)]
    return found


def _provider_events(connection: Connection, found: _Found) -> list[Row]:
    """The provider events, with the messages of every event found so far; a provider event to
    the address names its message and event too (a late webhook of an erased message)."""
    found.message_ids.update(
        m.message_id for m in messages.for_events(connection, sorted(found.event_ids))
    )
    rows = email_events.for_erasure(
        connection, sorted(found.addresses), sorted(found.message_ids), sorted(found.event_ids)
    )
    found.message_ids.update(row.message_id for row in rows if row.message_id is not None)
    found.event_ids.update(row.event_id for row in rows if row.event_id is not None)
    return rows


def _prefilter_terms(addresses: Iterable[str]) -> list[str]:
    # The local part without its +tag: plain ASCII in any stored JSON (a domain may be
    # \u-escaped), and also inside a percent-encoded address.
    return sorted({a.rpartition("@")[0].split("+", 1)[0] or a for a in addresses})


def _holds(value: Any, address: str) -> bool:
    """Whether a JSON value holds ``address`` in any string, key or value, at any depth."""
    if isinstance(value, str):
        return mentions(value, address)
    if isinstance(value, dict):
        return any(_holds(k, address) or _holds(v, address) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds(item, address) for item in value)
    return False


# ---- erasing them ----------------------------------------------------------------------------


def _erase_found(
    connection: Connection, found: _Found, report: ErasureReport, now: datetime
) -> None:
    addresses = sorted(found.addresses)
    report.addresses = len(addresses)
    event_ids, message_ids = sorted(found.event_ids), sorted(found.message_ids)
    report.cancelled_events, report.cancelled_in_flight = outbox.cancel(connection, event_ids, now)
    report.cancelled_messages = messages.cancel_pending(connection, message_ids, now)
    tables = report.tables
    for event in outbox.for_ids(connection, event_ids):
        if changes := _event_changes(event):
            outbox.anonymize(connection, event.event_id, changes)
            tables["email_outbox"] += 1
    for message in messages.for_ids(connection, message_ids):
        if changes := _message_changes(message, addresses):
            messages.anonymize(connection, message.message_id, changes)
            tables["email_messages"] += 1
    for attempt in attempts.for_erasure(connection, message_ids, event_ids):
        error = scrub(attempt.error, addresses)
        if error != attempt.error:
            attempts.set_error(connection, attempt.attempt_id, error)
            tables["email_attempts"] += 1
    for letter in dead_letters.for_erasure(connection, message_ids, event_ids):
        if changes := _letter_changes(letter, addresses, now):
            dead_letters.anonymize(connection, letter.dead_letter_id, changes)
            tables["dead_letters"] += 1
    for row in found.provider_events:
        if changes := _provider_event_changes(row, addresses):
            email_events.anonymize(connection, row.email_event_id, changes)
            tables["email_events"] += 1
    for row in found.webhooks:
        if changes := _webhook_changes(row, addresses, now):
            inbox.anonymize(connection, row.inbox_id, changes)
            tables["webhook_inbox"] += 1
    for address in addresses:
        hashed, added = suppressions.erase(connection, address, now)
        report.suppressions_hashed += hashed
        report.suppressions_added += added
    tables["suppressions"] = report.suppressions_hashed + report.suppressions_added


def _changed(row: Row, wanted: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in wanted.items() if getattr(row, name) != value}


def _event_changes(event: Row) -> dict[str, Any]:
    return _changed(
        event,
        {
            "payload": ERASED_JSON,
            "event_metadata": ERASED_JSON,
            "aggregate_id": ERASED_AGGREGATE,
            # A caller's key may be built from the person's data; ids are kept.
            "idempotency_key": None,
            "trace_context": None,
        },
    )


def _message_changes(message: Row, addresses: list[str]) -> dict[str, Any]:
    key = message.idempotency_key
    if not key.startswith(f"{message.event_id}:"):
        # Built from the caller's idempotency key: replaced, still unique per event x route.
        key = f"{message.event_id}:{message.route}:erased"
    return _changed(
        message,
        {
            "recipient": None,
            "last_error": scrub(message.last_error, addresses),
            # Made from the payload; the erased person's dedupe is moot (mail to them is
            # suppressed), and a NULL never collides.
            "dedupe_key": None,
            "idempotency_key": key,
        },
    )


def _letter_changes(letter: Row, addresses: list[str], now: datetime) -> dict[str, Any]:
    wanted: dict[str, Any] = {"last_error": scrub(letter.last_error, addresses)}
    if letter.status == dead_letters.OPEN:
        # Nobody is to replay mail to an erased person: closed as an operator's discard is.
        wanted.update(status=dead_letters.DISCARDED, resolved_at=now)
    return _changed(letter, wanted)


def _provider_event_changes(row: Row, addresses: list[str]) -> dict[str, Any]:
    return _changed(
        row,
        {
            "recipient": None,
            "click_url": None,
            "user_agent": None,
            "raw": None,
            "reject_reason": scrub(row.reject_reason, addresses),
        },
    )


def _webhook_changes(row: Row, addresses: list[str], now: datetime) -> dict[str, Any]:
    wanted: dict[str, Any] = {"body": ERASED_BODY, "error": scrub(row.error, addresses)}
    if row.status in (inbox.PENDING, inbox.IN_FLIGHT):
        # Not normalized yet: nothing is left to normalize, and the person is suppressed anyway.
        wanted.update(
            status=inbox.PROCESSED,
            error="erased before it was normalized",
            processed_at=now,
            lease_expires_at=None,
        )
    return _changed(row, wanted)


def _flush_old_versions(engine: Engine) -> str:
    """Where the old versions of the erased rows are left, said plainly.

    SQLite keeps the pages written before in its write-ahead log until a checkpoint: one is
    forced, which can only finish once no reader holds an older snapshot. PostgreSQL keeps old
    row versions in the table files until VACUUM reuses their space, and both keep whatever
    the deployment's backups and WAL archives hold until those expire.
    """
    if engine.dialect.name != "sqlite":
        return (
            "PostgreSQL keeps the old row versions on disk until VACUUM reuses their space; "
            "backups and WAL archives keep them until they expire"
        )
    raw = engine.raw_connection()
    try:
        busy, _, _ = raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        raw.close()
    if busy:
        return "SQLite: a reader held the write-ahead log; the old pages go at its next checkpoint"
    return "SQLite: old pages checkpointed out of the write-ahead log, freed space zeroed"


def rebuild_warehouse(engine: Engine, warehouse_path: str, report: ErasureReport) -> None:
    """Rebuild the DuckDB warehouse from scratch if its file exists (``report`` says which).

    It holds copies (provider events' click URLs and reject reasons, statuses) that an
    incremental refresh would not reload. The snapshot an analyst still has open keeps its old
    contents until they close it; no new reader sees them.
    """
    report.warehouse_path = warehouse_path
    if not Path(warehouse_path).exists():
        report.warehouse = "no warehouse file"
        return
    from email_platform.warehouse import refresh  # DuckDB: only when there is a warehouse

    refresh(engine, warehouse_path, full=True)
    report.warehouse = "rebuilt"
