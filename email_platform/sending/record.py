"""Recording what happened: attempts, message states, dead letters, and settling events.

Every decision is committed as soon as it is known, so a crash at any point loses no outcome
that was already in hand. An event is settled (``done`` or ``dead``) once all its messages are
terminal; one with a message still pending stays in flight under this run's lease.
"""

import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, Row

from email_platform.common.classify import is_transient
from email_platform.common.errors import (
    ConfigurationError,
    DeliveryError,
    PermanentError,
    TransientError,
)
from email_platform.common.lanes import LaneConfig
from email_platform.common.text import storable_text
from email_platform.common.timeutil import utcnow
from email_platform.db.errors import refused_by_database
from email_platform.db.schema import email_messages
from email_platform.observability import logs, tracing
from email_platform.observability.redaction import loggable
from email_platform.providers.base import Accepted, failover_provider
from email_platform.sending.refusals import first_line, restore_outcome
from email_platform.sending.types import BatchOutcome, Sent, Work
from email_platform.store import attempts, dead_letters, messages, outbox

#: The provider's message id as the messages and attempts tables hold it.
_PROVIDER_ID_LENGTH = email_messages.c.provider_message_id.type.length


def _provider_id(value: str | None) -> str | None:
    """A provider's message id as stored: an odd one (NUL, over-long) is cleaned, not refused."""
    return storable_text(value, _PROVIDER_ID_LENGTH)


def message_fields(message: Any, trace: Any = None, **more: Any) -> dict[str, Any]:
    """``extra=`` for a line about one message row: its ids, and the event's trace fields."""
    values = {
        "event_id": message.event_id,
        "message_id": message.message_id,
        "idempotency_key": getattr(message, "idempotency_key", None),
        "provider_message_id": getattr(message, "provider_message_id", None),
        **logs.trace_fields(trace),
    }
    values.update(more)
    return logs.fields(**values)


def _via(secondary: str | None, text: str | None = None) -> str | None:
    """``text`` of an attempt a failover's secondary made, saying which provider made it."""
    if secondary is None:
        return text
    return f"via {secondary} (failover)" + (f": {text}" if text else "")


