"""Webhook ingestion without Dagster: claim inbox rows, normalize, apply each event once.

Applying is idempotent twice over: ``email_events`` is unique on the provider's event id, and
a message's delivery state only ever moves up the vocabulary's ranking. Suppressions are
first-writer-wins. So a duplicate, a replay or any arrival order changes nothing it should not.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from email_platform.store import email_events, inbox, messages, suppressions
from email_platform.timeutil import utcnow
from email_platform.webhooks import registry
from email_platform.webhooks.errors import WebhookMalformed
from email_platform.webhooks.vocabulary import NormalizedEvent, combine


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

    def run(self, inbox_ids: Sequence[int], *, run_id: str, lease_s: int = 300) -> IngestOutcome:
        outcome = IngestOutcome()
        with self.engine.begin() as connection:
            rows = inbox.claim(connection, inbox_ids, run_id=run_id, lease_s=lease_s, now=utcnow())
        outcome.claimed = len(rows)
        for row in rows:
            try:
                events = self.providers[row.provider].normalize(row.body.encode("utf-8"))
            except (WebhookMalformed, KeyError) as exc:
                with self.engine.begin() as connection:
                    inbox.finish(
                        connection,
                        row.inbox_id,
                        status=inbox.MALFORMED,
                        error=str(exc),
                        now=utcnow(),
                    )
                outcome.malformed += 1
                continue
            # One transaction per inbox row: its events land together or not at all.
            with self.engine.begin() as connection:
                for event in events:
                    self._apply(connection, event, row.inbox_id, outcome)
                inbox.finish(
                    connection, row.inbox_id, status=inbox.PROCESSED, error=None, now=utcnow()
                )
        return outcome

    def _apply(
        self, connection: Any, event: NormalizedEvent, inbox_id: int, outcome: IngestOutcome
    ) -> None:
        now = utcnow()
        message = messages.find_for_provider_event(
            connection,
            idempotency_key=event.idempotency_key,
            event_id=event.event_id,
            provider_message_id=event.provider_message_id,
        )
        recipient = event.recipient or (message.recipient if message is not None else None)
        stored = email_events.add(
            connection,
            {
                "provider": event.provider,
                "provider_event_id": event.provider_event_id,
                "event_type": event.event_type,
                "occurred_at": event.occurred_at,
                "received_at": now,
                "event_id": event.event_id or (message.event_id if message is not None else None),
                "idempotency_key": event.idempotency_key,
                "message_id": message.message_id if message is not None else None,
                "provider_message_id": event.provider_message_id,
                "recipient": recipient,
                "recipient_domain": recipient.rsplit("@", 1)[-1].lower() if recipient else None,
                "reject_reason": event.reject_reason,
                "bounce_type": event.bounce_type,
                "click_url": event.click_url,
                "user_agent": event.user_agent,
                "machine_open": event.machine_open,
                "inbox_id": inbox_id,
                "raw": event.raw,
            },
        )
        if not stored:
            outcome.duplicates += 1
            return
        outcome.applied += 1
        if message is None:
            outcome.unlinked += 1
            self.log.warning(
                f"provider event {event.provider_event_id} ({event.event_type}) "
                f"matches no message (event_id={event.event_id})"
            )
        else:
            # Recomputed from every stored event: the same answer in any order, and after a
            # re-normalization that removed events.
            state = None
            for kind in email_events.types_for_message(connection, message.message_id):
                state = combine(state, kind)
            if state != message.delivery_status:
                messages.set_delivery_status(connection, message.message_id, state, now)
        reason = event.suppression_reason
        if (
            reason
            and recipient
            and suppressions.add(
                connection,
                recipient,
                reason=reason,
                source=f"webhook:{event.provider}",
                now=now,
                event_id=event.event_id,
            )
        ):
            outcome.suppressed += 1
