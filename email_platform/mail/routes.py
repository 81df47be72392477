"""Routes: which mail an event causes, and upcasters for older event versions.

Plain data and pure functions; the send op looks events up here, ``publish()`` reads the lane.
One setting names the route table for the producer and the worker alike:
``EMAIL_PLATFORM_ROUTES="package.module:NAME"`` (a ``RouteTable``, or a function returning one),
read by ``configured_routes()``. Unset, it is a ``ConfigurationError``: the demo's routes are
chosen explicitly, as ``DEMO_ROUTES``, never by default.
"""

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, time, timedelta
from functools import cache
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from email_platform.common import config
from email_platform.common.errors import ConfigurationError, UnknownEventVersionError
from email_platform.common.lanes import Lane
from email_platform.mail import addressing
from email_platform.mail.addressing import AttachmentLimits, AttachmentMaker, Mailbox
from email_platform.mail.locales import LocaleLookup
from email_platform.mail.provider_templates import ProviderTemplate
from email_platform.mail.receipt_pdf import receipt_attachments

#: The setting that names the route table (``config.ROUTES_SETTING``).
ROUTES_SETTING = config.ROUTES_SETTING
#: The demo's route table, for the demo, the local stack, the bench and tests to name.
DEMO_ROUTES = "email_platform.mail.routes:demo_routes"
#: The demo's templates, shipped in the package (the demo table names them).
DEMO_TEMPLATES = Path(__file__).parents[1] / "templates"

Payload = dict[str, Any]


@dataclass(frozen=True)
class RateLimit:
    """At most ``max_events`` events per ``aggregate_id`` (an account, say) in ``per_s``."""

    max_events: int
    per_s: int

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.per_s < 1:
            raise ValueError("a rate limit needs max_events >= 1 and per_s >= 1")


@dataclass(frozen=True)
class QuietHours:
    """A daily window in which a route's mail waits, in the recipient's time zone.

    ``start`` to ``end`` local time (``time(21)`` to ``time(8)`` wraps midnight). The zone is the
    payload's ``timezone_field`` when it names a known IANA zone, else ``default_timezone``.
    Critical mail ignores quiet hours.
    """

    start: time
    end: time
    default_timezone: str = "UTC"
    timezone_field: str | None = "timezone"

    def __post_init__(self) -> None:
        if self.start == self.end:
            raise ValueError("quiet hours need a start different from their end")
        try:
            ZoneInfo(self.default_timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"quiet hours: unknown time zone {self.default_timezone!r}") from exc

    def zone_for(self, payload: Mapping[str, Any]) -> ZoneInfo:
        """The recipient's zone; anything a producer sent that is not a zone means the default."""
        value = payload.get(self.timezone_field) if self.timezone_field else None
        if isinstance(value, str) and 0 < len(value) <= 64 and value.isprintable():
            try:
                return ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError, OSError):
                pass
        return ZoneInfo(self.default_timezone)

    def resume_at(self, now: datetime, payload: Mapping[str, Any]) -> datetime | None:
        """When mail due at ``now`` (UTC) may go: None outside the window, else its end."""
        zone = self.zone_for(payload)
        local = now.astimezone(zone)
        clock = local.time().replace(tzinfo=None)
        wraps = self.start > self.end
        inside = (
            (clock >= self.start or clock < self.end) if wraps else (self.start <= clock < self.end)
        )
        if not inside:
            return None
        day = local.date() + timedelta(days=1) if wraps and clock >= self.start else local.date()
        resume = datetime.combine(day, self.end, tzinfo=zone).astimezone(UTC)
        # A window end in a daylight-saving gap can land before now: never wait backwards.
        return max(resume, now + timedelta(seconds=1))


@dataclass(frozen=True)
class EventDraft:
    """What an authorization hook is given: the event as the producer published it."""

    event_type: str
    event_version: int
    aggregate_id: str
    payload: Mapping[str, Any]
    metadata: Mapping[str, Any]
    producer: str | None


#: Return None or True to let the event through; False or a reason (str) refuses it.
Authorizer = Callable[[EventDraft], bool | str | None]


