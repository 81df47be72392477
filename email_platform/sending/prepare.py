"""Preparing claimed events: route, dedupe, recipient, expiry, suppression, render.

What comes out is the list of messages to hand to the provider, each with its idempotency key
already committed. Everything decided here without a provider call (ignored, duplicate,
expired, suppressed, a template or recipient failure) is recorded on the spot.
"""

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, Row

from email_platform.common.errors import (
    InvalidRecipientError,
    PermanentError,
    PublishError,
    RecipientNotFoundError,
    TemplateRenderError,
    UnknownEventVersionError,
)
from email_platform.common.lanes import Lane, LaneConfig
from email_platform.common.text import text_problem
from email_platform.common.timeutil import as_utc, utcnow
from email_platform.db.schema import email_messages
from email_platform.mail import addressing, locales, provider_templates, unsubscribe
from email_platform.mail.recipients import RecipientResolver
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import Route, RouteTable
from email_platform.observability import tracing
from email_platform.providers.base import OutgoingEmail
from email_platform.publishing.validation import check_address
from email_platform.sending.attach import Wanted, attach_files
from email_platform.sending.record import Recorder
from email_platform.sending.types import MAX_CLAIMS, BatchOutcome, Work
from email_platform.store import dead_letters, email_events, messages, outbox, suppressions

_HARD_SUPPRESSIONS = {
    suppressions.HARD_BOUNCE,
    suppressions.COMPLAINT,
    suppressions.MANUAL,
    suppressions.ERASED,  # an erased person is never mailed again, security mail included
}
#: Message columns filled from what a producer sent (the rest come from routes and code).
_CHECKED_COLUMNS = ("idempotency_key", "dedupe_key", "recipient", "recipient_domain")