class Recorder:
    """Writes one run's outcomes for one lane; ``provider_name`` is stamped on each message."""

    def __init__(
        self,
        engine: Engine,
        lane: LaneConfig,
        provider_name: str,
        log: logging.Logger | Any,
    ) -> None:
        self.engine = engine
        self.lane = lane
        self.provider_name = provider_name
        self.log = log
        #: One line per message accepted: the stdlib logger, never Dagster's event log.
        self.message_log = logs.bind(
            logging.getLogger(logs.MESSAGES_LOGGER), lane=lane.lane.value, provider=provider_name
        )

    # ---- provider answers ---------------------------------------------------------------------

    def record_group(
        self, group: list[Sent], run_id: str, outcome: BatchOutcome
    ) -> ConfigurationError | None:
        """One transaction per group; if the database refuses it, one per answer.

        A refused group (a value in one answer the database will not store) must not lose the
        other answers of the group, nor be retried whole forever: each answer is then recorded
        on its own, and one the database still refuses becomes its message's dead letter.
        """
        before = dataclasses.replace(outcome, transient=list(outcome.transient))
        try:
            return self._record_together(group, run_id, outcome)
        except Exception as exc:
            if not refused_by_database(exc):
                raise
            restore_outcome(outcome, before)
        self.log.warning(f"the database refused a group of {len(group)} outcomes; one by one")
        configuration_error: ConfigurationError | None = None
        for sent in group:
            before = dataclasses.replace(outcome, transient=list(outcome.transient))
            try:
                configuration_error = (
                    self._record_together([sent], run_id, outcome) or configuration_error
                )
            except Exception as exc:
                if not refused_by_database(exc):
                    raise
                restore_outcome(outcome, before)
                self._dead_letter_unrecordable(sent, exc, run_id, outcome)
        return configuration_error

    def _dead_letter_unrecordable(
        self, sent: Sent, exc: Exception, run_id: str, outcome: BatchOutcome
    ) -> None:
        accepted = isinstance(sent.result, Accepted)
        why = (
            "accepted by the provider, but its answer could not be stored"
            if accepted
            else "its provider answer could not be stored"
        )
        with self.engine.begin() as connection:
            message = messages.get(connection, sent.item.message.message_id)
            if message is None or message.status != messages.PENDING:
                return
            self.dead_letter(
                connection,
                message,
                "unstorable",
                f"{why}: {first_line(exc)}",
                code="database_refused",
                run_id=run_id,
                now=utcnow(),
                trace=sent.item.email,
            )
        outcome.dead += 1

    def _record_together(
        self, group: list[Sent], run_id: str, outcome: BatchOutcome
    ) -> ConfigurationError | None:
        """One transaction per group, the accepted sends with one statement per table."""
        configuration_error: ConfigurationError | None = None
        accepted: list[tuple[Work, Accepted, datetime]] = []
        with self.engine.begin() as connection:
            for sent in group:
                if isinstance(sent.result, Accepted):
                    accepted.append((sent.item, sent.result, sent.started))
                elif isinstance(sent.result, ConfigurationError):
                    # A wrong setting is the deployment's to fix: dead-letter nothing.
                    configuration_error = configuration_error or sent.result
                else:
                    self._record_failure(
                        connection, sent.item, sent.result, sent.started, run_id, outcome
                    )
            self._record_accepted(connection, accepted, run_id, outcome)
        # Once committed: a group the database refuses is recorded again one by one, and its
        # lines must say each acceptance once.
        self._log_accepted(accepted, run_id)
        return configuration_error

    def salvage(self, leftovers: list[Sent], run_id: str, outcome: BatchOutcome) -> None:
        """Interrupted: record the answers in hand if the database still lets us."""
        try:
            self.record_group(leftovers, run_id, outcome)
            self.log.warning(f"interrupted: recorded the {len(leftovers)} outcome(s) in hand")
        except Exception as exc:  # the database may be what failed; the keys still guard
            self.log.warning(f"interrupted: could not record {len(leftovers)} outcome(s): {exc}")

    def _record_accepted(
        self,
        connection: Any,
        accepted: Sequence[tuple[Work, Accepted, datetime]],
        run_id: str,
        outcome: BatchOutcome,
    ) -> None:
        if not accepted:
            return
        now = utcnow()
        # The attempts and the messages marked sent: one statement on PostgreSQL.
        messages.record_accepted_calls(
            connection,
            [
                {
                    "message_id": item.message.message_id,
                    "event_id": item.message.event_id,
                    "run_id": run_id,
                    "attempt_no": item.message.attempts + 1,
                    "started_at": started,
                    "finished_at": now,
                    "outcome": "accepted",
                    "http_status": result.status_code,
                    "provider_message_id": _provider_id(result.provider_message_id),
                    "error": _via(result.provider),
                    "retry_after_s": None,
                    "provider": result.provider or self.provider_name,
                }
                for item, result, started in accepted
            ],
            now,
        )
        # Only a message made before this claim can have a letter to close (a replay's).
        dead_letters.resolve_for_messages(
            connection,
            [item.message.message_id for item, _, _ in accepted if not item.fresh],
            status=dead_letters.REPLAYED,
            run_id=run_id,
            now=now,
        )
        outcome.sent += len(accepted)

    def _log_accepted(
        self, accepted: Sequence[tuple[Work, Accepted, datetime]], run_id: str
    ) -> None:
        if not accepted:
            return
        self.message_log.info_each(
            "accepted by the provider",
            (
                {
                    "event_id": item.message.event_id,
                    "message_id": item.message.message_id,
                    "idempotency_key": getattr(item.message, "idempotency_key", None),
                    "provider_message_id": result.provider_message_id,
                    **logs.trace_fields(item.email),
                    "provider": result.provider or self.provider_name,
                    "run_id": run_id,
                    "attempt_no": item.message.attempts + 1,
                    "http_status": result.status_code,
                }
                for item, result, _ in accepted
            ),
        )

    def accepted_per_provider(
        self,
        connection: Any,
        message: Row,
        provider_message_id: str | None,
        run_id: str,
        now: datetime,
        *,
        trace: Any = None,
    ) -> None:
        """A message whose answer was lost (a timeout, a dropped connection, a killed sender)
        but whose webhooks show the provider accepted it: recorded as sent, not sent again."""
        attempts.add(
            connection,
            [
                {
                    "message_id": message.message_id,
                    "event_id": message.event_id,
                    "run_id": run_id,
                    "attempt_no": message.attempts + 1,
                    "started_at": now,
                    "finished_at": now,
                    "outcome": "accepted",
                    "http_status": None,
                    "provider_message_id": _provider_id(provider_message_id),
                    "error": "no answer recorded; the provider's webhooks show it accepted",
                    "retry_after_s": None,
                    "provider": message.provider or self.provider_name,
                }
            ],
        )
        messages.record_accepted_many(
            connection,
            [(message.message_id, _provider_id(provider_message_id))],
            now,
            self.provider_name,
        )
        dead_letters.resolve_for_messages(
            connection, [message.message_id], status=dead_letters.REPLAYED, run_id=run_id, now=now
        )
        self.log.warning(
            f"event_id={message.event_id}{tracing.log_fields(trace)} "
            f"message={message.message_id} recorded as sent: "
            "its answer was lost, the provider's webhooks show it accepted",
            **message_fields(
                message, trace, provider_message_id=provider_message_id, run_id=run_id
            ),
        )

    def _record_failure(
        self,
        connection: Any,
        item: Work,
        result: DeliveryError,
        started: datetime,
        run_id: str,
        outcome: BatchOutcome,
    ) -> None:
        now = utcnow()
        message = item.message
        attempt_no = message.attempts + 1
        attempt = {
            "message_id": message.message_id,
            "event_id": message.event_id,
            "run_id": run_id,
            "attempt_no": attempt_no,
            "started_at": started,
            "finished_at": now,
        }
        transient = is_transient(result)
        secondary = failover_provider(result)
        error_text = storable_text(_via(secondary, str(result))) or ""
        attempts.add(
            connection,
            [
                {
                    **attempt,
                    "outcome": "transient" if transient else "permanent",
                    "http_status": result.status_code,
                    "error": error_text,
                    "retry_after_s": result.retry_after_s
                    if isinstance(result, TransientError)
                    else None,
                    "provider": secondary or self.provider_name,
                }
            ],
        )
        messages.record_attempt(
            connection,
            message.message_id,
            now,
            accepted=False,
            provider=secondary or self.provider_name,
            provider_message_id=None,
            error=error_text,
        )
        if transient:
            outcome.transient.append(message.message_id)
            if isinstance(result, TransientError) and result.retry_after_s is not None:
                outcome.retry_after_s = max(outcome.retry_after_s or 0.0, result.retry_after_s)
            self.log.warning(
                f"event_id={message.event_id}{tracing.log_fields(item.email)} "
                f"message={message.message_id} transient failure, will retry: "
                f"{loggable(str(result), message.recipient)}",
                **message_fields(
                    message,
                    item.email,
                    run_id=run_id,
                    provider=secondary or self.provider_name,
                    attempt_no=attempt_no,
                    http_status=result.status_code,
                    error_code=result.code,
                ),
            )
            return
        refreshed = messages.get(connection, message.message_id)
        self.dead_letter(
            connection,
            refreshed,
            result.reason,
            error_text,
            code=storable_text(result.code, 100),
            run_id=run_id,
            now=now,
            trace=item.email,
        )
        outcome.dead += 1

    # ---- terminal bookkeeping ----------------------------------------------------------------

    def close_unsent(
        self,
        connection: Any,
        message: Row,
        status: str,
        why: str,
        letter_status: str,
        run_id: str,
        now: datetime,
    ) -> None:
        """A message that will not be sent (expired, suppressed); a replay's letter closes too."""
        messages.set_status(connection, message.message_id, status, now, last_error=why)
        dead_letters.resolve_for_messages(
            connection, [message.message_id], status=letter_status, run_id=run_id, now=now
        )
        self.message_log.info(
            f"not sent: {status}", **message_fields(message, run_id=run_id, status=status)
        )

    def dead_letter_for(
        self,
        connection: Any,
        message: Row,
        error: DeliveryError,
        *,
        run_id: str,
        now: datetime,
        trace: Any = None,
    ) -> None:
        """``dead_letter`` with the reason, text and code of a classified error."""
        self.dead_letter(
            connection,
            message,
            error.reason,
            str(error),
            code=error.code,
            run_id=run_id,
            now=now,
            trace=trace,
        )

    def dead_letter(
        self,
        connection: Any,
        message: Row,
        reason: str,
        error: str,
        *,
        code: str | None,
        run_id: str,
        now: datetime,
        trace: Any = None,
    ) -> None:
        """Dead-letter ``message``; ``trace`` (its outbox row, or its ``OutgoingEmail``) puts the
        event's trace and correlation ids on the log line."""
        messages.set_status(connection, message.message_id, messages.DEAD, now, last_error=error)
        # A replay that failed again: its letter replaces the one it replayed (one open letter
        # per message, so a listing or a second replay counts it once).
        dead_letters.resolve_for_messages(
            connection, [message.message_id], status=dead_letters.REPLAYED, run_id=run_id, now=now
        )
        dead_letters.add(
            connection,
            {
                "event_id": message.event_id,
                "message_id": message.message_id,
                "lane": message.lane,
                "reason": reason,
                "error_code": code,
                "last_error": error,
                "attempts": message.attempts,
                "run_id": run_id,
                "created_at": now,
            },
        )
        self.log.error(
            f"event_id={message.event_id}{tracing.log_fields(trace)} "
            f"message={message.message_id} dead-lettered ({reason}): "
            f"{loggable(error, message.recipient)}",
            **message_fields(message, trace, run_id=run_id, reason=reason, error_code=code),
        )

    def dead_letter_event(
        self, connection: Any, event: Row, error: DeliveryError, run_id: str, now: datetime
    ) -> None:
        dead_letters.add(
            connection,
            {
                "event_id": event.event_id,
                "message_id": None,
                "lane": event.lane,
                "reason": error.reason,
                "error_code": error.code,
                "last_error": str(error),
                "attempts": 0,
                "run_id": run_id,
                "created_at": now,
            },
        )
        outbox.finish(
            connection, [event.event_id], status=outbox.DEAD, resolution=error.reason, now=now
        )
        self.log.error(
            f"event_id={event.event_id}{tracing.log_fields(event)} "
            f"dead-lettered ({error.reason}): {loggable(str(error))}",
            **logs.fields(
                event_id=event.event_id,
                run_id=run_id,
                reason=error.reason,
                error_code=error.code,
                **logs.trace_fields(event),
            ),
        )

    def crash_loop(
        self,
        connection: Any,
        event: Row,
        existing: dict[tuple[str, str], Row],
        run_id: str,
        now: datetime,
    ) -> None:
        pending = [
            m
            for (eid, _), m in existing.items()
            if eid == event.event_id and m.status == messages.PENDING
        ]
        error = f"claimed {event.claim_count} times without finishing (runs kept dying)"
        for message in pending:
            self.dead_letter(
                connection,
                message,
                "claim_limit",
                error,
                code="claim_limit",
                run_id=run_id,
                now=now,
                trace=event,
            )
        if not pending:
            self.dead_letter_event(
                connection, event, PermanentError(error, code="claim_limit"), run_id, now
            )
        else:
            outbox.finish(
                connection, [event.event_id], status=outbox.DEAD, resolution="claim_limit", now=now
            )

    def give_up(self, message_ids: Sequence[int], *, run_id: str) -> int:
        """Retries are exhausted: every still-pending message becomes a dead letter."""
        now = utcnow()
        count = 0
        event_ids: set[str] = set()
        with self.engine.begin() as connection:
            pending = [messages.get(connection, message_id) for message_id in message_ids]
            pending = [m for m in pending if m is not None and m.status == messages.PENDING]
            # For the log lines: the events' trace and correlation ids (one query).
            traces = outbox.trace_fields(connection, [m.event_id for m in pending])
            for message in pending:
                self.dead_letter(
                    connection,
                    message,
                    "retries_exhausted",
                    message.last_error or "transient failures until retries ran out",
                    code="retries_exhausted",
                    run_id=run_id,
                    now=now,
                    trace=traces.get(message.event_id),
                )
                event_ids.add(message.event_id)
                count += 1
        if event_ids:
            with self.engine.begin() as connection:
                self.settle(connection, sorted(event_ids), run_id, utcnow())
        return count

    def finish_events(
        self,
        claimed: Sequence[Row],
        run_id: str,
        outcome: BatchOutcome,
        *,
        hold_retries: bool = True,
    ) -> None:
        """Settle the batch's events. ``hold_retries``: lease what waits for a retry across the
        longest wait (a batch run's next attempt is a new step, and nothing renews meanwhile)."""
        with self.engine.begin() as connection:
            still_in_flight = self.settle(
                connection, [e.event_id for e in claimed], run_id, utcnow()
            )
            if still_in_flight and hold_retries:
                # Hold the claim across the retry wait, so no other run takes these events.
                wait_s = self.lane.max_retry_delay_s + self.lane.lease_s
                outbox.extend_lease(
                    connection, still_in_flight, run_id, utcnow() + timedelta(seconds=wait_s)
                )

    def settle(
        self, connection: Any, event_ids: Sequence[str], run_id: str, now: datetime
    ) -> list[str]:
        """Close every event whose messages are all terminal; return those still in flight."""
        by_event: dict[str, list[str]] = {eid: [] for eid in event_ids}
        for event_id, status in messages.statuses_for_events(connection, list(event_ids)):
            by_event[event_id].append(status)
        in_flight: list[str] = []
        done: dict[str, list[str]] = {}
        dead: list[str] = []
        for event_id, statuses in by_event.items():
            if not statuses:
                continue  # ignored or dead-lettered as an event: already finished
            if any(s not in messages.TERMINAL for s in statuses):
                in_flight.append(event_id)
            elif messages.DEAD in statuses:
                dead.append(event_id)
            else:
                resolution = messages.SENT if messages.SENT in statuses else statuses[0]
                done.setdefault(resolution, []).append(event_id)
        for resolution, ids in done.items():
            outbox.finish(connection, ids, status=outbox.DONE, resolution=resolution, now=now)
        if dead:
            outbox.finish(connection, dead, status=outbox.DEAD, resolution="dead_letter", now=now)
        return in_flight
