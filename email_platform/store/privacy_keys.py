"""Reads and writes of ``privacy_keys``: secrets the platform keeps itself (migration 0008)."""

import secrets
from datetime import datetime

from sqlalchemy import Connection, insert, select
from sqlalchemy.exc import IntegrityError

from email_platform.db.schema import privacy_keys

#: The key of the suppression hashes that outlive an erasure.
SUPPRESSION = "suppression"
#: The key of the short tags ``dlq list`` puts beside a masked recipient, so two addresses that
#: mask alike stay apart; its own key, so a tag links to no suppression hash.
RECIPIENT_TAG = "recipient_tag"


def get(connection: Connection, name: str) -> bytes | None:
    key_hex = connection.execute(
        select(privacy_keys.c.key_hex).where(privacy_keys.c.name == name)
    ).scalar()
    return bytes.fromhex(key_hex) if key_hex else None


def ensure(connection: Connection, name: str, now: datetime) -> bytes:
    """The key ``name``, made (random, 32 bytes) if the database has none yet.

    Migration 0008 makes the suppression key; this covers a schema built another way. A racing
    writer's key wins and is the one returned.
    """
    key = get(connection, name)
    if key is not None:
        return key
    try:
        with connection.begin_nested():
            connection.execute(
                insert(privacy_keys).values(
                    name=name, key_hex=secrets.token_hex(32), created_at=now
                )
            )
    except IntegrityError:
        pass
    key = get(connection, name)
    assert key is not None
    return key
