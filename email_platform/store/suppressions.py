"""Reads and writes of ``suppressions``: addresses that must not be mailed.

An erased person's row is kept as ``hmac:`` + HMAC-SHA256 of the normalized address under the
``suppression`` key of ``privacy_keys``: the address cannot be read back from it, yet every
check of that address still finds it, so erasing someone never makes them mailable again.

A webhook's stronger reason replaces a suppression made elsewhere (a one-click unsubscribe, the
demo's) in one row, so that origin is kept in ``source`` (``webhook:x; was unsubscribe from
unsubscribe:digest``): re-normalizing webhooks (``webhooks reprocess``) withdraws what a wrong
mapping wrote and falls back to it. Webhooks' own reasons need no such note: their events say.
"""

import hashlib
import hmac
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import Connection, Row, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.db.schema import suppressions
from email_platform.store import privacy_keys
from email_platform.store.bulk import ids_per_statement, one_of

HARD_BOUNCE, COMPLAINT, UNSUBSCRIBE, MANUAL = "hard_bounce", "complaint", "unsubscribe", "manual"
#: The reason of every hashed row: an erased person gets no mail at all, password resets too.
ERASED = "erased"
# The strongest reason is kept, so the result does not depend on which event came first.
STRENGTH = {UNSUBSCRIBE: 1, HARD_BOUNCE: 2, COMPLAINT: 3, MANUAL: 4, ERASED: 5}
HASH_PREFIX = "hmac:"
#: ``source`` of a suppression a provider's webhook asked for: this prefix and the provider.
WEBHOOK = "webhook:"
_WAS, _FROM = "; was ", " from "


def normalize(address: str) -> str:
    return address.strip().lower()


def hashed(key: bytes, address: str) -> str:
    """The row key an erased address is suppressed under."""
    digest = hmac.new(key, normalize(address).encode("utf-8"), hashlib.sha256).hexdigest()
    return HASH_PREFIX + digest


def add(
    connection: Connection,
    address: str,
    *,
    reason: str,
    source: str,
    now: datetime,
    event_id: str | None = None,
) -> bool:
    """Suppress ``address``; returns False if it already was (the strongest reason stays).

    Safe under concurrent writers: the insert is the arbiter (a racing loser's unique
    violation is caught in a savepoint), and a reason replaces only a weaker one, in the
    UPDATE's own WHERE, which PostgreSQL re-checks on a row another transaction just changed.
    An address erased before is already suppressed by its hash, and is not written back in
    plain text (a late bounce of an erased person's mail).
    """
    key = normalize(address)
    secret = privacy_keys.get(connection, privacy_keys.SUPPRESSION)
    if secret is not None:
        digest = hashed(secret, key)
        if connection.execute(
            select(suppressions.c.address).where(suppressions.c.address == digest)
        ).first():
            return False
    current = connection.execute(
        select(suppressions.c.reason).where(suppressions.c.address == key)
    ).scalar()
    if current is None:
        try:
            with connection.begin_nested():
                connection.execute(
                    insert(suppressions).values(
                        address=key, reason=reason, source=source, event_id=event_id, created_at=now
                    )
                )
            return True
        except IntegrityError:
            pass  # inserted by another transaction since the read
    _strengthen(connection, key, reason=reason, source=source, event_id=event_id)
    return False


def _strengthen(
    connection: Connection, key: str, *, reason: str, source: str, event_id: str | None
) -> None:
    strength = STRENGTH.get(reason, 0)
    if strength <= 0:
        return
    as_strong = [name for name, value in STRENGTH.items() if value >= strength]
    for _ in range(5):  # another writer changed the row between read and write: read again
        current = connection.execute(
            select(suppressions.c.reason, suppressions.c.source).where(
                suppressions.c.address == key
            )
        ).first()
        if current is None or current.reason in as_strong:
            return
        changed = connection.execute(
            update(suppressions)
            .where(
                suppressions.c.address == key,
                suppressions.c.reason == current.reason,
                suppressions.c.source == current.source,
            )
            .values(
                reason=reason,
                source=with_origin(source, origin_of(current.reason, current.source)),
                event_id=event_id,
            )
        ).rowcount
        if changed:
            return


def top_source(source: str) -> str:
    """Who wrote the row's reason (``source`` without the origin it replaced)."""
    return source.split(_WAS, 1)[0]


