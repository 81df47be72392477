"""email_messages.locale: the locale whose templates rendered a message; email_messages.is_test:
a test send (``email-platform templates send-test``), kept out of the warehouse's funnel

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 00:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("email_messages") as batch:
        batch.add_column(sa.Column("locale", sa.String(length=35), nullable=True))
        batch.add_column(
            sa.Column("is_test", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("email_messages") as batch:
        batch.drop_column("is_test")
        batch.drop_column("locale")
