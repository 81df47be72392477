"""alerts: one row per alert key, raised and resolved by the alerts sensor; an index for the
retention purge of the webhook inbox

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column("key", sa.String(length=300), nullable=False),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("lane", sa.String(length=20), nullable=True),
        sa.Column("severity", sa.String(length=10), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("raised_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("raise_count", sa.Integer(), server_default="1", nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_index("ix_alerts_resolved_at", "alerts", ["resolved_at"])
    op.create_index("ix_webhook_inbox_status_received", "webhook_inbox", ["status", "received_at"])


def downgrade() -> None:
    op.drop_index("ix_webhook_inbox_status_received", table_name="webhook_inbox")
    op.drop_index("ix_alerts_resolved_at", table_name="alerts")
    op.drop_table("alerts")
