"""Every application table, defined once (SQLAlchemy Core). Migrations mirror this module."""

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    DateTime,
    Double,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)

metadata = MetaData()

# Product code writes here, inside its own transaction, through publish().
email_outbox = Table(
    "email_outbox",
    metadata,
    Column("event_id", String(26), primary_key=True),
    Column("event_type", String(200), nullable=False),
    Column("event_version", Integer, nullable=False),
    Column("aggregate_id", String(200), nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("published_at", DateTime(timezone=True), nullable=False),
    Column("payload", JSON, nullable=False),
    Column("event_metadata", JSON, nullable=False),
    Column("lane", String(20), nullable=False),
    # Earliest moment the event may be sent (send_after, else published_at).
    Column("available_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True)),
    Column("idempotency_key", String(200)),
    # pending -> in_flight -> done | dead
    Column("status", String(20), nullable=False, server_default="pending"),
    # Why the event is done: sent, ignored (no route), ...
    Column("resolution", String(40)),
    # The claim: which run holds the event and until when.
    Column("claimed_by", String(64)),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("claim_count", Integer, nullable=False, server_default="0"),
    # The sensor marks what it requested so the next tick does not request it again.
    Column("requested_at", DateTime(timezone=True)),
    Column("request_count", Integer, nullable=False, server_default="0"),
    Column("done_at", DateTime(timezone=True)),
    # Tracing (migration 0008): who published it, in which request; the caller's W3C trace
    # context ({"traceparent": ..., "tracestate": ...}) when OpenTelemetry is on.
    Column("trace_id", String(64)),
    Column("correlation_id", String(200)),
    Column("producer", String(200)),
    Column("trace_context", JSON(none_as_null=True)),  # None is SQL NULL, not JSON null
)
Index("ix_email_outbox_trace_id", email_outbox.c.trace_id)
Index("ix_email_outbox_correlation_id", email_outbox.c.correlation_id)
Index("ix_email_outbox_idempotency_key", email_outbox.c.idempotency_key)
Index(
    "ix_email_outbox_aggregate_published", email_outbox.c.aggregate_id, email_outbox.c.published_at
)
Index(
    "ix_email_outbox_lane_status_available",
    email_outbox.c.lane,
    email_outbox.c.status,
    email_outbox.c.available_at,
)
Index("ix_email_outbox_claimed_by", email_outbox.c.claimed_by)
# Change markers the warehouse loads by (migration 0004).
Index("ix_email_outbox_published_at", email_outbox.c.published_at)
Index("ix_email_outbox_done_at", email_outbox.c.done_at)

email_messages = Table(
    "email_messages",
    metadata,
    Column("message_id", Integer, primary_key=True, autoincrement=True),
    Column("event_id", String(26), ForeignKey("email_outbox.event_id"), nullable=False),
    Column("route", String(100), nullable=False),
    Column("template", String(100), nullable=False),
    Column("template_version", Integer, nullable=False),
    Column("lane", String(20), nullable=False),
    Column("recipient", String(320)),
    Column("recipient_domain", String(255)),
    # Recorded before the first provider call and sent on every attempt.
    Column("idempotency_key", String(255), nullable=False, unique=True),
    # A route's application-level dedupe key; only the first message holding it is sent.
    Column("dedupe_key", String(255), unique=True),
    # pending -> sent | suppressed | expired | duplicate | dead
    Column("status", String(20), nullable=False, server_default="pending"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("provider", String(40)),
    Column("provider_message_id", String(255)),
    Column("last_error", Text),
    Column("expires_at", DateTime(timezone=True)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("sent_at", DateTime(timezone=True)),
    # What the provider told us afterwards (webhooks): the highest-ranked event wins, so any
    # arrival order ends in the same state and a late "delivered" never hides a bounce.
    Column("delivery_status", String(20)),
    Column("delivery_updated_at", DateTime(timezone=True)),
    # Migration 0012: the locale whose templates rendered it (after fallback; null = default),
    # and a test send (``templates send-test``), which the warehouse's funnel leaves out.
    Column("locale", String(35)),
    Column("is_test", Boolean, nullable=False, server_default=false()),
    UniqueConstraint("event_id", "route", name="uq_email_messages_event_route"),
)
Index("ix_email_messages_status", email_messages.c.status)
Index("ix_email_messages_provider_message_id", email_messages.c.provider_message_id)
# The warehouse loads what changed since its high-water marks; these keep that a range scan.
Index("ix_email_messages_updated_at", email_messages.c.updated_at)
Index("ix_email_messages_delivery_updated_at", email_messages.c.delivery_updated_at)

email_attempts = Table(
    "email_attempts",
    metadata,
    Column("attempt_id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", Integer, ForeignKey("email_messages.message_id"), nullable=False),
    Column("event_id", String(26), nullable=False),
    Column("run_id", String(64)),
    Column("attempt_no", Integer, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True), nullable=False),
    # accepted | transient | permanent
    Column("outcome", String(20), nullable=False),
    Column("http_status", Integer),
    Column("provider_message_id", String(255)),
    Column("error", Text),
    Column("retry_after_s", Float),
    # The provider this call went to (a failover's secondary names itself); null before 0011.
    Column("provider", String(40)),
)
Index("ix_email_attempts_message", email_attempts.c.message_id)
Index("ix_email_attempts_event", email_attempts.c.event_id)
Index("ix_email_attempts_finished_at", email_attempts.c.finished_at)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("dead_letter_id", Integer, primary_key=True, autoincrement=True),
    Column("event_id", String(26), nullable=False),
    # Null when the event failed before any message existed (e.g. unknown event version).
    Column("message_id", Integer),
    Column("lane", String(20), nullable=False),
    Column("reason", String(60), nullable=False),
    Column("error_code", String(100)),
    Column("last_error", Text),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("run_id", String(64)),
    # open -> replayed | discarded | expired | suppressed
    Column("status", String(20), nullable=False, server_default="open"),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("resolved_at", DateTime(timezone=True)),
    Column("resolved_by_run_id", String(64)),
)
Index("ix_dead_letters_status", dead_letters.c.status)
Index("ix_dead_letters_event", dead_letters.c.event_id)
# Closing a message's dead letter on every accepted send must not scan the table.
Index("ix_dead_letters_message", dead_letters.c.message_id)
# The warehouse's incremental reads: rows created or resolved since its last refresh.
Index("ix_dead_letters_created_at", dead_letters.c.created_at)
Index("ix_dead_letters_resolved_at", dead_letters.c.resolved_at)

suppressions = Table(
    "suppressions",
    metadata,
    Column("address", String(320), primary_key=True),
    # hard_bounce | complaint | unsubscribe | manual
    Column("reason", String(40), nullable=False),
    Column("source", String(100), nullable=False),
    Column("event_id", String(26)),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

# Keys the platform keeps itself (migration 0008 creates "suppression", random): suppressions
# of an erased person survive as an HMAC of the address under it.
privacy_keys = Table(
    "privacy_keys",
    metadata,
    Column("name", String(40), primary_key=True),
    Column("key_hex", String(128), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

# Raw webhook bodies exactly as received, stored before the receiver answers 2xx.
webhook_inbox = Table(
    "webhook_inbox",
    metadata,
    Column("inbox_id", Integer, primary_key=True, autoincrement=True),
    Column("provider", String(40), nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False),
    # The provider's delivery id (webhook-id, SNS MessageId, Mailgun token ...) when it has one.
    Column("delivery_id", String(255)),
    Column("headers", JSON, nullable=False),
    Column("body", Text, nullable=False),
    # pending -> in_flight -> processed | malformed | failed
    Column("status", String(20), nullable=False, server_default="pending"),
    Column("error", Text),
    Column("claimed_by", String(64)),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("requested_at", DateTime(timezone=True)),
    Column("request_count", Integer, nullable=False, server_default="0"),
    Column("processed_at", DateTime(timezone=True)),
    UniqueConstraint("provider", "delivery_id", name="uq_webhook_inbox_delivery"),
)
Index("ix_webhook_inbox_status", webhook_inbox.c.status, webhook_inbox.c.inbox_id)
# The retention purge takes processed rows oldest first, in batches (migration 0010).
Index("ix_webhook_inbox_status_received", webhook_inbox.c.status, webhook_inbox.c.received_at)

# Normalized provider events, one row per provider event, applied once.
email_events = Table(
    "email_events",
    metadata,
    Column("email_event_id", Integer, primary_key=True, autoincrement=True),
    Column("provider", String(40), nullable=False),
    # The provider's own event id, or a stable hash of the event where it gives none.
    Column("provider_event_id", String(255), nullable=False),
    # queued | sent | rejected | failed | bounced | deferred | delivered | autoresponded |
    # opened | clicked | complained | unsubscribed | subscribed | unknown
    Column("event_type", String(20), nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False),
    Column("event_id", String(26)),
    Column("idempotency_key", String(255)),
    Column("message_id", Integer),
    Column("provider_message_id", String(255)),
    Column("recipient", String(320)),
    Column("recipient_domain", String(255)),
    Column("reject_reason", String(255)),
    # hard | soft for bounces
    Column("bounce_type", String(20)),
    Column("click_url", Text),
    Column("user_agent", Text),
    Column("machine_open", Boolean),
    Column("inbox_id", Integer),
    Column("raw", JSON),
    UniqueConstraint("provider", "provider_event_id", name="uq_email_events_provider_event"),
)
Index("ix_email_events_event_id", email_events.c.event_id)
Index("ix_email_events_message", email_events.c.message_id)
Index("ix_email_events_received_at", email_events.c.received_at)

# Every email_events row deleted (``webhooks reprocess`` re-creates them with new ids), written
# by a trigger (migration 0006) so deletions by hand are recorded too: the warehouse loads
# provider events by id and removes the versions named here.
email_event_deletions = Table(
    "email_event_deletions",
    metadata,
    Column("deletion_id", Integer, primary_key=True, autoincrement=True),
    Column("email_event_id", Integer, nullable=False),
    # The deleted version's received_at: with its id, it names that version.
    Column("received_at", DateTime(timezone=True), nullable=False),
    Column("deleted_at", DateTime(timezone=True), nullable=False),
)
Index("ix_email_event_deletions_deleted_at", email_event_deletions.c.deleted_at)

# One row per lane-worker run: its heartbeat tells the lane sensor a worker is alive (a run
# whose process died stays STARTED in Dagster with the default run launcher).
lane_workers = Table(
    "lane_workers",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("lane", String(20), nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("heartbeat_at", DateTime(timezone=True), nullable=False),
    Column("ended_at", DateTime(timezone=True)),
    # lifetime, idle, paused, or the error that ended it
    Column("end_reason", String(200)),
)

# One row per lane ever paused, by an operator (``email-platform lanes pause``) or a brake
# (paused_by ``brake:bounce_rate`` ...). The lane is paused while resumed_at is null: its outbox
# sensor requests nothing and its workers end. Resuming keeps the row, so a brake counts only
# mail accepted after the last resume and never pauses again on the data that was resumed over.
lane_pauses = Table(
    "lane_pauses",
    metadata,
    Column("lane", String(20), primary_key=True),
    Column("paused_by", String(200), nullable=False),
    Column("reason", Text),
    Column("paused_at", DateTime(timezone=True), nullable=False),
    Column("resumed_by", String(200)),
    Column("resumed_at", DateTime(timezone=True)),
)

# One row per alert key (``dead_letters:<reason>``, ``lane_late:bulk`` ...): raised when its
# condition appears, resolved when it ends, raised again (raise_count + 1) if it comes back.
# The alerts sensor is its only writer.
alerts = Table(
    "alerts",
    metadata,
    Column("key", String(300), primary_key=True),
    Column("kind", String(40), nullable=False),
    Column("lane", String(20)),
    Column("severity", String(10), nullable=False),
    Column("summary", Text, nullable=False),
    Column("raised_at", DateTime(timezone=True), nullable=False),
    Column("last_seen_at", DateTime(timezone=True), nullable=False),
    Column("resolved_at", DateTime(timezone=True)),
    Column("raise_count", Integer, nullable=False, server_default="1"),
)
Index("ix_alerts_resolved_at", alerts.c.resolved_at)

# One row per (provider, sending process): the state of that process's circuit breaker, written
# at each transition and deleted when the run ends. A row is someone's view, not the truth for
# every process: the alert and the metric count processes whose circuit is open.
provider_circuits = Table(
    "provider_circuits",
    metadata,
    Column("provider", String(40), primary_key=True),
    # The run id of the sending process.
    Column("holder", String(64), primary_key=True),
    Column("lane", String(20)),
    # closed | open | half_open
    Column("state", String(12), nullable=False),
    Column("changed_at", DateTime(timezone=True), nullable=False),
    # When the circuit last opened (kept while it probes, cleared when it closes).
    Column("opened_at", DateTime(timezone=True)),
)

# One row per rate bucket (``<provider>``, ``<provider>:reserved:<lane>``,
# ``<provider>:lane:<lane>``): the next send slot not yet handed out, in epoch seconds, and
# until when a provider's 429 holds every sender (``store.provider_rates``). Rates themselves
# are settings, not rows: each sender brings its own.
provider_rates = Table(
    "provider_rates",
    metadata,
    Column("bucket", String(100), primary_key=True),
    Column("next_slot", Double, nullable=False),
    Column("held_until", Double, nullable=False, server_default="0"),
)
