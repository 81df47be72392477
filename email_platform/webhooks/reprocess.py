"""``webhooks reprocess``: normalize stored webhooks again, after a mapping fix.

Re-normalizing must leave the suppressions the current mapping implies, no more and no fewer.
In one transaction, so no send sees the address half-judged:

1. the events the old mapping made from these webhooks are deleted (the warehouse hears of it
   through ``email_event_deletions``);
2. each suppression those events could have written - a plain row whose source is their
   provider's webhook and whose event id is theirs (or none) - is judged again from what is
   left: the other stored events to that address, and the suppression made outside webhooks
   (a one-click unsubscribe) that a webhook's stronger reason replaced. Nothing left: the row
   is withdrawn; else it takes the strongest reason left, weaker or not;
3. the stored bodies are normalized with the current mapping and their suppressions added
   exactly as ingestion adds them (``ingest.implied_suppression``);
4. the webhooks are queued: the inbox sensor's ingestion rebuilds their events (its
   suppressions are then already there).

Rows an operator, erasure (hashed) or another provider's webhook wrote are never judged here;
``suppressions.add`` only ever strengthens them.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Row

from email_platform.common.timeutil import utcnow
from email_platform.store import email_events, inbox, messages, suppressions
from email_platform.webhooks import registry
from email_platform.webhooks.ingest import Suppression, implied_suppression, recipient_of
from email_platform.webhooks.vocabulary import combine, suppression_for

_CHUNK = 500


@dataclass
class ReprocessOutcome:
    queued: int = 0
    events_dropped: int = 0
    #: Suppressions the old mapping wrote that nothing stored asks for any more.
    withdrawn: int = 0
    #: Suppressions kept under another reason or source than before.
    changed: int = 0
    #: Suppressions the current mapping asks for that were not there.
    added: int = 0

    def as_metadata(self) -> dict[str, int]:
        return dict(self.__dict__)


def reprocess(
    engine: Engine,
    *,
    since: datetime | None = None,
    providers: Mapping[str, registry.WebhookProvider] | None = None,
    now: datetime | None = None,
) -> ReprocessOutcome:
    """Re-judge and queue every processed, failed or malformed webhook received since
    ``since`` (all of them when None)."""
    found = dict(providers if providers is not None else registry.available())
    now = now or utcnow()
    outcome = ReprocessOutcome()
    with engine.begin() as connection:
        ids = inbox.reprocessable_ids(connection, since=since)
        old = email_events.for_inbox_rows(connection, ids)
        wanted: list[Suppression] = []
        for start in range(0, len(ids), _CHUNK):
            wanted.extend(
                _implied(connection, inbox.for_ids(connection, ids[start : start + _CHUNK]), found)
            )
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            outcome.events_dropped += email_events.delete_for_inbox_rows(connection, chunk)
        touched = {suppressions.normalize(w.address) for w in wanted}
        touched.update(suppressions.normalize(e.recipient) for e in old if e.recipient)
        before = _state(connection, touched)
        _withdraw(connection, old, wanted)
        for w in wanted:
            suppressions.add(
                connection,
                w.address,
                reason=w.reason,
                source=w.source,
                now=now,
                event_id=w.event_id,
            )
        after = _state(connection, touched)
        outcome.withdrawn = len(before.keys() - after.keys())
        outcome.added = len(after.keys() - before.keys())
        outcome.changed = sum(1 for a in before.keys() & after.keys() if before[a] != after[a])
        _restate(connection, {row.message_id for row in old if row.message_id is not None}, now)
        for start in range(0, len(ids), _CHUNK):
            outcome.queued += inbox.requeue(connection, ids[start : start + _CHUNK])
    return outcome


def _state(connection: Connection, addresses: Iterable[str]) -> dict[str, tuple[str, str]]:
    rows = suppressions.plain_rows(connection, addresses)
    return {address: (row.reason, row.source) for address, row in rows.items()}


def _implied(
    connection: Connection,
    rows: Sequence[Row],
    providers: Mapping[str, registry.WebhookProvider],
) -> list[Suppression]:
    """What the current mapping makes these stored bodies suppress, as ingestion will."""
    wanted: list[Suppression] = []
    for row in rows:
        provider = providers.get(row.provider)
        if provider is None:
            continue
        try:
            events: list[Any] = provider.normalize(row.body.encode("utf-8"))
        except Exception:  # ingestion marks it malformed, with the reason, as it would anyway
            continue
        for event in events:
            suppression = implied_suppression(event, recipient_of(connection, event))
            if suppression is not None:
                wanted.append(suppression)
    return wanted


def _withdraw(connection: Connection, old: Sequence[Row], wanted: Sequence[Suppression]) -> None:
    """Judge again each suppression the deleted events ``old`` could have written, from the
    evidence left and what the current mapping asks for (so a row still asked for is kept
    in place, its ``created_at`` too)."""
    written: dict[str, list[Row]] = {}
    for event in old:
        if event.recipient:
            written.setdefault(suppressions.normalize(event.recipient), []).append(event)
    candidates = {
        address: row
        for address, row in suppressions.plain_rows(connection, written).items()
        if _written_by(row, written[address])
    }
    if not candidates:
        return
    left: dict[str, list[tuple[str, str, str | None]]] = {a: [] for a in candidates}
    for event in email_events.suppressing_for(connection, sorted(candidates)):
        reason = suppression_for(event.event_type, event.bounce_type)
        if reason is not None:
            source = suppressions.WEBHOOK + event.provider
            left[suppressions.normalize(event.recipient)].append((reason, source, event.event_id))
    for w in wanted:
        address = suppressions.normalize(w.address)
        if address in left:
            left[address].append((w.reason, w.source, w.event_id))
    for address, row in candidates.items():
        origin = suppressions.origin_of(row.reason, row.source)
        options = list(left[address])
        if origin is not None:
            options.append((origin[0], origin[1], None))
        if not options:
            suppressions.replace(connection, address, reason=None, source="", event_id=None)
            continue
        strongest = max(suppressions.STRENGTH.get(o[0], 0) for o in options)
        # The row's own writer first among equals: nothing changes that need not.
        options.sort(
            key=lambda o: (o[0], o[1]) != (row.reason, suppressions.top_source(row.source))
        )
        reason, source, event_id = next(
            o for o in options if suppressions.STRENGTH.get(o[0], 0) == strongest
        )
        if origin is not None and (reason, source) != origin:
            source = suppressions.with_origin(source, origin)  # still kept under the webhook's
        if (reason, source) != (row.reason, row.source):
            suppressions.replace(
                connection, address, reason=reason, source=source, event_id=event_id
            )


def _written_by(row: Row, events: Iterable[Row]) -> bool:
    """Whether one of ``events`` could have written ``row``: its provider's webhook is the
    row's source and the row names its event (or none, as a body without our ids does)."""
    source = suppressions.top_source(row.source)
    return any(
        source == suppressions.WEBHOOK + event.provider
        and (row.event_id is None or row.event_id == event.event_id)
        for event in events
    )


def _restate(connection: Connection, message_ids: Iterable[int], now: datetime) -> None:
    """Each message's delivery state from the events left (ingestion recomputes it again
    from the new events; this covers a message the new mapping gives none)."""
    for message_id in sorted(message_ids):
        current = messages.lock_delivery_status(connection, message_id)
        state = None
        for kind in email_events.types_for_message(connection, message_id):
            state = combine(state, kind)
        if state is not None and state != current:
            messages.set_delivery_status(connection, message_id, state, now)
