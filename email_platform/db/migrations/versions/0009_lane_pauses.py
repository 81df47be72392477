"""lane_pauses: lanes paused by an operator or a brake

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lane_pauses",
        sa.Column("lane", sa.String(length=20), nullable=False),
        sa.Column("paused_by", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("paused_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resumed_by", sa.String(length=200), nullable=True),
        sa.Column("resumed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("lane"),
    )


def downgrade() -> None:
    op.drop_table("lane_pauses")
