"""index dead_letters.created_at, a change marker the warehouse reads by

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 12:50:00
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Each warehouse refresh reads the dead letters created or resolved since its last one;
    # resolved_at had an index and created_at none, so the OR of the two scanned the table.
    op.create_index("ix_dead_letters_created_at", "dead_letters", ["created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_dead_letters_created_at", table_name="dead_letters")
