"""The send path without Dagster: claim a batch, route, render, send, record every outcome.

``BatchSender.run`` is what one attempt of the send op does. It commits each decision as soon
as it is made, so a crash at any point loses no outcome that was already known, and the next
attempt (same run, a re-execution, or another run after the lease expires) redoes only what is
still pending, under the idempotency key that was committed before the first provider call.
"""

import logging
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from queue import Empty, SimpleQueue
from typing import Any

from sqlalchemy import Engine, Row

from email_platform.classify import classify_exception, is_transient
from email_platform.errors import (
    ConfigurationError,
    DeliveryError,
    PermanentError,
    RecipientNotFoundError,
    TemplateRenderError,
    TransientError,
    UnknownEventVersionError,
)
from email_platform.lanes import LaneConfig
from email_platform.providers.base import (
    Accepted,
    BatchingProvider,
    EmailProvider,
    OutgoingEmail,
)
from email_platform.recipients import RecipientResolver
from email_platform.rendering import TemplateRenderer
from email_platform.routes import Route, RouteTable
from email_platform.store import attempts, dead_letters, messages, outbox, suppressions
from email_platform.timeutil import as_utc, utcnow

# A run that keeps dying on the same events must not loop forever.
MAX_CLAIMS = 5
# Most send outcomes recorded in one transaction. Outcomes arrive in calls of up to 100, and
# each transaction costs three statements and a commit whatever its size: a lane worker drained
# 20k events at 3,014 emails/s with groups of up to 1,000 against 2,803 with 200 (median of 2).
RECORD_GROUP_MAX = 1000
_HARD_SUPPRESSIONS = {suppressions.HARD_BOUNCE, suppressions.COMPLAINT, suppressions.MANUAL}


@dataclass
class BatchOutcome:
    requested: int = 0
    claimed: list[str] = field(default_factory=list)
    sent: int = 0
    suppressed: int = 0
    expired: int = 0
    duplicate: int = 0
    dead: int = 0
    ignored: int = 0
    #: Messages that failed transiently this attempt and are still pending.
    transient: list[int] = field(default_factory=list)
    #: Largest Retry-After among the transient failures, if any provider gave one.
    retry_after_s: float | None = None

    @property
    def skipped(self) -> int:
        """Requested events this run did not get: done already, or held by another run."""
        return self.requested - len(self.claimed)

    def as_metadata(self) -> dict[str, int]:
        return {
            "requested": self.requested,
            "claimed": len(self.claimed),
            "skipped": self.skipped,
            "sent": self.sent,
            "suppressed": self.suppressed,
            "expired": self.expired,
            "duplicate": self.duplicate,
            "dead_lettered": self.dead,
            "ignored": self.ignored,
            "transient": len(self.transient),
        }


@dataclass
class _Work:
    """One message to hand to the provider in this attempt."""

    message: Row
    email: OutgoingEmail


@dataclass
class _Sent:
    """What one provider call came back with."""

    item: _Work
    started: datetime
    result: Accepted | DeliveryError | ConfigurationError


def _next_group(done: SimpleQueue[_Sent | None], running: int) -> tuple[list[_Sent], int]:
    """Wait for the next outcome, then take every one already waiting (at most a group's worth).

    Returns the outcomes and how many of the ``running`` workers said they finished. Sends keep
    completing while a group commits, so groups grow with the send rate on their own: one
    commit records many sends, and no outcome waits for its commit longer than the previous
    commit took.
    """
    group: list[_Sent] = []
    exited = 0
    sent = done.get()
    while True:
        if sent is None:
            exited += 1
        else:
            group.append(sent)
        if exited == running or len(group) >= RECORD_GROUP_MAX:
            return group, exited
        try:
            sent = done.get_nowait()
        except Empty:
            return group, exited


def _take(todo: SimpleQueue[_Work | None], count: int) -> tuple[list[_Work], bool]:
    """Up to ``count`` queued messages, and whether this worker's end marker came with them.

    The queue is filled before the workers start, with one end marker per worker after the
    messages, so a worker never waits here for more than the queue's lock.
    """
    items: list[_Work] = []
    while len(items) < count:
        item = todo.get()
        if item is None:
            return items, True
        items.append(item)
    return items, False


