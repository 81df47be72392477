"""Helpers for a product's own tests: which events a request published, and a route's mail.

``create_tables(engine)`` gives a test database the platform's tables (a product's tests on
SQLite; a deployment migrates with ``email-platform db upgrade``). ``recording_published(engine)``
records what a block of the product's code published, read back from ``email_outbox`` as the
worker would read it: an event whose transaction rolled back was never published, and is not
there. ``render(route, payload)`` renders a route's mail for a payload with the route table's
templates, exactly as the send path does, without sending anything::

    from email_platform.testing import create_tables, recording_published, render

    def test_signup_sends_a_welcome(engine, client):
        create_tables(engine)
        with recording_published(engine) as published:
            client.post("/signup", json={"email": "jo@example.com"})
        (event,) = published.events
        assert event.event_type == "user.signed_up"
        mail = render("welcome", event.payload)
        assert "Jo" in mail.subject

The core install suffices for ``create_tables`` and ``recording_published``; ``render`` needs
Jinja (``pip install 'email-platform[testing]'``, included in ``[dagster]``).
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, select

from email_platform.db.schema import email_outbox, metadata
from email_platform.mail.routes import Route, RouteTable, configured_routes

if TYPE_CHECKING:  # rendering imports Jinja, which the core install does not have
    from email_platform.mail.rendering import RenderedEmail

__all__ = [
    "PublishedEvent",
    "Recording",
    "create_tables",
    "published_events",
    "recording_published",
    "render",
]


@dataclass(frozen=True)
class PublishedEvent:
    """One event as ``email_outbox`` holds it (what the worker will route)."""

    event_id: str
    event_type: str
    event_version: int
    aggregate_id: str
    payload: dict[str, Any]
    metadata: dict[str, Any]
    lane: str
    published_at: datetime
    available_at: datetime
    expires_at: datetime | None
    idempotency_key: str | None
    trace_id: str | None
    correlation_id: str | None
    producer: str | None
    status: str


def create_tables(engine: Engine) -> None:
    """Create the platform's tables in a test database (from the schema the migrations keep in
    step with; a deployment runs ``email-platform db upgrade`` instead). Safe to call again."""
    metadata.create_all(engine)


def published_events(
    bind: Engine | Connection,
    *,
    event_type: str | None = None,
    aggregate_id: str | None = None,
) -> list[PublishedEvent]:
    """Every event in ``email_outbox``, oldest first, optionally of one type or aggregate.
    Events published at the same instant (one ``publish_many``) come in no particular order."""
    query = select(email_outbox).order_by(email_outbox.c.published_at, email_outbox.c.event_id)
    if event_type is not None:
        query = query.where(email_outbox.c.event_type == event_type)
    if aggregate_id is not None:
        query = query.where(email_outbox.c.aggregate_id == aggregate_id)
    if isinstance(bind, Engine):
        with bind.connect() as connection:
            rows = connection.execute(query).mappings().all()
    else:
        rows = bind.execute(query).mappings().all()
    return [_event(row) for row in rows]


@dataclass
class Recording:
    """The events published since the recording began; ``events`` reads them on each access,
    so it also sees what was committed after the ``with`` block ended."""

    bind: Engine | Connection
    before: frozenset[str] = field(default_factory=frozenset)

    @property
    def events(self) -> list[PublishedEvent]:
        return [e for e in published_events(self.bind) if e.event_id not in self.before]

    def of_type(self, event_type: str) -> list[PublishedEvent]:
        return [e for e in self.events if e.event_type == event_type]

    @property
    def event_types(self) -> list[str]:
        return [e.event_type for e in self.events]


@contextmanager
def recording_published(bind: Engine | Connection) -> Iterator[Recording]:
    """Record which events the block publishes (committed ones, in any process that writes to
    this database): ``with recording_published(engine) as published: ...``."""
    before = frozenset(e.event_id for e in published_events(bind))
    yield Recording(bind, before)


def render(
    route: str | Route,
    payload: Mapping[str, Any],
    *,
    routes: RouteTable | None = None,
    templates_dir: str | Path | None = None,
    event_version: int | None = None,
    locale: str | None = None,
) -> "RenderedEmail":
    """The mail ``route`` (a name in the table, or a ``Route``) sends for ``payload``: its
    ``subject``, ``text`` and ``html``, rendered as the send path renders, nothing sent.

    ``routes`` defaults to the configured table (``EMAIL_PLATFORM_ROUTES``), ``templates_dir`` to
    the table's own. With ``event_version``, the payload is first upcast from that version to the
    routed one, as the worker does. Raises ``TemplateRenderError`` as the send path would (a
    missing template or variable, a subject with a line break in it). The locale is the
    route's (its payload field or lookup) unless ``locale`` names one (``InvalidLocaleError``
    if it is not a tag); the result's ``locale`` says which templates rendered it.
    """
    from email_platform.mail import locales
    from email_platform.mail.rendering import TemplateRenderer

    table = configured_routes() if routes is None else routes
    chosen = table.route(route) if isinstance(route, str) else route
    data = dict(payload)
    if event_version is not None:
        _, data = table.upcast(chosen.event_type, event_version, data)
    directory = templates_dir or table.templates_dir
    if directory is None:
        raise ValueError("the route table names no templates_dir: pass templates_dir=...")
    asked = locales.check_locale("locale", locale) if locale else locales.requested(chosen, data)
    return TemplateRenderer(directory).render(chosen.template, chosen.template_version, data, asked)


def _event(row: Mapping[str, Any]) -> PublishedEvent:
    return PublishedEvent(
        event_id=row["event_id"],
        event_type=row["event_type"],
        event_version=row["event_version"],
        aggregate_id=row["aggregate_id"],
        payload=dict(row["payload"] or {}),
        metadata=dict(row["event_metadata"] or {}),
        lane=row["lane"],
        published_at=row["published_at"],
        available_at=row["available_at"],
        expires_at=row["expires_at"],
        idempotency_key=row["idempotency_key"],
        trace_id=row["trace_id"],
        correlation_id=row["correlation_id"],
        producer=row["producer"],
        status=row["status"],
    )
