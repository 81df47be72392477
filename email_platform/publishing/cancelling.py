"""``cancel()``: take back an event that should no longer be sent, in the caller's transaction.

Only an event no run holds is cancelled, pending or dead (``store.outbox.cancels``): the cancel
and a worker's claim exclude each other, so an event is never both cancelled and sent. A dead
event's open dead letters are discarded with it, so neither ``dlq replay`` nor re-executing its
failed run sends it afterwards. An event a
run holds right now is reported ``in_flight`` (it may be sent; cancel again once it settles to
learn how it ended); mail the provider accepted is reported ``already_sent`` with its messages,
never as cancelled.
"""

from dataclasses import dataclass, replace
from enum import StrEnum

from sqlalchemy import Connection

from email_platform.common.errors import PublishError
from email_platform.common.timeutil import utcnow
from email_platform.publishing import validation
from email_platform.store import dead_letters, messages, outbox
from email_platform.store.outbox import cancels

#: The last_error of a message whose event a producer cancelled.
CANCELLED_MESSAGE_REASON = "cancelled: the producer cancelled its event"


class CancelStatus(StrEnum):
    #: Was pending (or dead, waiting for a replay), now cancelled: nothing of it will be sent.
    CANCELLED = "cancelled"
    #: Was pending or dead and is now cancelled, but an earlier run had already had some of
    #: its messages accepted by the provider (``sent_messages``): those went out.
    PARTLY_SENT = "partly_sent"
    #: Finished, and the provider accepted at least one of its messages (``sent_messages``).
    ALREADY_SENT = "already_sent"
    #: Finished without a send: suppressed, expired, duplicate, unrouted, cancelled or erased
    #: before (``event_status`` and ``resolution`` say which).
    ALREADY_FINISHED = "already_finished"
    #: A run holds it right now: it may be sent. Nothing was changed.
    IN_FLIGHT = "in_flight"
    #: No event has this id or idempotency key.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class SentMessage:
    """A message of the event that the provider accepted."""

    message_id: int
    route: str
    provider: str | None
    provider_message_id: str | None


@dataclass(frozen=True)
class CancelResult:
    """What ``cancel()`` found and did for one event."""

    status: CancelStatus
    #: None only when nothing matched (``UNKNOWN``).
    event_id: str | None
    #: The event's outbox status after the call (``cancelled``, ``done``, ``in_flight``, ...).
    event_status: str | None = None
    resolution: str | None = None
    #: The run that holds an ``IN_FLIGHT`` event.
    claimed_by: str | None = None
    sent_messages: tuple[SentMessage, ...] = ()
    #: Messages cancelled now that an earlier run had tried to send: an attempt whose answer
    #: was lost may have been accepted (docs/design.md, invariant 3).
    attempted_messages: tuple[int, ...] = ()

    @property
    def cancelled(self) -> bool:
        """Whether this call cancelled the event (what had not gone out will not)."""
        return self.status in (CancelStatus.CANCELLED, CancelStatus.PARTLY_SENT)

    def describe(self) -> str:
        """One line for people: what happened to this event."""
        sent = ", ".join(
            f"message {m.message_id} ({m.route}, {m.provider} {m.provider_message_id})"
            for m in self.sent_messages
        )
        match self.status:
            case CancelStatus.CANCELLED:
                note = (
                    f"; messages {list(self.attempted_messages)} had been attempted: an attempt "
                    "whose answer was lost may have been accepted"
                    if self.attempted_messages
                    else ""
                )
                return f"{self.event_id}: cancelled{note}"
            case CancelStatus.PARTLY_SENT:
                return f"{self.event_id}: cancelled the rest; already accepted: {sent}"
            case CancelStatus.ALREADY_SENT:
                return f"{self.event_id}: already sent, not cancelled: accepted {sent}"
            case CancelStatus.ALREADY_FINISHED:
                return (
                    f"{self.event_id}: already finished ({self.event_status}, "
                    f"{self.resolution}), nothing sent, nothing to cancel"
                )
            case CancelStatus.IN_FLIGHT:
                return (
                    f"{self.event_id}: in flight in run {self.claimed_by}, may be sent; "
                    "not cancelled (cancel again once it settles to learn how it ended)"
                )
        return "unknown event: nothing cancelled"


