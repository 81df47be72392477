"""The operational tables the warehouse loads, and a digest of their change markers.

``SOURCES`` names, for each table, its raw table in the warehouse, its key, the columns kept
(addresses, payloads, error texts and raw bodies are left behind) and the change markers an
incremental load reads it by (see ``load``). ``DELETIONS`` is the table of provider event rows
deleted at the source, loaded like a source. ``operational_fingerprint`` digests the same
markers for the refresh sensor: it moves exactly when a refresh would load something.
"""

import hashlib
from dataclasses import dataclass

from sqlalchemy import Engine, Table, func, select

from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_event_deletions,
    email_events,
    email_messages,
    email_outbox,
)


@dataclass(frozen=True)
class Source:
    """One operational table as the warehouse loads it."""

    table: Table
    raw_table: str
    key: tuple[str, ...]
    # (column, DuckDB type). Addresses, payloads, error texts and raw bodies are left behind.
    columns: tuple[tuple[str, str], ...]
    # Columns whose greatest value is the row's change marker.
    markers: tuple[str, ...]
    # The column naming whose funnel row a version feeds: a replaced version's owner is
    # rebuilt too (see _mark_affected).
    owner: tuple[str, ...] = ("message_id",)
    # Columns a full load stores as NULL where they equal their message's (the same column of
    # raw_email_messages): the event id, a 26-character string, was a fifth of the file. The
    # stg_* views put the message's value back; incremental loads store them as they come.
    as_message: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.table.name

    def marker_sql(self) -> str:
        """The change marker over the raw table's columns, as DuckDB SQL (column names only)."""
        if len(self.markers) == 1:
            return self.markers[0]
        return "greatest(" + ", ".join(self.markers) + ")"


TS = "TIMESTAMP"
SOURCES: tuple[Source, ...] = (
    Source(
        email_outbox,
        "raw_email_outbox",
        ("event_id",),
        (
            ("event_id", "VARCHAR"),
            ("event_type", "VARCHAR"),
            ("event_version", "INTEGER"),
            ("lane", "VARCHAR"),
            ("occurred_at", TS),
            ("published_at", TS),
            ("status", "VARCHAR"),
            ("resolution", "VARCHAR"),
            ("done_at", TS),
            # Added later: last, so a raw table of an older warehouse file gets them appended
            # (see state.ensure_schema) in the order the load writes them.
            ("trace_id", "VARCHAR"),
            ("correlation_id", "VARCHAR"),
            ("producer", "VARCHAR"),
        ),
        ("published_at", "done_at"),
        ("event_id",),
    ),
    Source(
        email_messages,
        "raw_email_messages",
        ("message_id",),
        (
            ("message_id", "BIGINT"),
            ("event_id", "VARCHAR"),
            ("route", "VARCHAR"),
            ("template", "VARCHAR"),
            ("template_version", "INTEGER"),
            ("lane", "VARCHAR"),
            ("recipient_domain", "VARCHAR"),
            ("status", "VARCHAR"),
            ("attempts", "INTEGER"),
            ("provider", "VARCHAR"),
            ("provider_message_id", "VARCHAR"),
            ("created_at", TS),
            ("updated_at", TS),
            ("sent_at", TS),
            ("delivery_status", "VARCHAR"),
            ("delivery_updated_at", TS),
            # Added later (migration 0012), last like the outbox's: the locale that rendered
            # it and whether it was a test send (left out by the stg_* views).
            ("locale", "VARCHAR"),
            ("is_test", "BOOLEAN"),
        ),
        ("updated_at", "delivery_updated_at"),
    ),
    Source(
        email_attempts,
        "raw_email_attempts",
        ("attempt_id",),
        (
            ("attempt_id", "BIGINT"),
            ("message_id", "BIGINT"),
            ("event_id", "VARCHAR"),
            ("run_id", "VARCHAR"),
            ("attempt_no", "INTEGER"),
            ("started_at", TS),
            ("finished_at", TS),
            ("outcome", "VARCHAR"),
            ("http_status", "INTEGER"),
        ),
        ("finished_at",),
        as_message=("event_id",),
    ),
    Source(
        dead_letters,
        "raw_dead_letters",
        ("dead_letter_id",),
        (
            ("dead_letter_id", "BIGINT"),
            ("event_id", "VARCHAR"),
            ("message_id", "BIGINT"),
            ("lane", "VARCHAR"),
            ("reason", "VARCHAR"),
            ("error_code", "VARCHAR"),
            ("attempts", "INTEGER"),
            ("run_id", "VARCHAR"),
            ("status", "VARCHAR"),
            ("created_at", TS),
            ("resolved_at", TS),
        ),
        ("created_at", "resolved_at"),
    ),
    Source(
        email_events,
        "raw_email_events",
        # The source's id: a cheap key to probe (recent ids sit in the last row groups, so
        # zone maps skip the rest; the natural key (provider, provider_event_id) is two strings
        # to compare against every loaded row). A re-normalized webhook comes back with a new
        # id; its old row is removed by its deletion record (see DELETIONS).
        ("email_event_id",),
        (
            ("provider", "VARCHAR"),
            ("provider_event_id", "VARCHAR"),
            ("email_event_id", "BIGINT"),
            ("event_type", "VARCHAR"),
            ("occurred_at", TS),
            ("received_at", TS),
            ("event_id", "VARCHAR"),
            ("message_id", "BIGINT"),
            ("provider_message_id", "VARCHAR"),
            ("recipient_domain", "VARCHAR"),
            ("reject_reason", "VARCHAR"),
            ("bounce_type", "VARCHAR"),
            ("click_url", "VARCHAR"),
            ("machine_open", "BOOLEAN"),
        ),
        ("received_at",),
        as_message=("event_id",),
    ),
)
SOURCES_BY_NAME = {source.name: source for source in SOURCES}
# Rows deleted from email_events, recorded by a trigger: each names the deleted version (id and
# received_at), which a refresh removes from raw_email_events. Loaded like a source (change
# marker deleted_at, same look-back); re-reading a record removes nothing twice.
DELETIONS = email_event_deletions.name


def operational_fingerprint(engine: Engine) -> str:
    """A cheap digest of the operational tables' change markers: it moves when a refresh would
    load something (a send, an attempt, a webhook, a dead letter resolved), else stays put.

    Appended tables use their primary key (an index lookup); the others their markers. One
    statement of nine indexed max() subqueries: the sensor asks every 10 s.
    """
    parts = [
        select(func.max(email_outbox.c.published_at)),
        select(func.max(email_outbox.c.done_at)),
        select(func.max(email_messages.c.updated_at)),
        select(func.max(email_messages.c.delivery_updated_at)),
        select(func.max(email_attempts.c.attempt_id)),
        select(func.max(dead_letters.c.dead_letter_id)),
        select(func.max(dead_letters.c.resolved_at)),
        select(func.max(email_events.c.email_event_id)),
        select(func.max(email_event_deletions.c.deletion_id)),
    ]
    with engine.connect() as connection:
        values = connection.execute(select(*(part.scalar_subquery() for part in parts))).one()
    return hashlib.sha256(repr([str(v) for v in values]).encode()).hexdigest()[:16]