@dataclass
class ClaimedBatch:
    """Events claimed by one run and their messages, prepared and not yet sent."""

    outcome: BatchOutcome
    events: Sequence[Row]
    work: list[_Work]


class BatchSender:
    def __init__(
        self,
        *,
        engine: Engine,
        provider: EmailProvider,
        renderer: TemplateRenderer,
        routes: RouteTable,
        resolver: RecipientResolver,
        lane: LaneConfig,
        sender_address: str,
        log: logging.Logger | Any | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.engine = engine
        self.provider = provider
        self.renderer = renderer
        self.routes = routes
        self.resolver = resolver
        self.lane = lane
        self.sender_address = sender_address
        self.log = log or logging.getLogger(__name__)
        #: Set when the run is asked to stop: no new provider call starts, the ones in flight
        #: are recorded, and what was not sent stays pending under its key.
        self.cancel = cancel or threading.Event()
        self._threads: futures.ThreadPoolExecutor | None = None

    # ---- one attempt -------------------------------------------------------------------------

    def run(
        self,
        event_ids: Sequence[str],
        *,
        run_id: str,
        previous_owners: Sequence[str] = (),
        replay: bool = False,
    ) -> BatchOutcome:
        return self.deliver(
            self.claim(event_ids, run_id=run_id, previous_owners=previous_owners, replay=replay),
            run_id=run_id,
        )

    def claim(
        self,
        event_ids: Sequence[str],
        *,
        run_id: str,
        previous_owners: Sequence[str] = (),
        replay: bool = False,
    ) -> ClaimedBatch:
        """Claim ``event_ids`` and prepare their messages (keys committed), sending nothing.

        ``deliver`` sends what this returns. A lane worker claims and prepares its next batch
        while the current one is being sent.
        """
        outcome = BatchOutcome(requested=len(event_ids))
        now = utcnow()
        with self.engine.begin() as connection:
            claimed = outbox.claim(
                connection,
                event_ids,
                run_id=run_id,
                previous_owners=previous_owners,
                lease_s=self.lane.lease_s,
                now=now,
                include_dead=replay,
            )
            if replay:
                # Only what still has an open dead letter: a discarded one stays dead.
                reopen = dead_letters.open_message_ids(connection, [e.event_id for e in claimed])
                messages.reopen(connection, reopen, now)
        outcome.claimed = [event.event_id for event in claimed]
        if not claimed:
            return ClaimedBatch(outcome, claimed, [])
        return ClaimedBatch(outcome, claimed, self._prepare(claimed, run_id, outcome, replay))

    def deliver(self, batch: ClaimedBatch, *, run_id: str) -> BatchOutcome:
        """Send a claimed batch's messages, record every outcome, settle its events."""
        if batch.events:
            self._send_all(batch.work, run_id, batch.outcome)
            self._finish_events(batch.events, run_id, batch.outcome)
        return batch.outcome

    def give_up(self, message_ids: Sequence[int], *, run_id: str) -> int:
        """Retries are exhausted: every still-pending message becomes a dead letter."""
        now = utcnow()
        count = 0
        event_ids: set[str] = set()
        with self.engine.begin() as connection:
            for message_id in message_ids:
                message = messages.get(connection, message_id)
                if message is None or message.status != messages.PENDING:
                    continue
                self._dead_letter(
                    connection,
                    message,
                    "retries_exhausted",
                    message.last_error or "transient failures until retries ran out",
                    code="retries_exhausted",
                    run_id=run_id,
                    now=now,
                )
                event_ids.add(message.event_id)
                count += 1
        if event_ids:
            with self.engine.begin() as connection:
                self._settle(connection, sorted(event_ids), run_id, utcnow())
        return count

    # ---- preparation: route, dedupe, recipient, expiry, suppression, render ----------------

    def _prepare(
        self, claimed: Sequence[Row], run_id: str, outcome: BatchOutcome, replay: bool
    ) -> list[_Work]:
        lookups = self._look_up_recipients(claimed)
        now = utcnow()
        work: list[_Work] = []
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
                    self._crash_loop(connection, event, existing, run_id, now)
                    outcome.dead += 1
                    continue
                try:
                    version, payload = self.routes.upcast(
                        event.event_type, event.event_version, dict(event.payload)
                    )
                except UnknownEventVersionError as error:
                    self._dead_letter_event(connection, event, error, run_id, now)
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
            for event, route, payload, message in planned:
                if message is None:
                    message = next(created)
                if message.status == messages.DUPLICATE:
                    outcome.duplicate += 1
                elif message.status == messages.DEAD:
                    outcome.dead += 1
                elif message.status == messages.PENDING:
                    pending.append((event, message, route, payload))

            reasons = suppressions.reasons_for(
                connection, [m.recipient for _, m, _, _ in pending if m.recipient]
            )
            for event, message, route, payload in pending:
                expires_at = as_utc(message.expires_at)
                if expires_at is not None and expires_at <= now:
                    self._close_unsent(
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
                if reason and (reason in _HARD_SUPPRESSIONS or not route.bypass_unsubscribe):
                    self._close_unsent(
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
                    rendered = self.renderer.render(
                        route.template, message.template_version, payload
                    )
                except TemplateRenderError as error:
                    self._dead_letter(
                        connection,
                        message,
                        error.reason,
                        str(error),
                        code=error.code,
                        run_id=run_id,
                        now=now,
                    )
                    outcome.dead += 1
                    continue
                work.append(
                    _Work(
                        message,
                        OutgoingEmail(
                            message_id=message.message_id,
                            event_id=event.event_id,
                            idempotency_key=message.idempotency_key,
                            sender=self.sender_address,
                            to=message.recipient,
                            subject=rendered.subject,
                            text=rendered.text,
                            html=rendered.html,
                            template=route.template,
                            lane=self.lane.lane.value,
                            headers={"X-Email-Event-Id": event.event_id},
                        ),
                    )
                )
        return work

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
            except UnknownEventVersionError:
                continue
            for route in self.routes.for_event(event.event_type, version):
                key = payload.get(route.recipient_lookup_field or "")
                if route.recipient_lookup_field and key is not None:
                    keys.add(str(key))
        return {key: self.resolver.lookup(key) for key in sorted(keys)}

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
        for message, (_, failure) in zip(rows, planned, strict=True):
            if failure is not None and message.status == messages.PENDING:
                self._dead_letter(
                    connection,
                    message,
                    failure.reason,
                    str(failure),
                    code=failure.code,
                    run_id=run_id,
                    now=now,
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
            "dedupe_key": route.dedupe_key_for(payload),
            "status": messages.PENDING,
            "expires_at": min(known) if known else None,
            "created_at": now,
            "updated_at": now,
            "provider": self.provider.name,
        }
        failure: PermanentError | None = None
        try:
            values["template_version"] = route.template_version or self.renderer.latest_version(
                route.template
            )
        except TemplateRenderError as error:
            values["template_version"] = route.template_version or 0
            failure = error
        try:
            values["recipient"] = self._recipient(route, payload, lookups)
            values["recipient_domain"] = values["recipient"].rsplit("@", 1)[-1].lower()
        except RecipientNotFoundError as error:
            failure = failure or error
        return values, failure

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
            return address
        address = payload.get(route.recipient_field or "")
        if not address:
            raise RecipientNotFoundError(
                f"payload has no {route.recipient_field!r}", code="recipient_missing"
            )
        return str(address)

    # ---- sending -----------------------------------------------------------------------------

    def _send_all(self, work: list[_Work], run_id: str, outcome: BatchOutcome) -> None:
        """Send ``work`` from ``lane.concurrency`` threads; record outcomes as they arrive.

        The workers pull from one queue and push what happened onto another, so the run thread
        waits on a single queue instead of polling every future of the batch (which cost O(n)
        per completion). A configuration error stops further sends: what is already in flight
        is recorded, then the error fails the run.
        """
        if not work:
            return
        todo: SimpleQueue[_Work | None] = SimpleQueue()
        done: SimpleQueue[_Sent | None] = SimpleQueue()
        stop = threading.Event()
        concurrency = max(1, self.lane.concurrency)
        # Where the provider takes several messages a call, each call carries up to its limit,
        # but never so many that fewer calls than the lane's concurrency are left in flight.
        per_call = max(1, min(self._batch_max(), -(-len(work) // concurrency)))
        workers = min(concurrency, -(-len(work) // per_call))
        for item in work:
            todo.put(item)
        for _ in range(workers):
            todo.put(None)
        senders = [
            self._send_threads().submit(self._send_worker, todo, done, stop, per_call)
            for _ in range(workers)
        ]
        configuration_error: ConfigurationError | None = None
        group: list[_Sent] = []
        finished = False
        try:
            running = workers
            while running:
                group, exited = _next_group(done, running)
                running -= exited
                if group:
                    configuration_error = (
                        self._record_group(group, run_id, outcome) or configuration_error
                    )
                group = []
            finished = True
        finally:
            stop.set()
            futures.wait(senders)
            if not finished:
                # Interrupted (the run was terminated) or failed mid-group: what the provider
                # has already answered is recorded before giving up, so a released event is not
                # sent again for nothing (twice, with a provider that ignores idempotency keys).
                self._record_leftovers(group, done, run_id, outcome)
        if configuration_error is not None:
            raise configuration_error

    def _record_group(
        self, group: list[_Sent], run_id: str, outcome: BatchOutcome
    ) -> ConfigurationError | None:
        """One transaction per group, the accepted sends with one statement per table."""
        configuration_error: ConfigurationError | None = None
        with self.engine.begin() as connection:
            accepted: list[tuple[_Work, Accepted, datetime]] = []
            for sent in group:
                if isinstance(sent.result, Accepted):
                    accepted.append((sent.item, sent.result, sent.started))
                elif isinstance(sent.result, ConfigurationError):
                    # A wrong setting is the deployment's to fix: dead-letter nothing.
                    configuration_error = configuration_error or sent.result
                else:
                    self._record(connection, sent.item, sent.result, sent.started, run_id, outcome)
            self._record_accepted(connection, accepted, run_id, outcome)
        return configuration_error

    def _record_leftovers(
        self,
        group: list[_Sent],
        done: SimpleQueue[_Sent | None],
        run_id: str,
        outcome: BatchOutcome,
    ) -> None:
        leftovers = list(group)
        while True:
            try:
                sent = done.get_nowait()
            except Empty:
                break
            if sent is not None:
                leftovers.append(sent)
        if not leftovers:
            return
        try:
            self._record_group(leftovers, run_id, outcome)
            self.log.warning(f"interrupted: recorded the {len(leftovers)} outcome(s) in hand")
        except Exception as exc:  # the database may be what failed; the keys still guard
            self.log.warning(f"interrupted: could not record {len(leftovers)} outcome(s): {exc}")

    def _send_threads(self) -> futures.ThreadPoolExecutor:
        """The send threads, kept from batch to batch.

        Starting a lane's 32 threads for every batch took about a tenth of a lane worker's
        wall time: each ``Thread.start`` waits for the new thread to get the GIL from the busy
        ones. Idle threads end when the sender is garbage-collected.
        """
        if self._threads is None:
            self._threads = futures.ThreadPoolExecutor(
                max(1, self.lane.concurrency), thread_name_prefix="send"
            )
        return self._threads

    def _batch_max(self) -> int:
        if isinstance(self.provider, BatchingProvider):
            return max(1, self.provider.batch_max)
        return 1

    def _send_worker(
        self,
        todo: SimpleQueue[_Work | None],
        done: SimpleQueue[_Sent | None],
        stop: threading.Event,
        per_call: int,
    ) -> None:
        try:
            last = False
            while not last and not stop.is_set() and not self.cancel.is_set():
                items, last = _take(todo, per_call)
                if not items:
                    continue
                started = utcnow()
                if per_call == 1:
                    results = [self._attempt(items[0].email)]
                else:
                    results = self._attempt_many([item.email for item in items])
                for item, result in zip(items, results, strict=True):
                    if isinstance(result, ConfigurationError):
                        stop.set()  # every further send would fail the same way
                    done.put(_Sent(item, started, result))
        finally:
            done.put(None)  # this worker is finished

    def _attempt(self, email: OutgoingEmail) -> Accepted | DeliveryError | ConfigurationError:
        try:
            return self.provider.send(email)
        except ConfigurationError as error:
            return error
        except Exception as exc:  # the provider raised: classify, never let one message sink all
            return classify_exception(exc)

    def _attempt_many(
        self, emails: list[OutgoingEmail]
    ) -> Sequence[Accepted | DeliveryError | ConfigurationError]:
        assert isinstance(self.provider, BatchingProvider)
        try:
            results = self.provider.send_many(emails)
        except ConfigurationError as error:
            return [error] * len(emails)
        except Exception as exc:  # as in ``_attempt``: the call's failure is each message's
            return [classify_exception(exc)] * len(emails)
        if len(results) != len(emails):
            error = TransientError(
                f"{len(results)} answers to {len(emails)} messages", code="unreadable_response"
            )
            return [error] * len(emails)
        return results

    def _record_accepted(
        self,
        connection: Any,
        accepted: Sequence[tuple[_Work, Accepted, datetime]],
        run_id: str,
        outcome: BatchOutcome,
    ) -> None:
        if not accepted:
            return
        now = utcnow()
        attempts.add(
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
                    "provider_message_id": result.provider_message_id,
                    "error": None,
                    "retry_after_s": None,
                }
                for item, result, started in accepted
            ],
        )
        messages.record_accepted_many(
            connection,
            [(item.message.message_id, result.provider_message_id) for item, result, _ in accepted],
            now,
            self.provider.name,
        )
        dead_letters.resolve_for_messages(
            connection,
            [item.message.message_id for item, _, _ in accepted],
            status=dead_letters.REPLAYED,
            run_id=run_id,
            now=now,
        )
        outcome.sent += len(accepted)

    def _record(
        self,
        connection: Any,
        item: _Work,
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
        attempts.add(
            connection,
            [
                {
                    **attempt,
                    "outcome": "transient" if transient else "permanent",
                    "http_status": result.status_code,
                    "error": str(result),
                    "retry_after_s": result.retry_after_s
                    if isinstance(result, TransientError)
                    else None,
                }
            ],
        )
        messages.record_attempt(
            connection,
            message.message_id,
            now,
            accepted=False,
            provider=self.provider.name,
            provider_message_id=None,
            error=str(result),
        )
        if transient:
            outcome.transient.append(message.message_id)
            if isinstance(result, TransientError) and result.retry_after_s is not None:
                outcome.retry_after_s = max(outcome.retry_after_s or 0.0, result.retry_after_s)
            self.log.warning(
                f"event_id={message.event_id} message={message.message_id} "
                f"transient failure, will retry: {result}"
            )
            return
        refreshed = messages.get(connection, message.message_id)
        self._dead_letter(
            connection,
            refreshed,
            result.reason,
            str(result),
            code=result.code,
            run_id=run_id,
            now=now,
        )
        outcome.dead += 1

    # ---- terminal bookkeeping ----------------------------------------------------------------

    def _close_unsent(
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

    def _dead_letter(
        self,
        connection: Any,
        message: Row,
        reason: str,
        error: str,
        *,
        code: str | None,
        run_id: str,
        now: datetime,
    ) -> None:
        messages.set_status(connection, message.message_id, messages.DEAD, now, last_error=error)
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
            f"event_id={message.event_id} message={message.message_id} "
            f"dead-lettered ({reason}): {error}"
        )

    def _dead_letter_event(
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
        self.log.error(f"event_id={event.event_id} dead-lettered ({error.reason}): {error}")

    def _crash_loop(
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
            self._dead_letter(
                connection,
                message,
                "claim_limit",
                error,
                code="claim_limit",
                run_id=run_id,
                now=now,
            )
        if not pending:
            self._dead_letter_event(
                connection, event, PermanentError(error, code="claim_limit"), run_id, now
            )
        else:
            outbox.finish(
                connection, [event.event_id], status=outbox.DEAD, resolution="claim_limit", now=now
            )

    def _finish_events(self, claimed: Sequence[Row], run_id: str, outcome: BatchOutcome) -> None:
        with self.engine.begin() as connection:
            still_in_flight = self._settle(
                connection, [e.event_id for e in claimed], run_id, utcnow()
            )
            if still_in_flight:
                # Hold the claim across the retry wait, so no other run takes these events.
                wait_s = self.lane.max_retry_delay_s + self.lane.lease_s
                outbox.extend_lease(
                    connection, still_in_flight, run_id, utcnow() + timedelta(seconds=wait_s)
                )

    def _settle(
        self, connection: Any, event_ids: Sequence[str], run_id: str, now: datetime
    ) -> list[str]:
        """Close every event whose messages are all terminal; return those still in flight."""
        by_event: dict[str, list[str]] = {eid: [] for eid in event_ids}
        for message in messages.for_events(connection, list(event_ids)):
            by_event[message.event_id].append(message.status)
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
