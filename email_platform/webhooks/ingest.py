"""Webhook ingestion without Dagster: claim inbox rows, normalize, apply each event once.

Applying is idempotent twice over: ``email_events`` is unique on the provider's event id, and
a message's delivery state only ever moves up the vocabulary's ranking. Suppressions are
first-writer-wins. So a duplicate, a replay or any arrival order changes nothing it should not.
"""

import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import Engine

from email_platform.common.text import storable_text, text_problem
from email_platform.common.timeutil import utcnow
from email_platform.db.errors import database_unavailable
from email_platform.db.schema import email_events as email_events_table
from email_platform.observability import logs, tracing
from email_platform.store import email_events, inbox, messages, outbox, suppressions
from email_platform.webhooks import registry
from email_platform.webhooks.errors import WebhookMalformed
from email_platform.webhooks.vocabulary import NormalizedEvent, combine

#: Lengths of the descriptive columns, cut to fit rather than refused.
_LIMITS = {
    name: email_events_table.c[name].type.length
    for name in ("reject_reason", "click_url", "user_agent")
}


def _identity(value: str) -> str:
    """A provider event id the column holds; an over-long or odd one becomes its SHA-256."""
    limit = email_events_table.c.provider_event_id.type.length
    if len(value) <= limit and text_problem(value) is None:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def _fitting(column: str, value: str | None) -> str | None:
    """An id read from a provider's body, or ``None`` if it cannot be one (too long for its
    column, NUL): no message has such an id, so nothing is lost by not storing it."""
    if value is None:
        return None
    limit = email_events_table.c[column].type.length
    if (limit is not None and len(value) > limit) or text_problem(value) is not None:
        return None
    return value


@dataclass
class IngestOutcome:
    claimed: int = 0
    applied: int = 0
    duplicates: int = 0
    unlinked: int = 0
    suppressed: int = 0
    malformed: int = 0
    failed: int = 0

    def as_metadata(self) -> dict[str, int]:
        return dict(self.__dict__)