@dataclass(frozen=True)
class Route:
    """One mail an event causes."""

    name: str
    event_type: str
    event_version: int
    template: str
    lane: Lane
    #: Time to live from publish; the message becomes ``expired`` instead of sending later.
    ttl_s: int | None = None
    #: Payload field that holds the recipient address ...
    recipient_field: str | None = "email"
    #: ... or payload field whose value the recipient resolver looks up at send time.
    recipient_lookup_field: str | None = None
    #: Payload fields that end up in headers (subject, display name): CR/LF is refused on publish.
    header_fields: tuple[str, ...] = ()
    #: Application-level dedupe: a ``str.format`` pattern over the payload, e.g.
    #: ``"welcome:{user_id}"``. A second message with the same key is ``duplicate``.
    dedupe_key: str | None = None
    #: Pin a template version; ``None`` renders the newest.
    template_version: int | None = None
    #: An unsubscribe stops bulk mail only (``honours_unsubscribe``); a bulk route that must
    #: still reach those who unsubscribed (a legal notice) sets this. A hard-bounced,
    #: complained, manually suppressed or erased address is never mailed by any route.
    bypass_unsubscribe: bool = False
    #: Checked by ``publish()`` in the caller's transaction, against the outbox.
    rate_limit: RateLimit | None = None
    #: Called by ``publish()`` with the event; may refuse it (``EventRefusedError``).
    authorize: Authorizer | None = None
    #: Mail due inside this daily window waits until it ends (not on the critical lane).
    quiet_hours: QuietHours | None = None
    #: Payload field holding the recipient's locale (``pt-BR``), checked at ``publish()`` ...
    locale_field: str | None = None
    #: ... or ``payload -> locale`` asked at send time (docs/locales.md).
    locale_lookup: LocaleLookup | None = None
    #: A template kept at the provider, rendered there (docs/provider-templates.md); ``template``
    #: then names a local one to fall back on where the provider has none (SMTP), or is "".
    provider_template: ProviderTemplate | None = None
    #: ``From``; None: ``EMAIL_PLATFORM_SENDER`` (docs/addressing.md, ``mail/addressing.py``).
    sender: Mailbox | None = None
    reply_to: tuple[Mailbox, ...] = ()
    cc: tuple[Mailbox, ...] = ()
    #: Recipients in no header (SMTP: ``RCPT TO`` only).
    bcc: tuple[Mailbox, ...] = ()
    #: The bounce address (SMTP ``MAIL FROM``), apart from ``From``; only SMTP carries it.
    envelope_sender: str | None = None
    #: Called at send time with the payload; returns the message's ``Attachment``s.
    attachments: AttachmentMaker | None = None
    attachment_limits: AttachmentLimits = field(default_factory=AttachmentLimits)

    def __post_init__(self) -> None:
        # Checked once, when the route is made, not on every publish.
        addressing.check_route(self)
        if self.provider_template is not None:
            name = self.provider_template.template_name(
                self.name, self.template, self.template_version
            )
            object.__setattr__(self, "template", name)

    @property
    def honours_unsubscribe(self) -> bool:
        """Whether an unsubscribed address is suppressed for this route: bulk mail (what the
        List-Unsubscribe link offers to stop), unless the route bypasses it. Transactional and
        critical mail (a receipt, a password reset) still reach the address."""
        return self.lane is Lane.BULK and not self.bypass_unsubscribe

    def dedupe_key_for(self, payload: Mapping[str, Any]) -> str | None:
        if self.dedupe_key is None:
            return None
        return f"{self.name}:{self.dedupe_key.format_map(payload)}"


Upcaster = Callable[[Payload], Payload]
#: A JSON Schema (draft 7) as plain data: what a payload of one event type and version holds.
EventSchema = Mapping[str, Any]


