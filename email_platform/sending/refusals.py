"""Telling a database that refuses a value from one that is down, so a refusal is narrowed.

A refused value fails one event or one answer, never a batch: the callers split what failed
and dead-letter only what the database still refuses on its own. A database that is down,
locked or gone fails the attempt whole, and the attempt is retried.
"""

import dataclasses

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from email_platform.sending.types import BatchOutcome
from email_platform.text import storable_text


def refused_by_database(exc: BaseException) -> bool:
    """Whether ``exc`` is the database (or its driver) refusing a value, not being down.

    Connection loss, timeouts, locks and deadlocks are ``OperationalError``/``InterfaceError``
    (or invalidate the connection): those are retried whole. A refused value is a
    ``DataError``/``IntegrityError``/``ProgrammingError``, or the driver's own ``ValueError``
    (psycopg cannot encode a lone surrogate) before anything reached the server.
    """
    if isinstance(exc, DBAPIError):
        return not exc.connection_invalidated and not isinstance(
            exc, OperationalError | InterfaceError
        )
    return isinstance(exc, ValueError)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return storable_text(f"{type(exc).__name__}: {lines[0] if lines else ''}", 500) or ""


def restore_outcome(outcome: BatchOutcome, before: BatchOutcome) -> None:
    for name, value in dataclasses.asdict(before).items():
        setattr(outcome, name, value)