def cancel(
    connection: Connection, *, event_id: str | None = None, idempotency_key: str | None = None
) -> CancelResult:
    """Cancel the event ``event_id``, or the one published with ``idempotency_key``.

    Runs in the caller's transaction and never commits (like ``publish()``): the cancel
    holds exactly when that transaction commits, so "refund the order and cancel its receipt"
    is one unit. Exactly one of the two keywords. On PostgreSQL the transaction must be READ
    COMMITTED (the default) or the caller must expect serialization failures.
    """
    if (event_id is None) == (idempotency_key is None):
        raise TypeError("cancel() takes exactly one of event_id= or idempotency_key=")
    given = event_id if event_id is not None else idempotency_key
    if not isinstance(given, str):
        raise TypeError(f"cancel(): expected a str, got {type(given).__name__}")
    if not _could_name_an_event(given, by_key=idempotency_key is not None):
        # publish() never stores such a value (NUL, lone surrogates, too long): no event has it,
        # and it goes to no database driver, which might refuse it with an error of its own.
        return CancelResult(CancelStatus.UNKNOWN, None)
    if idempotency_key is not None:
        event_id = outbox.first_events_with_keys(connection, [idempotency_key]).get(idempotency_key)
        if event_id is None:
            return CancelResult(CancelStatus.UNKNOWN, None)
    assert event_id is not None
    now = utcnow()
    # The write comes first: it is the decision, and it takes SQLite's write lock at once.
    won = cancels.cancel_if_unsent(connection, event_id, now)
    state = cancels.state_of(connection, event_id)
    if state is None:
        return CancelResult(CancelStatus.UNKNOWN, event_id)
    rows = messages.for_events(connection, [event_id])
    sent = tuple(
        SentMessage(m.message_id, m.route, m.provider, m.provider_message_id)
        for m in rows
        if m.status == messages.SENT
    )
    found = CancelResult(
        CancelStatus.UNKNOWN,
        event_id,
        event_status=state.status,
        resolution=state.resolution,
        sent_messages=sent,
    )
    if won:
        # Messages an earlier run made and gave back (its run died): cancelled with the event.
        pending = [m for m in rows if m.status == messages.PENDING]
        messages.cancel_pending(
            connection, [m.message_id for m in pending], now, CANCELLED_MESSAGE_REASON
        )
        # A dead event's letters (or a replayed one's, still open until it sends): nothing left
        # for an operator to replay.
        dead_letters.resolve_for_events(
            connection,
            [event_id],
            status=dead_letters.DISCARDED,
            run_id=None,
            now=now,
            only_without_message=False,
        )
        return replace(
            found,
            status=CancelStatus.PARTLY_SENT if sent else CancelStatus.CANCELLED,
            attempted_messages=tuple(m.message_id for m in pending if m.attempts),
        )
    if state.status == outbox.IN_FLIGHT:
        return replace(found, status=CancelStatus.IN_FLIGHT, claimed_by=state.claimed_by)
    if sent:
        return replace(found, status=CancelStatus.ALREADY_SENT)
    return replace(found, status=CancelStatus.ALREADY_FINISHED)


def _could_name_an_event(value: str, *, by_key: bool) -> bool:
    """Whether ``value`` is an event id (a ULID: 26 letters and digits) or a key ``publish()``
    accepts; anything else names no event."""
    if not by_key:
        return len(value) == 26 and value.isascii() and value.isalnum()
    try:
        validation.check_idempotency_key(value)
    except PublishError:
        return False
    return True
