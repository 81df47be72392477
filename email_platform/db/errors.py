"""Telling a database that refuses a value from one that is down.

A refused value is the caller's to narrow (one event, one answer, one webhook) and never worth
retrying as it is; a database that is down, locked or gone is worth retrying whole.
"""

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError


def refused_by_database(exc: BaseException) -> bool:
    """Whether ``exc`` is the database (or its driver) refusing a value, not being down.

    Connection loss, timeouts, locks and deadlocks are ``OperationalError``/``InterfaceError``
    (or invalidate the connection). A refused value is a ``DataError``/``IntegrityError``/
    ``ProgrammingError``, or the driver's own ``ValueError`` or ``OverflowError`` (psycopg
    cannot encode a lone surrogate, sqlite3 an integer over 64 bits) before anything reached
    the server.
    """
    if isinstance(exc, DBAPIError):
        return not exc.connection_invalidated and not isinstance(
            exc, OperationalError | InterfaceError
        )
    return isinstance(exc, ValueError | OverflowError)


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database is down, locked or gone (worth retrying whole)."""
    if isinstance(exc, DBAPIError):
        return exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError)
    return False
