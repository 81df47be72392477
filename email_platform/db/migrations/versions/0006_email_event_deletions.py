"""email_event_deletions: a record of every provider event row deleted, kept by a trigger

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 07:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# The warehouse loads provider events by their id; a deleted row (``webhooks reprocess``, or by
# hand) leaves no trace in the table itself, so a trigger records it. The deleted version is
# named by its id and received_at: SQLite can give a deleted newest id to the next row.
SQLITE_TRIGGER = """
CREATE TRIGGER email_events_record_deletion AFTER DELETE ON email_events
BEGIN
    INSERT INTO email_event_deletions (email_event_id, received_at, deleted_at)
    VALUES (OLD.email_event_id, OLD.received_at, strftime('%Y-%m-%d %H:%M:%f000', 'now'));
END
"""
POSTGRESQL_FUNCTION = """
CREATE FUNCTION email_events_record_deletion() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO email_event_deletions (email_event_id, received_at, deleted_at)
    VALUES (OLD.email_event_id, OLD.received_at, clock_timestamp());
    RETURN OLD;
END
$$
"""
POSTGRESQL_TRIGGER = """
CREATE TRIGGER email_events_record_deletion AFTER DELETE ON email_events
FOR EACH ROW EXECUTE FUNCTION email_events_record_deletion()
"""


def upgrade() -> None:
    op.create_table(
        "email_event_deletions",
        sa.Column("deletion_id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("email_event_id", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("deletion_id"),
    )
    with op.batch_alter_table("email_event_deletions", schema=None) as batch_op:
        batch_op.create_index("ix_email_event_deletions_deleted_at", ["deleted_at"], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRESQL_FUNCTION)
        op.execute(POSTGRESQL_TRIGGER)
    else:
        op.execute(SQLITE_TRIGGER)


def downgrade() -> None:
    op.execute(
        "DROP TRIGGER IF EXISTS email_events_record_deletion"
        + (" ON email_events" if op.get_bind().dialect.name == "postgresql" else "")
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS email_events_record_deletion()")
    op.drop_table("email_event_deletions")