class WebhookIngestor:
    def __init__(
        self,
        engine: Engine,
        *,
        providers: Mapping[str, registry.WebhookProvider] | None = None,
        log: logging.Logger | Any | None = None,
    ) -> None:
        self.engine = engine
        self.providers = dict(providers or registry.available())
        self.log = log or logging.getLogger(__name__)
        #: One line per provider event applied: the stdlib logger, never Dagster's event log.
        self.message_log = logs.bind(logging.getLogger(logs.MESSAGES_LOGGER))
        # Set per run: whether to emit spans, and the trace contexts of the events seen so far.
        self._traced = False
        self._contexts: dict[str, Any] = {}

    def run(self, inbox_ids: Sequence[int], *, run_id: str, lease_s: int = 300) -> IngestOutcome:
        outcome = IngestOutcome()
        self.message_log = logs.bind(logging.getLogger(logs.MESSAGES_LOGGER), run_id=run_id)
        self._traced = tracing.active()
        self._contexts = {}
        with self.engine.begin() as connection:
            rows = inbox.claim(connection, inbox_ids, run_id=run_id, lease_s=lease_s, now=utcnow())
        outcome.claimed = len(rows)
        for row in rows:
            try:
                events = self.providers[row.provider].normalize(row.body.encode("utf-8"))
            except Exception as exc:  # whatever a stored body does, it is that row's alone
                error = str(exc) if isinstance(exc, WebhookMalformed | KeyError) else repr(exc)
                self._finish(row.inbox_id, inbox.MALFORMED, error)
                outcome.malformed += 1
                continue
            # One transaction per inbox row: its events land together or not at all.
            before = dataclasses.replace(outcome)
            try:
                with self.engine.begin() as connection:
                    for event in events:
                        self._apply(connection, event, row.inbox_id, outcome)
                    inbox.finish(
                        connection, row.inbox_id, status=inbox.PROCESSED, error=None, now=utcnow()
                    )
            except Exception as exc:
                if database_unavailable(exc):
                    raise  # the database is down: the run fails and its rows are released
                # One webhook the database will not store must not hold up the others: it is
                # marked failed with the reason (``webhooks reprocess`` retries it).
                for name, value in dataclasses.asdict(before).items():
                    setattr(outcome, name, value)
                self._finish(row.inbox_id, inbox.FAILED, f"the database refused it: {exc!r}")
                outcome.failed += 1
        return outcome

    def _finish(self, inbox_id: int, status: str, error: str) -> None:
        with self.engine.begin() as connection:
            inbox.finish(
                connection,
                inbox_id,
                status=status,
                error=storable_text(error, 2000),
                now=utcnow(),
            )

    def _record_span(
        self, connection: Any, event: NormalizedEvent, message: Any, started_ns: int
    ) -> None:
        """An ``email_platform.webhook`` span (kind CONSUMER) for one applied provider event,
        parented on its message's event's stored context: the provider's report joins the
        trace of the request that caused the email."""
        event_id = message.event_id
        if event_id not in self._contexts:
            fields = outbox.trace_fields(connection, [event_id]).get(event_id)
            self._contexts[event_id] = fields.trace_context if fields is not None else None
        tracing.record_span(
            "email_platform.webhook",
            start_time_ns=started_ns,
            context_carrier=self._contexts[event_id],
            kind="consumer",
            attributes={
                "email.provider": event.provider,
                "email.webhook_event_type": event.event_type,
                "email.event_id": event_id,
                "email.message_id": message.message_id,
                "email.provider_message_id": event.provider_message_id,
            },
        )

    def _apply(
        self, connection: Any, event: NormalizedEvent, inbox_id: int, outcome: IngestOutcome
    ) -> None:
        now = utcnow()
        started_ns = tracing.now_ns()
        event_id = _fitting("event_id", event.event_id)
        idempotency_key = _fitting("idempotency_key", event.idempotency_key)
        provider_message_id = _fitting("provider_message_id", event.provider_message_id)
        message = messages.find_for_provider_event(
            connection,
            idempotency_key=idempotency_key,
            event_id=event_id,
            provider_message_id=provider_message_id,
        )
        recipient = _fitting("recipient", event.recipient) or (
            message.recipient if message is not None else None
        )
        stored = email_events.add(
            connection,
            {
                "provider": event.provider,
                "provider_event_id": _identity(event.provider_event_id),
                "event_type": event.event_type,
                "occurred_at": event.occurred_at,
                "received_at": now,
                "event_id": event_id or (message.event_id if message is not None else None),
                "idempotency_key": idempotency_key,
                "message_id": message.message_id if message is not None else None,
                "provider_message_id": provider_message_id,
                "recipient": recipient,
                "recipient_domain": recipient.rsplit("@", 1)[-1].lower() if recipient else None,
                "reject_reason": storable_text(event.reject_reason, _LIMITS["reject_reason"]),
                "bounce_type": event.bounce_type,
                "click_url": storable_text(event.click_url, _LIMITS["click_url"]),
                "user_agent": storable_text(event.user_agent, _LIMITS["user_agent"]),
                "machine_open": event.machine_open,
                "inbox_id": inbox_id,
                "raw": event.raw,
            },
        )
        ids = logs.fields(
            event_id=event_id,
            message_id=message.message_id if message is not None else None,
            idempotency_key=idempotency_key,
            provider_message_id=provider_message_id,
            provider=event.provider,
            provider_event_id=event.provider_event_id,
            webhook_event=event.event_type,
            inbox_id=inbox_id,
        )
        if not stored:
            outcome.duplicates += 1
            self.message_log.info("provider event already applied", **ids)
            return
        outcome.applied += 1
        self.message_log.info(f"provider event applied: {event.event_type}", **ids)
        if message is None:
            outcome.unlinked += 1
            self.log.warning(
                f"provider event {event.provider_event_id} ({event.event_type}) "
                f"matches no message (event_id={event.event_id})",
                **ids,
            )
        else:
            # Recomputed from every stored event: the same answer in any order, and after a
            # re-normalization that removed events. The row lock makes concurrent runs take
            # turns, so the last one reads the events of all the others (without it, two runs
            # each read only their own and the last to write won).
            current = messages.lock_delivery_status(connection, message.message_id)
            state = None
            for kind in email_events.types_for_message(connection, message.message_id):
                state = combine(state, kind)
            if state != current:
                messages.set_delivery_status(connection, message.message_id, state, now)
            if self._traced:
                self._record_span(connection, event, message, started_ns)
        wanted = implied_suppression(event, recipient)
        if wanted is not None and suppressions.add(
            connection,
            wanted.address,
            reason=wanted.reason,
            source=wanted.source,
            now=now,
            event_id=wanted.event_id,
        ):
            outcome.suppressed += 1


class Suppression(NamedTuple):
    address: str
    reason: str
    source: str
    event_id: str | None


def implied_suppression(event: NormalizedEvent, recipient: str | None) -> Suppression | None:
    """The suppression ``event`` asks for, given the recipient it was applied to; None if it
    asks for none. Ingestion and ``webhooks reprocess`` both ask here, so a re-normalization
    suppresses exactly as ingestion does."""
    reason = event.suppression_reason
    if not reason or not recipient:
        return None
    source = f"{suppressions.WEBHOOK}{event.provider}"
    return Suppression(recipient, reason, source, _fitting("event_id", event.event_id))


def recipient_of(connection: Any, event: NormalizedEvent) -> str | None:
    """The address ``event`` is about: its own, else its message's (as ``_apply`` links it)."""
    recipient = _fitting("recipient", event.recipient)
    if recipient is not None:
        return recipient
    message = messages.find_for_provider_event(
        connection,
        idempotency_key=_fitting("idempotency_key", event.idempotency_key),
        event_id=_fitting("event_id", event.event_id),
        provider_message_id=_fitting("provider_message_id", event.provider_message_id),
    )
    return message.recipient if message is not None else None
