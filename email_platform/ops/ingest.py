"""The ingestion op: normalize one batch of stored webhooks and apply each event once."""

from datetime import timedelta

from dagster import (
    Config,
    MetadataValue,
    OpExecutionContext,
    op,
)

from email_platform.common import config as settings
from email_platform.common.timeutil import utcnow
from email_platform.ops.retry import retried_on_error
from email_platform.resources import AppDatabase
from email_platform.store import email_events, inbox
from email_platform.webhooks.ingest import WebhookIngestor

#: Most raw webhooks (and deletion records) one ingestion run purges past retention.
INGEST_PURGE_LIMIT = 1000


class IngestBatchConfig(Config):
    inbox_ids: list[int]


@op(tags={"kind": "email"})
def ingest_webhook_batch(
    context: OpExecutionContext, config: IngestBatchConfig, email_database: AppDatabase
) -> dict:
    """Claim a batch of raw webhooks from the inbox, normalize each provider's payload into
    the tracking vocabulary, store every provider event once, move each message's delivery
    state forward, and suppress addresses that hard-bounced, complained or unsubscribed.
    """
    with retried_on_error(context):
        engine = email_database.get_engine()
        outcome = WebhookIngestor(engine, log=context.log).run(
            config.inbox_ids, run_id=context.run_id
        )
        summary = outcome.as_metadata()
        # Retention: raw bodies are kept for re-normalization, then dropped; so are the records
        # of deleted provider events (see email_event_deletions).
        cutoff = utcnow() - timedelta(days=settings.webhook_retention_days())
        with engine.begin() as connection:
            # Bounded: a run keeps its transaction short; retention_job purges the rest.
            summary["purged"] = inbox.delete_processed(
                connection, received_before=cutoff, limit=INGEST_PURGE_LIMIT
            )
            summary["deletion_records_purged"] = email_events.delete_deletion_records(
                connection, deleted_before=cutoff, limit=INGEST_PURGE_LIMIT
            )
        context.log.info(
            f"inbox {config.inbox_ids[0]}..{config.inbox_ids[-1]}: "
            + " ".join(f"{k}={v}" for k, v in summary.items())
        )
        context.add_output_metadata({k: MetadataValue.int(v) for k, v in summary.items()})
        return summary
