"""Provider outcomes offered back to the product: ``read_outcomes()`` with a cursor.

What the providers report (``webhooks.ingest`` stores it in ``email_events``) comes back as
``Outcome`` values naming the product's own ``event_id``, ``aggregate_id`` and route. Delivery
is at least once: a consumer keeps its cursor only after handling a page, and may see an
outcome again (a page handled but not acknowledged, or a webhook re-normalized by ``webhooks
reprocess``), always with the same ``outcome_id``, so it makes its handling idempotent on
that id. The Dagster sensor ``email_outcomes_sensor`` runs a configured callback this way.
"""

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

from email_platform.common.config import OUTCOME_HANDLER_SETTING
from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import as_utc
from email_platform.store import outcome_feed

#: delivered | bounced | complained | unsubscribed
OUTCOME_KINDS = outcome_feed.OUTCOME_KINDS
#: The most outcomes one ``read_outcomes`` call returns.
MAX_LIMIT = 5000


@dataclass(frozen=True)
class Outcome:
    """One provider outcome of a message the product caused."""

    #: Stable across re-reads and re-normalization: the consumer's idempotency key.
    outcome_id: str
    #: delivered | bounced | complained | unsubscribed
    kind: str
    #: The event ``publish()`` returned, and its aggregate and type (None if since purged).
    event_id: str
    aggregate_id: str | None
    event_type: str | None
    #: The route whose message this is (None when the provider's report matched no message).
    route: str | None
    message_id: int | None
    provider: str
    provider_message_id: str | None
    #: The address; None once the person was erased (``email-platform erase``).
    recipient: str | None
    #: hard | soft for a bounce.
    bounce_type: str | None
    occurred_at: datetime
    #: Where this outcome sits in the feed (a page's ``cursor`` is what to pass on).
    position: int


@dataclass(frozen=True)
class OutcomePage:
    """Outcomes after a cursor, and the cursor to read on from once they are handled."""

    outcomes: list[Outcome]
    cursor: int


def outcome_id(provider: str, provider_event_id: str) -> str:
    """The stable id of a provider's event: the same whenever and however often it is read."""
    return hashlib.sha256(f"{provider}\0{provider_event_id}".encode()).hexdigest()[:32]


def read_outcomes(connection: Connection, *, after: int = 0, limit: int = 500) -> OutcomePage:
    """The outcomes after cursor ``after`` (0: from the start), oldest first, at most ``limit``.

    Pass the page's ``cursor`` as ``after`` next time, once its outcomes are handled; it
    moves past non-outcome events (opens, clicks) too. Never returns an outcome whose
    neighbours with smaller positions are still uncommitted, so a cursor skips nothing. On
    PostgreSQL the transaction must be READ COMMITTED (the default).
    """
    if not isinstance(after, int) or after < 0:
        raise ValueError(f"after: expected a cursor (an int >= 0), got {after!r}")
    if not isinstance(limit, int) or not 0 < limit <= MAX_LIMIT:
        raise ValueError(f"limit: expected 1 to {MAX_LIMIT}, got {limit!r}")
    upto = outcome_feed.settled_watermark(connection)
    if upto <= after:
        return OutcomePage([], after)
    rows = outcome_feed.outcomes_between(connection, after, upto, limit)
    outcomes = [
        Outcome(
            outcome_id=outcome_id(row.provider, row.provider_event_id),
            kind=row.event_type,
            event_id=row.event_id,
            aggregate_id=row.aggregate_id,
            event_type=row.source_event_type,
            route=row.route,
            message_id=row.message_id,
            provider=row.provider,
            provider_message_id=row.provider_message_id,
            recipient=row.recipient,
            bounce_type=row.bounce_type,
            occurred_at=as_utc(row.occurred_at),  # type: ignore[arg-type]  # never NULL
            position=row.email_event_id,
        )
        for row in rows
    ]
    # A full page stops at its last outcome; a short one read everything up to the watermark.
    cursor = outcomes[-1].position if len(outcomes) == limit else upto
    return OutcomePage(outcomes, cursor)


#: What a product hands the outcome sensor: called with each page's outcomes; returning means
#: handled (the cursor moves on), raising means not (the same outcomes come again next tick).
OutcomeHandler = Callable[[list[Outcome]], object]


def load_handler(spec: str) -> OutcomeHandler:
    """The callable ``spec`` names: ``"package.module:NAME"``."""
    module_name, colon, attribute = spec.strip().partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigurationError(
            f"{OUTCOME_HANDLER_SETTING}={spec!r}: expected 'package.module:NAME' (a callable "
            "taking a list of Outcome)"
        )
    try:
        value = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"{OUTCOME_HANDLER_SETTING}={spec!r}: {exc}") from None
    if not callable(value):
        raise ConfigurationError(f"{OUTCOME_HANDLER_SETTING}={spec!r} is not callable")
    return value  # type: ignore[no-any-return]
