"""Alembic environment: runs against the engine the caller passes in ``config.attributes``."""

from alembic import context

from email_platform.db.schema import metadata

engine = context.config.attributes["engine"]

with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