@dataclass
class RouteTable:
    """Routes by ``(event_type, event_version)`` plus upcasters from older versions."""

    routes: list[Route] = field(default_factory=list)
    #: ``(event_type, from_version) -> function`` that returns the payload of ``from_version + 1``.
    upcasters: dict[tuple[str, int], Upcaster] = field(default_factory=dict)
    #: The folder of ``<template>/v<n>/`` templates the routes name; the worker's
    #: ``RoutingResource(templates_dir=...)`` overrides it. Neither set is a configuration error.
    templates_dir: str | Path | None = None
    #: ``(event_type, version) -> JSON Schema`` of the payload. A table that declares any is
    #: strict: ``publish()`` refuses an event whose type and version has none (docs/schemas.md).
    schemas: dict[tuple[str, int], EventSchema] = field(default_factory=dict)
    #: ``publishing.schemas``'s compiled validators, filled on first use (not compared).
    _compiled: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # The compiled validators are functions made at run time: rebuilt on use, not pickled.
        return {**self.__dict__, "_compiled": {}}

    @property
    def declares_schemas(self) -> bool:
        return bool(self.schemas)

    def schema_for(self, event_type: str, version: int) -> EventSchema | None:
        return self.schemas.get((event_type, version))

    def schema_versions(self, event_type: str) -> tuple[int, ...]:
        return tuple(sorted(v for t, v in self.schemas if t == event_type))

    def default_version(self, event_type: str) -> int:
        """The version ``publish()`` stamps when the producer names none: the routed one, else
        the newest declared schema's, else 1."""
        versions = self.schema_versions(event_type)
        return self.current_version(event_type) or (versions[-1] if versions else 1)

    def route(self, name: str) -> Route:
        """The route called ``name`` (``KeyError`` naming the known ones if there is none)."""
        for candidate in self.routes:
            if candidate.name == name:
                return candidate
        raise KeyError(f"no route {name!r}; the table has {sorted(r.name for r in self.routes)}")

    def current_version(self, event_type: str) -> int | None:
        versions = [r.event_version for r in self.routes if r.event_type == event_type]
        return max(versions) if versions else None

    def knows(self, event_type: str) -> bool:
        return self.current_version(event_type) is not None

    def upcast(self, event_type: str, version: int, payload: Payload) -> tuple[int, Payload]:
        """Bring an event to the routed version, or raise ``UnknownEventVersionError``."""
        current = self.current_version(event_type)
        if current is None:
            return version, payload
        while version < current:
            step = self.upcasters.get((event_type, version))
            if step is None:
                raise UnknownEventVersionError(
                    f"{event_type} v{version} has no upcaster to v{version + 1}",
                    code="unknown_event_version",
                )
            payload, version = step(dict(payload)), version + 1
        if version != current:
            raise UnknownEventVersionError(
                f"{event_type} v{version} is newer than the routed v{current}",
                code="unknown_event_version",
            )
        return version, payload

    def for_event(self, event_type: str, version: int) -> list[Route]:
        return [r for r in self.routes if r.event_type == event_type and r.event_version == version]

    def lane_for(self, event_type: str) -> Lane | None:
        lanes = [r.lane for r in self.routes if r.event_type == event_type]
        # An event that causes several mails travels in its most urgent lane.
        order = [Lane.CRITICAL, Lane.TRANSACTIONAL, Lane.BULK]
        return min(lanes, key=order.index) if lanes else None

    def header_fields_for(self, event_type: str) -> set[str]:
        fields: set[str] = set()
        for r in self.routes:
            if r.event_type == event_type:
                fields.update(r.header_fields)
                if r.recipient_field:
                    fields.add(r.recipient_field)
        return fields

    def recipient_fields_for(self, event_type: str) -> set[str]:
        return {
            r.recipient_field
            for r in self.routes
            if r.event_type == event_type and r.recipient_field
        }


def _signed_up_v1_to_v2(payload: Payload) -> Payload:
    # v1 carried one "name"; v2 splits out the first name the welcome mail greets with.
    words = str(payload.pop("name", "") or "").split()
    payload.setdefault("first_name", words[0] if words else "there")
    return payload


#: publish() checks an address as mail systems do (email-validator); the schema says its type.
_ADDRESS: EventSchema = {"type": "string"}
_NAME: EventSchema = {"type": "string", "maxLength": 200}
_ID: EventSchema = {"type": "string", "minLength": 1, "maxLength": 200}
#: publish() checks the tag itself (mail.locales); null or absent means the default language.
_LOCALE: EventSchema = {"type": ["string", "null"], "maxLength": 35}


def _object(required: list[str], properties: dict[str, Any], example: Payload) -> EventSchema:
    # Other fields are allowed: producers add fields before the templates read them.
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "required": required,
        "properties": properties,
        "examples": [example],
    }


#: The demo's event schemas, one per type and version (docs/schemas.md).
DEMO_SCHEMAS: dict[tuple[str, int], EventSchema] = {
    ("user.signed_up", 1): _object(
        ["user_id", "email"],
        {"user_id": _ID, "email": _ADDRESS, "name": _NAME},
        {"user_id": "u1", "email": "ada@example.com", "name": "Ada Lovelace"},
    ),
    ("user.signed_up", 2): _object(
        ["user_id", "email"],
        {"user_id": _ID, "email": _ADDRESS, "first_name": _NAME, "locale": _LOCALE},
        {"user_id": "u1", "email": "ada@example.com", "first_name": "Ada", "locale": "pt-BR"},
    ),
    ("user.password_reset_requested", 1): _object(
        ["user_id", "reset_token"],
        {"user_id": _ID, "reset_token": _ID},
        {"user_id": "u1", "reset_token": "tok-1"},
    ),
    ("order.paid", 1): _object(
        ["email", "order_id"],
        {
            "email": _ADDRESS,
            "order_id": {"type": ["string", "integer"]},
            "first_name": _NAME,
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "quantity", "unit_price"],
                    "properties": {
                        "name": _NAME,
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number", "minimum": 0},
                    },
                },
            },
            "total": {"type": "number", "minimum": 0},
            "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        {
            "order_id": "O-00001",
            "email": "ada@example.com",
            "first_name": "Ada",
            "items": [{"name": "Mug", "quantity": 2, "unit_price": 9.5}],
            "total": 19.0,
            "currency": "EUR",
        },
    ),
    ("digest.ready", 1): _object(
        ["email"],
        {
            "email": _ADDRESS,
            "first_name": _NAME,
            "highlights": {"type": "array", "items": {"type": "string"}},
        },
        {"email": "ada@example.com", "first_name": "Ada", "highlights": ["3 new followers"]},
    ),
    ("order.shipped", 1): _object(
        ["email", "order_id", "first_name", "carrier", "tracking_url"],
        {
            "email": _ADDRESS,
            "order_id": {"type": ["string", "integer"]},
            "first_name": _NAME,
            "carrier": _NAME,
            "tracking_url": {"type": "string", "maxLength": 2000},
        },
        {
            "order_id": "O-00001",
            "email": "ada@example.com",
            "first_name": "Ada",
            "carrier": "DHL",
            "tracking_url": "https://track.example.com/O-00001",
        },
    ),
    # Declared but routed nowhere: accepted, and ignored by the worker.
    ("cart.viewed", 1): _object([], {"cart_id": _ID}, {"cart_id": "c1"}),
}


