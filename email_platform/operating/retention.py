"""Retention: delete finished operational rows past their retention, in bounded batches, and
close dead letters whose mail can no longer be sent (past its time to live).

What goes, each row only once it is old enough (``config.RetentionSettings``):
- resolved dead letters (replayed, discarded, expired, suppressed);
- finished outbox events (done, dead, cancelled) with their messages, attempts and provider
  events, children first (attempts -> messages -> outbox: foreign keys). An event is kept while
  one of its dead letters is kept, and (by default) while its message holds a route's dedupe key;
- provider events whose message and event are both gone, or were never known;
- processed raw webhooks, and old records of deleted provider events.

Never touched: pending or in-flight events, open dead letters, unprocessed or malformed
webhooks, suppressions. Each batch is one transaction of at most ``batch_size`` events (with
their rows) or rows, so a year of backlog never holds one long lock, and a purge stopped
midway leaves every remaining row whole.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine

from email_platform.common import config
from email_platform.common.config import RetentionSettings
from email_platform.common.timeutil import utcnow
from email_platform.store import attempts, dead_letters, email_events, inbox, messages, outbox

#: The tables the purge deletes from, in the order it reports them.
TABLES = (
    "dead_letters",
    "email_attempts",
    "email_events",
    "email_messages",
    "email_outbox",
    "webhook_inbox",
    "email_event_deletions",
)
#: At most this many ids go into one statement (SQLite allows 32,766 bound values).
_CHUNK = 5000


@dataclass
class PurgeReport:
    """What a purge deleted (or, dry, would delete): rows per table, and dead letters the
    expiry sweep closed first."""

    dry_run: bool
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    expired_dead_letters: int = 0
    batches: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        return {**self.counts, "dead_letters_expired": self.expired_dead_letters}


@dataclass(frozen=True)
class Cutoffs:
    """Rows finished before these moments are past their retention."""

    events: datetime
    dead_letters: datetime
    webhook_inbox: datetime
    dedupe: datetime | None

    @classmethod
    def of(cls, settings: RetentionSettings, now: datetime) -> "Cutoffs":
        return cls(
            events=now - timedelta(days=settings.events_days),
            dead_letters=now - timedelta(days=settings.dead_letters_days),
            webhook_inbox=now - timedelta(days=settings.webhook_inbox_days),
            dedupe=None
            if settings.dedupe_days is None
            else now - timedelta(days=settings.dedupe_days),
        )

    def events_query(self) -> Any:
        return outbox.purgeable_query(
            finished_before=self.events,
            letters_resolved_before=self.dead_letters,
            dedupe_before=self.dedupe,
        )


def purge(
    engine: Engine,
    settings: RetentionSettings | None = None,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
    log: Callable[[str], None] | None = None,
) -> PurgeReport:
    """Sweep expired dead letters, then delete what is past its retention (see the module).

    ``dry_run`` counts what would go and changes nothing. ``log`` gets a line per table.
    """
    settings = settings or config.retention_settings()
    now = now or utcnow()
    cutoffs = Cutoffs.of(settings, now)
    if dry_run:
        report = _count(engine, cutoffs, now)
    else:
        report = PurgeReport(dry_run=False)
        report.expired_dead_letters = expire_dead_letters(
            engine, now=now, batch_size=settings.batch_size
        )
        _delete(engine, cutoffs, settings.batch_size, report)
    if log is not None:
        verb = "would delete" if dry_run else "deleted"
        for table, count in report.counts.items():
            log(f"retention: {verb} {count} row(s) from {table}")
        log(f"retention: {report.expired_dead_letters} dead letter(s) past their expiry")
    return report


def _count(engine: Engine, cutoffs: Cutoffs, now: datetime) -> PurgeReport:
    report = PurgeReport(dry_run=True)
    events = cutoffs.events_query()
    with engine.connect() as connection:
        report.expired_dead_letters = dead_letters.count_past_expiry(connection, now)
        report.counts.update(
            dead_letters=dead_letters.count_resolved(
                connection, resolved_before=cutoffs.dead_letters
            ),
            email_attempts=attempts.count_for_events(connection, events),
            email_events=email_events.count_for_events(
                connection, events, messages.ids_query(events)
            )
            + email_events.count_of(connection, email_events.orphans_query(cutoffs.events)),
            email_messages=messages.count_for_events(connection, events),
            email_outbox=outbox.count_of(connection, events),
            webhook_inbox=inbox.count_processed(connection, received_before=cutoffs.webhook_inbox),
            email_event_deletions=email_events.count_deletion_records(
                connection, deleted_before=cutoffs.webhook_inbox
            ),
        )
    return report


def _delete(engine: Engine, cutoffs: Cutoffs, batch_size: int, report: PurgeReport) -> None:
    counts = report.counts

    def batches(table: str, one_batch: Callable[[Connection], int]) -> None:
        while True:
            with engine.begin() as connection:
                deleted = one_batch(connection)
            report.batches += 1
            counts[table] += deleted
            if deleted < batch_size:
                return

    # Letters first: an event waits for its last kept letter (outbox.purgeable_query).
    batches(
        "dead_letters",
        lambda c: dead_letters.delete_resolved(
            c, resolved_before=cutoffs.dead_letters, limit=batch_size
        ),
    )
    events = cutoffs.events_query()
    batches("email_outbox", lambda c: _delete_events(c, events, batch_size, counts))
    batches(
        "email_events",
        lambda c: email_events.delete_orphans(c, cutoffs.events, batch_size),
    )
    batches(
        "webhook_inbox",
        lambda c: inbox.delete_processed(
            c, received_before=cutoffs.webhook_inbox, limit=batch_size
        ),
    )
    batches(
        "email_event_deletions",
        lambda c: email_events.delete_deletion_records(
            c, deleted_before=cutoffs.webhook_inbox, limit=batch_size
        ),
    )


def _delete_events(
    connection: Connection, events: Any, batch_size: int, counts: dict[str, int]
) -> int:
    """One batch of events and everything that hangs off them; returns the events deleted."""
    deleted = 0
    for chunk in _chunks(outbox.purgeable_ids(connection, events, batch_size)):
        message_ids = messages.ids_for_events(connection, chunk)
        counts["email_events"] += email_events.delete_for(connection, chunk, message_ids)
        counts["email_attempts"] += attempts.delete_for_messages(connection, message_ids)
        counts["email_messages"] += messages.delete_for_events(connection, chunk)
        deleted += outbox.delete_events(connection, chunk)
    return deleted


def expire_dead_letters(
    engine: Engine,
    *,
    now: datetime | None = None,
    dead_letter_ids: Sequence[int] | None = None,
    run_id: str | None = None,
    batch_size: int = 5000,
) -> int:
    """Close open dead letters whose message is past its ``expires_at`` as ``expired``, as a
    replay of them would: the message becomes ``expired`` and an event left with nothing
    dead or open becomes ``done``. Only ``dead_letter_ids`` if given. Returns how many."""
    now = now or utcnow()
    total = 0
    while True:
        with engine.begin() as connection:
            rows = dead_letters.open_past_expiry(
                connection, now, ids=dead_letter_ids, limit=batch_size
            )
            messages.expire_dead(
                connection,
                [(r.message_id, r.expires_at) for r in rows if r.message_id is not None],
                now,
            )
            total += dead_letters.mark_expired(
                connection, [r.dead_letter_id for r in rows], now, run_id
            )
            _settle(connection, sorted({r.event_id for r in rows}), now)
        if len(rows) < batch_size:
            return total


def _settle(connection: Connection, event_ids: list[str], now: datetime) -> None:
    """Dead events of expired letters: done once nothing of theirs is dead or open (the
    resolution the send path would give them: sent if one message was, else the first
    message's end, or expired for an event that failed before any message existed)."""
    still_open = dead_letters.events_with_open_letters(connection, event_ids)
    statuses: dict[str, list[str]] = {event_id: [] for event_id in event_ids}
    for message in messages.for_events(connection, event_ids):
        statuses[message.event_id].append(message.status)
    by_resolution: dict[str, list[str]] = {}
    for event_id, ended in statuses.items():
        if event_id in still_open or any(s not in messages.TERMINAL for s in ended):
            continue
        if messages.DEAD in ended:
            continue
        resolution = messages.SENT if messages.SENT in ended else (ended or [messages.EXPIRED])[0]
        by_resolution.setdefault(resolution, []).append(event_id)
    for resolution, ids in by_resolution.items():
        outbox.finish_dead(connection, ids, resolution=resolution, now=now)


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[start : start + _CHUNK] for start in range(0, len(items), _CHUNK)]