def origin_of(reason: str, source: str) -> tuple[str, str] | None:
    """The suppression made outside webhooks that a row holds, if any, as (reason, source):
    the row itself when no webhook wrote it, else the one its webhook replaced."""
    if not source.startswith(WEBHOOK):
        return reason, source
    if _WAS not in source:
        return None
    kept_reason, _, kept_source = source.split(_WAS, 1)[1].partition(_FROM)
    return (kept_reason, kept_source) if kept_reason in STRENGTH and kept_source else None


def with_origin(source: str, origin: tuple[str, str] | None) -> str:
    """``source``, noting the non-webhook suppression it replaces (cut to the column)."""
    if origin is not None and source.startswith(WEBHOOK):
        source = f"{source}{_WAS}{origin[0]}{_FROM}{origin[1]}"
    return source[: suppressions.c.source.type.length]


def replace(
    connection: Connection,
    address: str,
    *,
    reason: str | None,
    source: str,
    event_id: str | None,
) -> None:
    """Set ``address``'s plain row to exactly this reason (weaker too), or delete it (None):
    for re-normalization, which may find the old mapping asked for too much."""
    key = normalize(address)
    if reason is None:
        connection.execute(delete(suppressions).where(suppressions.c.address == key))
        return
    connection.execute(
        update(suppressions)
        .where(suppressions.c.address == key)
        .values(
            reason=reason, source=source[: suppressions.c.source.type.length], event_id=event_id
        )
    )


def plain_rows(connection: Connection, addresses: Iterable[str]) -> dict[str, Row]:
    """The plain (not hashed) rows of these addresses, by normalized address."""
    keys = sorted({normalize(a) for a in addresses})
    found: dict[str, Row] = {}
    for start in range(0, len(keys), 500):
        rows = connection.execute(
            select(suppressions).where(
                one_of(connection, suppressions.c.address, keys[start : start + 500])
            )
        ).all()
        found.update({row.address: row for row in rows})
    return found


def reasons_for(connection: Connection, addresses: Iterable[str]) -> dict[str, str]:
    """Each suppressed one of ``addresses`` (normalized) and its reason, hashed rows included."""
    keys = sorted({normalize(a) for a in addresses})
    if not keys:
        return {}
    secret = privacy_keys.get(connection, privacy_keys.SUPPRESSION)
    owner = {key: key for key in keys}
    if secret is not None:
        owner.update({hashed(secret, key): key for key in keys})
    lookup = sorted(owner)
    found: dict[str, str] = {}
    size = ids_per_statement(connection)
    for start in range(0, len(lookup), size):
        rows = connection.execute(
            select(suppressions.c.address, suppressions.c.reason).where(
                one_of(connection, suppressions.c.address, lookup[start : start + size])
            )
        ).all()
        for row_key, reason in rows:
            address = owner[row_key]
            if STRENGTH.get(reason, 0) >= STRENGTH.get(found.get(address, ""), 0):
                found[address] = reason
    return found


def erase(connection: Connection, address: str, now: datetime) -> tuple[int, int]:
    """Keep ``address``'s suppression only as its hash; suppress it by hash if it was not.

    Returns ``(hashed, added)``: plain rows replaced by the hashed one, and hashed rows made
    for an address that was not suppressed. Both are 0 when it was erased before.
    """
    key = normalize(address)
    digest = hashed(privacy_keys.ensure(connection, privacy_keys.SUPPRESSION, now), key)
    plain = connection.execute(select(suppressions).where(suppressions.c.address == key)).first()
    existing = connection.execute(
        select(suppressions.c.address).where(suppressions.c.address == digest)
    ).first()
    if plain is not None:
        connection.execute(delete(suppressions).where(suppressions.c.address == key))
    if existing is not None:
        return (1 if plain is not None else 0), 0
    # Why it was suppressed stays (not who): the reason and source of the plain row.
    source = f"erasure; was {plain.reason} from {plain.source}" if plain else "erasure"
    try:
        with connection.begin_nested():
            connection.execute(
                insert(suppressions).values(
                    address=digest,
                    reason=ERASED,
                    source=source[: suppressions.c.source.type.length],
                    event_id=plain.event_id if plain is not None else None,
                    created_at=plain.created_at if plain is not None else now,
                )
            )
    except IntegrityError:
        return (1 if plain is not None else 0), 0  # an erasure running at the same time
    return (1, 0) if plain is not None else (0, 1)
