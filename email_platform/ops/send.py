"""The batch-run op (``workers: 0``): one attempt sends one claimed batch of one lane; the
attempt itself is in ``send_step``, which the lane-worker op shares."""

from dagster import Config, Failure, OpExecutionContext, op

from email_platform.ops.retry import retried_on_error
from email_platform.ops.send_step import send_batch
from email_platform.resources import AppDatabase, EmailProviderResource, LanePolicy, RoutingResource


class SendBatchConfig(Config):
    """Only ids travel in run config: no addresses, no payloads (PII stays in the database)."""

    lane: str
    event_ids: list[str]


@op(tags={"kind": "email"})
def send_email_batch(
    context: OpExecutionContext,
    config: SendBatchConfig,
    email_database: AppDatabase,
    email_provider: EmailProviderResource,
    email_routing: RoutingResource,
    email_lanes: LanePolicy,
) -> dict:
    """Claim the batch's outbox events, render each mail and send it to the provider.

    Every outcome is recorded as it happens. Transient failures (network, timeout, 429, 5xx)
    retry the step with exponential backoff and full jitter, honouring Retry-After; only unsent
    messages are sent again, with their original idempotency key. Permanent failures and
    exhausted retries become dead letters and fail the run, so an operator can re-execute it.
    """
    try:
        with retried_on_error(context):
            return send_batch(
                context,
                lane=email_lanes.config_for(config.lane),
                event_ids=config.event_ids,
                app_database=email_database,
                email_provider=email_provider,
                routing=email_routing,
                lanes=email_lanes,
            )
    except Failure as failure:
        # Raised on purpose (dead letters held): its description and metadata say it all, so
        # it leaves without the stack of our frames it came through.
        raise failure.with_traceback(None) from None
