"""One attempt at a batch: claim it, prepare its messages, send them, record, settle.

``BatchSender.run`` is what one attempt of the send op does. It commits each decision as soon
as it is made, so a crash at any point loses no outcome that was already known, and the next
attempt (same run, a re-execution, or another run after the lease expires) redoes only what is
still pending, under the idempotency key that was committed before the first provider call.
While it runs, a thread renews the run's short leases (``leases.LeaseRenewer``).
The steps live beside it: ``prepare`` (route, dedupe, expiry, recipient, suppression, render),
``dispatch`` (the send threads and provider calls, no database) and ``record`` (attempts,
messages, dead letters, settling events). This class owns the transactions that join them.
"""

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, Row

from email_platform.common.errors import ConfigurationError, UnstorableEventError
from email_platform.common.lanes import LaneConfig
from email_platform.common.timeutil import utcnow
from email_platform.db.errors import refused_by_database
from email_platform.mail import addressing
from email_platform.mail.recipients import RecipientResolver, SqlDirectoryResolver
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import RouteTable, configured_routes
from email_platform.observability import logs, tracing
from email_platform.providers import templated
from email_platform.providers.base import EmailProvider, failover_provider
from email_platform.sending import shared_rate
from email_platform.sending.dispatch import Dispatcher
from email_platform.sending.leases import LeaseRenewer
from email_platform.sending.prepare import Preparer
from email_platform.sending.record import Recorder
from email_platform.sending.refusals import first_line, restore_outcome
from email_platform.sending.shared_rate import SharedRateLimiter
from email_platform.sending.types import BatchOutcome, ClaimedBatch, Sent, Work
from email_platform.store import dead_letters, messages, outbox


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
        rate_limiter: SharedRateLimiter | None = None,
    ) -> None:
        self.engine = engine
        #: The provider's shared send rate (``shared_rate``), None: the adapter's own.
        self.rate_limiter = rate_limiter
        self.lane = lane
        self.log = log or logs.bind(logging.getLogger(__name__), lane=lane.lane.value)
        #: Set when the run is asked to stop: no new provider call starts, the ones in flight
        #: are recorded, and what was not sent stays pending under its key.
        self.cancel = cancel or threading.Event()
        self.recorder = Recorder(engine, lane, provider.name, self.log)
        self.preparer = Preparer(
            engine=engine,
            routes=routes,
            renderer=renderer,
            resolver=resolver,
            lane=lane,
            provider_name=provider.name,
            sender_address=sender_address,
            recorder=self.recorder,
        )
        self.dispatcher = Dispatcher(lane.concurrency, self.cancel, lane.batches_in_flight)
        self.provider = provider

    @property
    def provider(self) -> EmailProvider:
        return self._provider

    @provider.setter
    def provider(self, provider: EmailProvider) -> None:
        self._provider = provider
        if self.rate_limiter is not None:
            shared_rate.install(provider, self.rate_limiter)
        self.recorder.provider_name = provider.name
        self.preparer.provider_name = provider.name
        self.preparer.provider_templates = templated.sends_templates(provider)

    def run(
        self,
        event_ids: Sequence[str],
        *,
        run_id: str,
        previous_owners: Sequence[str] = (),
        replay: bool = False,
    ) -> BatchOutcome:
        """Claim, prepare, send and record ``event_ids``, renewing the run's leases meanwhile
        (a batch of slow sends outlasts a short lease)."""
        with LeaseRenewer(self.engine, run_id, self.lane.lease_s, log=self.log):
            return self.deliver(
                self.claim(
                    event_ids, run_id=run_id, previous_owners=previous_owners, replay=replay
                ),
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
        started_ns = tracing.now_ns()
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
        # One span per batch, not per event: it links to the traces of the events it took
        # (each message's render and send spans continue its own event's trace).
        with tracing.start_span(
            "email_platform.claim",
            links=(event.trace_context for event in claimed),
            start_time_ns=started_ns,
            attributes={
                "email.lane": self.lane.lane.value,
                "email.run_id": run_id,
                "email.requested": len(event_ids),
                "email.claimed": len(claimed),
                "email.replay": replay,
            },
        ):
            work = self._prepare_narrowing(list(claimed), run_id, outcome, replay)
        return ClaimedBatch(outcome, claimed, work)

    def _prepare_narrowing(
        self, claimed: list[Row], run_id: str, outcome: BatchOutcome, replay: bool
    ) -> list[Work]:
        """Prepare ``claimed``; if the database refuses the batch, find the event that causes it.

        A refused statement (a value too long for a column, text the driver cannot encode)
        rolls back the whole preparing transaction. Rather than fail the batch run after run
        until ``claim_limit`` takes the good events too, the batch is split in halves and each
        prepared on its own; the one event that still fails alone is dead-lettered with the
        database's reason, and every other event goes on. A database that is down is not
        narrowed: that error fails the attempt, as before.
        """
        before = dataclasses.replace(outcome, claimed=list(outcome.claimed))
        try:
            return self.preparer.prepare(claimed, run_id, outcome, replay)
        except Exception as exc:
            if not refused_by_database(exc):
                raise
            restore_outcome(outcome, before)  # the rolled-back transaction's counts do not count
            if len(claimed) == 1:
                self._dead_letter_refused(claimed[0], exc, run_id, outcome)
                return []
            self.log.warning(
                f"the database refused a batch of {len(claimed)} event(s) "
                f"({type(exc).__name__}); preparing it in halves to find the cause"
            )
            middle = len(claimed) // 2
            return self._prepare_narrowing(
                claimed[:middle], run_id, outcome, replay
            ) + self._prepare_narrowing(claimed[middle:], run_id, outcome, replay)

    def _dead_letter_refused(
        self, event: Row, exc: Exception, run_id: str, outcome: BatchOutcome
    ) -> None:
        error = UnstorableEventError(
            f"the database refused this event's messages: {first_line(exc)}",
            code="database_refused",
        )
        with self.engine.begin() as connection:
            self.recorder.dead_letter_event(connection, event, error, run_id, utcnow())
        outcome.dead += 1

    def deliver(
        self, batch: ClaimedBatch, *, run_id: str, hold_retries: bool = True
    ) -> BatchOutcome:
        """Send a claimed batch's messages, record every outcome, settle its events.

        Fenced: only messages of events this run still holds are sent. A claim can be lost
        between preparing and sending (a lane worker prepares its next batch while the last one
        is with the provider; a run that looked dead had its claims released and taken by
        another), and then the other run sends them, not this one. ``hold_retries``: events
        left waiting for a retry keep a lease over the longest wait (a batch run; a lane worker
        renews its leases instead).
        """
        if batch.events:
            outcome = batch.outcome
            work = self._still_held(batch.work, run_id)
            started = time.monotonic()
            self.dispatcher.send_all(
                self.provider,
                work,
                record=lambda group: self._record(group, run_id, outcome),
                salvage=lambda leftovers: self.recorder.salvage(leftovers, run_id, outcome),
            )
            outcome.provider_s += time.monotonic() - started
            self.recorder.finish_events(batch.events, run_id, outcome, hold_retries=hold_retries)
        return batch.outcome

    def _record(
        self, group: list[Sent], run_id: str, outcome: BatchOutcome
    ) -> ConfigurationError | None:
        if self.rate_limiter is not None:
            # A 429 seen here holds every sender of the provider, not only this one.
            # (A failover's secondary is another provider, with a rate of its own.)
            self.rate_limiter.observe(
                sent.result for sent in group if failover_provider(sent.result) is None
            )
        return self.recorder.record_group(group, run_id, outcome)

    def close(self) -> None:
        """Give back the shared-rate slots this sender was granted and did not use."""
        if self.rate_limiter is not None:
            self.rate_limiter.close()

    def _still_held(self, work: list[Work], run_id: str) -> list[Work]:
        if not work:
            return work
        with self.engine.connect() as connection:
            held = outbox.held_by(connection, sorted({w.message.event_id for w in work}), run_id)
        kept = [w for w in work if w.message.event_id in held]
        if len(kept) < len(work):
            lost = sorted({w.message.event_id for w in work} - held)
            self.log.warning(
                f"{len(lost)} event(s) are no longer held by this run (first_event_id="
                f"{lost[0]}): another run has them; their messages are not sent from here"
            )
        return kept

    def give_up(self, message_ids: Sequence[int], *, run_id: str) -> int:
        """Retries are exhausted: every still-pending message becomes a dead letter."""
        return self.recorder.give_up(message_ids, run_id=run_id)


def build_sender(
    *,
    engine: Engine,
    provider: EmailProvider,
    lane: LaneConfig,
    sender_address: str,
    routes: RouteTable | None = None,
    renderer: TemplateRenderer | None = None,
    resolver: RecipientResolver | None = None,
    log: logging.Logger | Any | None = None,
    cancel: threading.Event | None = None,
    rate_limiter: SharedRateLimiter | None = None,
) -> BatchSender:
    """The one way a ``BatchSender`` is put together; the configured route table
    (``EMAIL_PLATFORM_ROUTES``) with its templates and the ``users`` directory unless others are
    given."""
    routes = configured_routes() if routes is None else routes
    if renderer is None:
        if routes.templates_dir is None:
            raise ConfigurationError(
                "the route table names no templates_dir: set RouteTable(templates_dir=...) "
                "or pass a renderer"
            )
        renderer = TemplateRenderer(routes.templates_dir)
    # A route on a provider template its provider cannot send fails here, before any claim.
    templated.check_routes(routes.routes, provider, renderer)
    addressing.refuse_uncarried(provider, routes.routes)
    return BatchSender(
        engine=engine,
        provider=provider,
        renderer=renderer,
        routes=routes,
        resolver=SqlDirectoryResolver(engine) if resolver is None else resolver,
        lane=lane,
        sender_address=sender_address,
        log=log,
        cancel=cancel,
        rate_limiter=rate_limiter,
    )
