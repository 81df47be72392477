"""A sending step, as both send ops run it: the provider and its circuit mirror, the sender,
one attempt at a batch, and the step's end with its dead letters.

Its own module so that the lane-worker op (the default path) and the batch op
(``workers: 0``) share it without either importing the other's module.
"""

import threading
from typing import Any

from dagster import Failure, MetadataValue, OpExecutionContext, RetryRequested
from sqlalchemy import Engine

from email_platform.common.lanes import LaneConfig
from email_platform.observability import logs
from email_platform.ops.reporting import observe_sends, run_metadata, tag_dead_letters
from email_platform.providers.base import EmailProvider
from email_platform.resources import (
    AppDatabase,
    EmailProviderResource,
    LanePolicy,
    RoutingResource,
)
from email_platform.sending.batch import BatchSender, build_sender
from email_platform.sending.retry import retry_wait_s
from email_platform.sending.shared_rate import SharedRateLimiter
from email_platform.store import circuits, dead_letters


def send_batch(
    context: OpExecutionContext,
    *,
    lane: LaneConfig,
    event_ids: list[str],
    app_database: AppDatabase,
    email_provider: EmailProviderResource,
    routing: RoutingResource,
    lanes: LanePolicy | None = None,
) -> dict:
    """One attempt of a batch: send, then retry (RetryRequested) or fail on dead letters."""
    engine = app_database.get_engine()
    log = logs.bind(context.log, lane=lane.lane.value, run_id=context.run_id)
    run = context.run
    is_reexecution = run.parent_run_id is not None
    previous_owners = [r for r in (run.parent_run_id, run.root_run_id) if r]
    provider, mirror = open_provider(context, email_provider, engine, lane, log)
    outcome = None
    sender = None
    try:
        # Inside the try: a wrong rate setting (plan_for's ConfigurationError) still closes
        # the provider and the circuit mirror.
        sender = make_sender(context, lane, engine, provider, email_provider, routing, lanes=lanes)
        outcome = sender.run(
            event_ids,
            run_id=context.run_id,
            previous_owners=previous_owners,
            replay=is_reexecution,
        )
    finally:
        if sender is not None:
            sender.close()
        provider.close()
        # The breaker outlives an attempt that will be retried (the resource keeps it for the
        # run): its row stays until the run's last attempt.
        retrying = (
            outcome is not None
            and bool(outcome.transient)
            and context.retry_number < lane.max_retries
        )
        mirror.close(forget_rows=not retrying)

    attempt = context.retry_number
    log.info(f"{lane.lane.value} batch, attempt {attempt}: {outcome.summary()}")
    if outcome.transient:
        if context.retry_number < lane.max_retries:
            wait_s = retry_wait_s(lane, context.retry_number, outcome.retry_after_s)
            log.warning(
                f"{len(outcome.transient)} message(s) failed transiently; retry "
                f"{context.retry_number + 1}/{lane.max_retries} in {wait_s:.2f}s"
            )
            raise RetryRequested(max_retries=lane.max_retries, seconds_to_wait=wait_s)
        exhausted = sender.give_up(outcome.transient, run_id=context.run_id)
        outcome.dead += exhausted
        log.error(f"retries exhausted: {exhausted} message(s) dead-lettered")

    counts = outcome.as_metadata()
    observe_sends(context, lane.lane.value, counts)
    return finish_with_dead_letters(context, engine, counts)


def open_provider(
    context: OpExecutionContext,
    email_provider: EmailProviderResource,
    engine: Engine,
    lane: LaneConfig,
    log: Any,
    *,
    calls: int | None = None,
) -> tuple[EmailProvider, circuits.CircuitMirror]:
    """The attempt's provider, with connections for ``calls`` at once (default: the lane's
    ``concurrency``), and the mirror that writes its circuit breaker's state as this run's row
    of ``provider_circuits`` (what the alerts, ``status`` and the metrics read)."""
    mirror = circuits.CircuitMirror(engine, holder=context.run_id, lane=lane.lane.value, log=log)
    connections = lane.concurrency if calls is None else calls
    provider = email_provider.open(concurrency=connections, on_circuit_change=mirror)
    return provider, mirror


def make_sender(
    context: OpExecutionContext,
    lane: LaneConfig,
    engine: Engine,
    provider: EmailProvider,
    email_provider: EmailProviderResource,
    routing: RoutingResource,
    cancel: threading.Event | None = None,
    *,
    lanes: LanePolicy | None = None,
) -> BatchSender:
    """The step's sender; with a provider or lane rate set, its sends take their slots from the
    rate every worker of the provider shares (``sending.shared_rate``)."""
    settings = email_provider.settings()
    plan = (lanes or LanePolicy()).rate_plan(settings.name, settings.rate_limit_per_s, lane)
    return build_sender(
        engine=engine,
        provider=provider,
        renderer=routing.renderer(),
        routes=routing.route_table(),
        resolver=routing.resolver(engine),
        lane=lane,
        sender_address=settings.sender,
        log=logs.bind(context.log, lane=lane.lane.value, run_id=context.run_id),
        cancel=cancel,
        rate_limiter=SharedRateLimiter(engine, plan) if plan is not None else None,
    )


def finish_with_dead_letters(
    context: OpExecutionContext, engine: Engine, counts: dict[str, int]
) -> dict:
    """Attach the counts to the step and tag the run with its open dead letters; fail the run
    (no retry) if it left any, so the operator re-executes it."""
    with engine.connect() as connection:
        open_letters = dead_letters.list_letters(connection, run_id=context.run_id)
    summary = {**counts, "open_dead_letters": len(open_letters)}
    tag_dead_letters(context, len(open_letters))
    context.add_output_metadata(run_metadata(summary))
    if open_letters:
        raise Failure(
            description=(
                f"{len(open_letters)} message(s) of this run are in dead_letters "
                f"({', '.join(sorted({d.reason for d in open_letters}))}). Fix the cause, then "
                "re-execute this run from failure or use `email-platform dlq replay`."
            ),
            metadata={
                "dead_letter_ids": MetadataValue.text(
                    ", ".join(str(d.dead_letter_id) for d in open_letters[:100])
                ),
                **run_metadata(summary),
            },
            allow_retries=False,
        )
    return summary
