"""trace fields on the outbox, the lookups of idempotent publish and rate limits, privacy keys

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 05:00:00
"""

import secrets
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("email_outbox") as table:
        table.add_column(sa.Column("trace_id", sa.String(length=64), nullable=True))
        table.add_column(sa.Column("correlation_id", sa.String(length=200), nullable=True))
        table.add_column(sa.Column("producer", sa.String(length=200), nullable=True))
        # The caller's W3C trace context (traceparent, tracestate) when OpenTelemetry is on.
        table.add_column(sa.Column("trace_context", sa.JSON(), nullable=True))
    op.create_index("ix_email_outbox_trace_id", "email_outbox", ["trace_id"])
    op.create_index("ix_email_outbox_correlation_id", "email_outbox", ["correlation_id"])
    # publish() looks a caller's idempotency key up, and a route's rate limit counts one
    # aggregate's recent events.
    op.create_index("ix_email_outbox_idempotency_key", "email_outbox", ["idempotency_key"])
    op.create_index(
        "ix_email_outbox_aggregate_published", "email_outbox", ["aggregate_id", "published_at"]
    )
    # Secrets the platform keeps itself: the key of the suppression hashes that outlive erasure.
    keys = op.create_table(
        "privacy_keys",
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("key_hex", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.bulk_insert(
        keys,
        [
            {
                "name": "suppression",
                "key_hex": secrets.token_hex(32),
                "created_at": datetime.now(UTC),
            }
        ],
    )


def downgrade() -> None:
    op.drop_table("privacy_keys")
    op.drop_index("ix_email_outbox_aggregate_published", table_name="email_outbox")
    op.drop_index("ix_email_outbox_idempotency_key", table_name="email_outbox")
    op.drop_index("ix_email_outbox_correlation_id", table_name="email_outbox")
    op.drop_index("ix_email_outbox_trace_id", table_name="email_outbox")
    with op.batch_alter_table("email_outbox") as table:
        table.drop_column("trace_context")
        table.drop_column("producer")
        table.drop_column("correlation_id")
        table.drop_column("trace_id")
