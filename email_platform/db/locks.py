"""Transaction-scoped locks on a name, so a check-then-insert holds across processes."""

import hashlib

from sqlalchemy import Connection, text


def lock_for_transaction(connection: Connection, name: str) -> None:
    """Hold a lock on ``name`` until the caller's transaction ends.

    PostgreSQL: an advisory transaction lock, so two publishers checking the same key queue
    and the second sees what the first committed. SQLite needs none: the platform's engine
    begins every transaction with ``BEGIN IMMEDIATE`` (``db.engine``), which already
    serializes writers; a caller's own SQLite engine must do the same.
    """
    if connection.dialect.name != "postgresql":
        return
    # A stable 63-bit number: hashtext() is not guaranteed stable across major versions.
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1
    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
