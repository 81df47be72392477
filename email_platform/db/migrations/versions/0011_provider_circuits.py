"""provider_circuits: each sending process's circuit-breaker state per provider; the provider
of each attempt

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "provider_circuits",
        sa.Column("provider", sa.String(length=40), nullable=False),
        sa.Column("holder", sa.String(length=64), nullable=False),
        sa.Column("lane", sa.String(length=20), nullable=True),
        sa.Column("state", sa.String(length=12), nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("provider", "holder"),
    )
    with op.batch_alter_table("email_attempts") as batch:
        batch.add_column(sa.Column("provider", sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("email_attempts") as batch:
        batch.drop_column("provider")
    op.drop_table("provider_circuits")
