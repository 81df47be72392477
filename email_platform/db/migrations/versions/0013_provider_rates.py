"""provider_rates: the send rate every worker of a provider shares (next free slot, hold)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 03:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "provider_rates",
        sa.Column("bucket", sa.String(length=100), nullable=False),
        sa.Column("next_slot", sa.Double(), nullable=False),
        sa.Column("held_until", sa.Double(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("bucket"),
    )


def downgrade() -> None:
    op.drop_table("provider_rates")