class Preparer:
    """Turns one run's claimed events into messages to send, for one lane and provider."""

    def __init__(
        self,
        *,
        engine: Engine,
        routes: RouteTable,
        renderer: TemplateRenderer,
        resolver: RecipientResolver,
        lane: LaneConfig,
        provider_name: str,
        sender_address: str,
        recorder: Recorder,
        unsubscribe_links: unsubscribe.Links | None = None,
    ) -> None:
        self.engine = engine
        self.routes = routes
        self.renderer = renderer
        self.resolver = resolver
        self.lane = lane
        self.provider_name = provider_name
        self.sender_address = sender_address
        self.recorder = recorder
        #: Whether the provider renders provider templates (``BatchSender`` sets it; if not, a
        #: route on one renders its local fallback template).
        self.provider_templates = True
        # Bulk mail's List-Unsubscribe headers, from the environment unless given. A bad
        # setting fails a bulk run here, before it claims anything.
        self.unsubscribe_links = unsubscribe_links or unsubscribe.links_from_config(
            sender_address, strict=lane.lane is Lane.BULK
        )

    def _quiet_until(
        self, routes: Sequence[Route], payload: dict[str, Any], now: datetime
    ) -> datetime | None:
        """The latest end of the quiet hours any of the event's routes is in (its mails go
        together), or None. Critical mail has none; an operator's replay sends at once."""
        if self.lane.lane is Lane.CRITICAL:
            return None
        ends = [
            end
            for route in routes
            if route.quiet_hours is not None
            and (end := route.quiet_hours.resume_at(now, payload)) is not None
        ]
        return max(ends) if ends else None

    def prepare(
        self, claimed: Sequence[Row], run_id: str, outcome: BatchOutcome, replay: bool
    ) -> list[Work]:
        lookups = self._look_up_recipients(claimed)
        now = utcnow()
        # Asked once per batch: with tracing off, no span work per message.
        traced = tracing.active()
        work: list[Work] = []
        wanted: list[Wanted] = []
        with self.engine.begin() as connection:
            existing: dict[tuple[str, str], Row] = {
                (m.event_id, m.route): m
                for m in messages.for_events(connection, [e.event_id for e in claimed])
            }
            pending: list[tuple[Row, Row, Route, dict[str, Any]]] = []
            routed: list[str] = []
            # (event, route, payload, existing message or None) in publish order.
            planned: list[tuple[Row, Route, dict[str, Any], Row | None]] = []
            for event in claimed:
                if not replay and event.claim_count > MAX_CLAIMS:
                    self.recorder.crash_loop(connection, event, existing, run_id, now)
                    outcome.dead += 1
                    continue
                try:
                    version, payload = self.routes.upcast(
                        event.event_type, event.event_version, dict(event.payload)
                    )
                except UnknownEventVersionError as error:
                    self.recorder.dead_letter_event(connection, event, error, run_id, now)
                    outcome.dead += 1
                    continue
                except Exception as exc:  # an upcaster that cannot read this payload
                    failure = PermanentError(
                        f"upcasting {event.event_type} v{event.event_version} failed: "
                        f"{type(exc).__name__}: {exc}",
                        code="upcast_failed",
                    )
                    self.recorder.dead_letter_event(connection, event, failure, run_id, now)
                    outcome.dead += 1
                    continue
                event_routes = self.routes.for_event(event.event_type, version)
                if not event_routes:
                    outbox.finish(
                        connection,
                        [event.event_id],
                        status=outbox.DONE,
                        resolution="ignored",
                        now=now,
                    )
                    outcome.ignored += 1
                    continue
                resume = None if replay else self._quiet_until(event_routes, payload, now)
                if resume is not None:
                    outbox.defer(connection, [event.event_id], run_id, resume)
                    outcome.deferred += 1
                    continue
                routed.append(event.event_id)
                for route in event_routes:
                    planned.append(
                        (event, route, payload, existing.get((event.event_id, route.name)))
                    )
            # Routed now: an event-level dead letter (say, a version that has an upcaster
            # since) is settled, however the replay was started.
            dead_letters.resolve_for_events(
                connection, routed, status=dead_letters.REPLAYED, run_id=run_id, now=now
            )
            # New messages go in with one multi-row insert (idempotency keys recorded before
            # any provider call); the unique indexes still decide duplicates, in publish order.
            created = iter(
                self._create_messages(
                    connection,
                    [(e, r, p) for e, r, p, m in planned if m is None],
                    now,
                    run_id,
                    lookups,
                )
            )
            made_now: set[int] = set()
            for event, route, payload, message in planned:
                if message is None:
                    message = next(created)
                    made_now.add(message.message_id)
                if message.status == messages.DUPLICATE:
                    outcome.duplicate += 1
                elif message.status == messages.DEAD:
                    outcome.dead += 1
                elif message.status == messages.PENDING:
                    pending.append((event, message, route, payload))

            pending = self._check_again(
                connection, pending, made_now, lookups, run_id, now, outcome
            )
            reasons = suppressions.reasons_for(
                connection, [m.recipient for _, m, _, _ in pending if m.recipient]
            )
            # A suppressed address's message the provider already accepted (its answer lost to
            # a timeout or a killed sender, and its own bounce may be what suppressed it) is
            # recorded as sent, not as suppressed: the webhooks prove where it went.
            accepted_already = email_events.provider_message_ids(
                connection,
                [
                    m.message_id
                    for _, m, _, _ in pending
                    if m.recipient and reasons.get(suppressions.normalize(m.recipient))
                ],
            )
            for event, message, route, payload in pending:
                expires_at = as_utc(message.expires_at)
                if expires_at is not None and expires_at <= now:
                    self.recorder.close_unsent(
                        connection,
                        message,
                        messages.EXPIRED,
                        f"expired at {expires_at.isoformat()}",
                        dead_letters.EXPIRED,
                        run_id,
                        now,
                    )
                    outcome.expired += 1
                    continue
                reason = reasons.get(suppressions.normalize(message.recipient))
                if reason and message.message_id in accepted_already:
                    self.recorder.accepted_per_provider(
                        connection,
                        message,
                        accepted_already[message.message_id],
                        run_id,
                        now,
                        trace=event,
                    )
                    outcome.sent += 1
                    continue
                if reason and (reason in _HARD_SUPPRESSIONS or route.honours_unsubscribe):
                    self.recorder.close_unsent(
                        connection,
                        message,
                        messages.SUPPRESSED,
                        f"address suppressed: {reason}",
                        dead_letters.SUPPRESSED,
                        run_id,
                        now,
                    )
                    outcome.suppressed += 1
                    continue
                try:
                    # Parented on the event's stored context: one trace from the publisher's
                    # request to the provider's webhooks.
                    with (
                        tracing.start_span(
                            "email_platform.render",
                            context_carrier=event.trace_context,
                            attributes={
                                "email.event_id": event.event_id,
                                "email.message_id": message.message_id,
                                "email.route": route.name,
                                "email.template": route.template,
                                "email.template_version": message.template_version,
                            },
                        )
                        if traced
                        else tracing.NO_SPAN
                    ) as render_span:
                        hosted = route.provider_template if self.provider_templates else None
                        call = hosted.call(payload) if hosted is not None else None
                        rendered = (
                            provider_templates.stand_in(message.template, message.template_version)
                            if call is not None
                            else self.renderer.render(
                                route.template, message.template_version, payload, message.locale
                            )
                        )
                except Exception as exc:  # a template error, or whatever a filter raised
                    error = (
                        exc
                        if isinstance(exc, TemplateRenderError)
                        else TemplateRenderError(
                            f"{route.template}: {type(exc).__name__}: {exc}", code="template_error"
                        )
                    )
                    self.recorder.dead_letter_for(
                        connection, message, error, run_id=run_id, now=now, trace=event
                    )
                    outcome.dead += 1
                    continue
                try:  # a failure dead-letters this message alone
                    addressed = addressing.address(route, payload, self.sender_address)
                except PermanentError as error:
                    self.recorder.dead_letter_for(
                        connection, message, error, run_id=run_id, now=now, trace=event
                    )
                    outcome.dead += 1
                    continue
                work.append(
                    Work(
                        message,
                        OutgoingEmail(
                            message_id=message.message_id,
                            event_id=event.event_id,
                            idempotency_key=message.idempotency_key,
                            sender=addressed.sender,
                            to=message.recipient,
                            subject=rendered.subject,
                            text=rendered.text,
                            html=rendered.html,
                            template=message.template if call is not None else route.template,
                            lane=self.lane.lane.value,
                            headers={
                                "X-Email-Event-Id": event.event_id,
                                **self.unsubscribe_links.headers_for(route, message.recipient, now),
                            },
                            trace_id=event.trace_id,
                            correlation_id=event.correlation_id,
                            provider_template=call,
                            reply_to=addressed.reply_to,
                            cc=addressed.cc,
                            bcc=addressed.bcc,
                            envelope_sender=addressed.envelope_sender,
                        ),
                        # An event published outside any trace: its send span continues the
                        # render's trace, so the message's spans still form one trace.
                        event.trace_context or tracing.carrier_of(render_span),
                        fresh=message.message_id in made_now,
                    )
                )
                if route.attachments is not None:  # made once this transaction has committed
                    wanted.append(Wanted(len(work) - 1, route, payload, event))
        return attach_files(
            self.engine, self.recorder, work, wanted, run_id=run_id, outcome=outcome
        )

    def _look_up_recipients(self, claimed: Sequence[Row]) -> dict[str, str | None]:
        """Resolve looked-up recipients before the write transaction opens.

        The directory may live in the same SQLite file, whose write lock this process would
        otherwise hold while asking it.
        """
        keys: set[str] = set()
        for event in claimed:
            try:
                version, payload = self.routes.upcast(
                    event.event_type, event.event_version, dict(event.payload)
                )
            except Exception:  # the event is dead-lettered with the reason when prepared
                continue
            for route in self.routes.for_event(event.event_type, version):
                key = payload.get(route.recipient_lookup_field or "")
                if route.recipient_lookup_field and key is not None:
                    keys.add(str(key))
        return {key: self._look_up(key) for key in sorted(keys)}

    def _look_up(self, key: str) -> str | None:
        """One directory lookup; a key the directory cannot take finds no one."""
        if text_problem(key) is not None:
            return None
        return self.resolver.lookup(key)

    def _create_messages(
        self,
        connection: Any,
        items: Sequence[tuple[Row, Route, dict[str, Any]]],
        now: datetime,
        run_id: str,
        lookups: dict[str, str | None],
    ) -> list[Row]:
        """Insert the messages of ``items`` (in order); dead-letter those that cannot be sent."""
        planned = [self._message_values(e, r, p, now, lookups) for e, r, p in items]
        rows = messages.create_many(connection, [values for values, _ in planned])
        result: list[Row] = []
        for (event, _, _), message, (_, failure) in zip(items, rows, planned, strict=True):
            if failure is not None and message.status == messages.PENDING:
                self.recorder.dead_letter_for(
                    connection, message, failure, run_id=run_id, now=now, trace=event
                )
                message = messages.get(connection, message.message_id)
            result.append(message)
        return result

    def _message_values(
        self,
        event: Row,
        route: Route,
        payload: dict[str, Any],
        now: datetime,
        lookups: dict[str, str | None],
    ) -> tuple[dict[str, Any], PermanentError | None]:
        base_key = event.idempotency_key or event.event_id
        expires = [as_utc(event.expires_at)]
        if route.ttl_s is not None:
            expires.append(as_utc(event.published_at) + timedelta(seconds=route.ttl_s))
        known = [e for e in expires if e is not None]
        values: dict[str, Any] = {
            "event_id": event.event_id,
            "route": route.name,
            "template": route.template,
            "lane": event.lane,
            "idempotency_key": f"{base_key}:{route.name}",
            "dedupe_key": None,
            "status": messages.PENDING,
            "expires_at": min(known) if known else None,
            "created_at": now,
            "updated_at": now,
            "provider": self.provider_name,
            "recipient": None,
            "recipient_domain": None,
        }
        failures: list[PermanentError] = []
        try:
            values["dedupe_key"] = route.dedupe_key_for(payload)
        except Exception as exc:  # a payload the route's dedupe key cannot be made from
            failures.append(
                PermanentError(
                    f"dedupe key {route.dedupe_key!r}: {type(exc).__name__}: {exc}",
                    code="dedupe_key_error",
                )
            )
        hosted = route.provider_template if self.provider_templates else None
        if hosted is not None:  # the provider renders it: its id and version are recorded
            values["template"] = hosted.id
        try:
            values["template_version"] = (
                hosted.recorded_version
                if hosted is not None
                else route.template_version or self.renderer.latest_version(route.template)
            )
        except TemplateRenderError as error:
            values["template_version"] = route.template_version or 0
            failures.append(error)
        values["locale"] = locales.used_for(
            self.renderer, route, payload, values["template_version"]
        )
        try:
            values["recipient"] = self._recipient(route, payload, lookups)
            values["recipient_domain"] = values["recipient"].rsplit("@", 1)[-1].lower()
        except (RecipientNotFoundError, InvalidRecipientError) as error:
            failures.append(error)
        failures.extend(_unstorable(values))
        return values, failures[0] if failures else None

    def _check_again(
        self,
        connection: Any,
        pending: list[tuple[Row, Row, Route, dict[str, Any]]],
        made_now: set[int],
        lookups: dict[str, str | None],
        run_id: str,
        now: datetime,
        outcome: BatchOutcome,
    ) -> list[tuple[Row, Row, Route, dict[str, Any]]]:
        """A replay (a re-execution, or ``dlq replay``) reopens dead messages, also those dead
        for what they were made from: a dedupe key or recipient the columns cannot hold (cleared
        so the row could record why), a recipient not found. Each message not made by this
        attempt is checked again as when it was made; one still bad is dead-lettered again, and
        a recipient found since (the user's address fixed) is written in."""
        kept: list[tuple[Row, Row, Route, dict[str, Any]]] = []
        for event, message, route, payload in pending:
            if message.message_id in made_now:
                kept.append((event, message, route, payload))
                continue
            values, failure = self._message_values(event, route, payload, now, lookups)
            if failure is not None:
                self.recorder.dead_letter_for(
                    connection, message, failure, run_id=run_id, now=now, trace=event
                )
                outcome.dead += 1
                continue
            if message.recipient is None:
                messages.set_recipient(connection, message.message_id, values["recipient"], now)
                message = messages.get(connection, message.message_id)
            kept.append((event, message, route, payload))
        return kept

    def _recipient(
        self, route: Route, payload: dict[str, Any], lookups: dict[str, str | None]
    ) -> str:
        if route.recipient_lookup_field:
            key = payload.get(route.recipient_lookup_field)
            address = lookups.get(str(key)) if key is not None else None
            if not address:
                raise RecipientNotFoundError(
                    f"no recipient for {route.recipient_lookup_field}={key!r}",
                    code="recipient_not_found",
                )
            return _checked_address(address)
        address = payload.get(route.recipient_field or "")
        if not address:
            raise RecipientNotFoundError(
                f"payload has no {route.recipient_field!r}", code="recipient_missing"
            )
        return _checked_address(str(address))


def _checked_address(address: str) -> str:
    """A recipient as ``publish()`` would have checked it (a looked-up one is checked here
    first, and one published before the checks grew stricter is checked again)."""
    try:
        return check_address("recipient", address)
    except PublishError as error:
        raise InvalidRecipientError(error.message, code="invalid_recipient") from None


def _unstorable(values: dict[str, Any]) -> list[PermanentError]:
    """Values the messages table cannot hold; each is cleared so the row can record why."""
    failures: list[PermanentError] = []
    for name in _CHECKED_COLUMNS:
        value = values.get(name)
        if value is None:
            continue
        limit = email_messages.c[name].type.length
        problem = text_problem(value) or (
            f"is {len(value)} characters; the column holds {limit}"
            if limit is not None and len(value) > limit
            else None
        )
        if problem is None:
            continue
        failures.append(PermanentError(f"{name} {problem}", code="value_too_long"))
        if name == "idempotency_key":
            values[name] = f"{values['event_id']}:{values['route']}"[:limit]
        else:
            values[name] = None
    return failures