def demo_routes() -> RouteTable:
    """The demo's routes and templates (``DEMO_ROUTES``): what the demo, the local stack, the
    bench and the tests choose; a deployment names its own table."""
    return RouteTable(
        routes=[
            Route(
                name="welcome",
                event_type="user.signed_up",
                event_version=2,
                template="welcome",
                lane=Lane.TRANSACTIONAL,
                ttl_s=3 * 24 * 3600,
                header_fields=("first_name",),
                dedupe_key="{user_id}",
                # Portuguese for pt-BR and pt (email_platform/templates/welcome/v1/pt*/).
                locale_field="locale",
            ),
            Route(
                name="password_reset",
                event_type="user.password_reset_requested",
                event_version=1,
                template="password_reset",
                lane=Lane.CRITICAL,
                ttl_s=15 * 60,
                recipient_field=None,
                recipient_lookup_field="user_id",
                bypass_unsubscribe=True,
            ),
            Route(
                name="receipt",
                event_type="order.paid",
                event_version=1,
                template="receipt",
                lane=Lane.TRANSACTIONAL,
                ttl_s=7 * 24 * 3600,
                # The subject reads order_id.
                header_fields=("first_name", "order_id"),
                sender=Mailbox(address="billing@example.com", name="Shop billing"),
                reply_to=(Mailbox(address="support@example.com", name="Shop support"),),
                attachments=receipt_attachments,
            ),
            Route(
                name="weekly_digest",
                event_type="digest.ready",
                event_version=1,
                template="weekly_digest",
                lane=Lane.BULK,
                ttl_s=2 * 24 * 3600,
                header_fields=("first_name",),
            ),
            # On a template kept at the provider (the sandbox renders it: sandbox/templates.py).
            Route(
                name="shipping_notice",
                event_type="order.shipped",
                event_version=1,
                template="shipping_notice",  # the local fallback, for SMTP
                lane=Lane.TRANSACTIONAL,
                ttl_s=3 * 24 * 3600,
                header_fields=("first_name", "order_id"),  # its subject reads them
                provider_template=ProviderTemplate(
                    "shipping-notice",
                    variables=("first_name", "order_id", "carrier", "tracking_url"),
                ),
            ),
        ],
        upcasters={("user.signed_up", 1): _signed_up_v1_to_v2},
        templates_dir=DEMO_TEMPLATES,
        schemas=dict(DEMO_SCHEMAS),
    )


#: The former name of ``demo_routes``, kept for code that imports it; nothing falls back to it.
default_routes = demo_routes


def load_routes(spec: str) -> RouteTable:
    """The table ``spec`` names: ``"package.module:NAME"``, a ``RouteTable`` or a function
    returning one. Loaded once per process and spec (a table is read on every publish)."""
    return _load_routes(spec.strip())


@cache
def _load_routes(spec: str) -> RouteTable:
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigurationError(
            f"{ROUTES_SETTING}={spec!r}: expected 'package.module:NAME' (a RouteTable or a "
            "function returning one)"
        )
    try:
        value = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"{ROUTES_SETTING}={spec!r}: {exc}") from None
    table = value() if callable(value) and not isinstance(value, RouteTable) else value
    if not isinstance(table, RouteTable):
        raise ConfigurationError(
            f"{ROUTES_SETTING}={spec!r} is a {type(table).__name__}, not a RouteTable"
        )
    return table


def configured_routes() -> RouteTable:
    """The route table ``EMAIL_PLATFORM_ROUTES`` names; a ``ConfigurationError`` naming the
    setting when it is unset (production never falls back to the demo's routes)."""
    spec = config.routes_spec()
    if spec is None:
        raise ConfigurationError(
            f"no route table: set {ROUTES_SETTING}='package.module:NAME' (a RouteTable or a "
            f"function returning one), read by publish() and the worker alike, or pass "
            f"routes=...; the demo's table is {ROUTES_SETTING}={DEMO_ROUTES}"
        )
    return load_routes(spec)
