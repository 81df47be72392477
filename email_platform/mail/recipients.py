"""Recipient resolvers: look the current address up at send time (consent-sensitive mail)."""

from typing import Protocol

from sqlalchemy import Engine, column, select, table


class RecipientResolver(Protocol):
    def lookup(self, key: str) -> str | None:
        """The address for ``key`` (e.g. a user id), or None if there is no such recipient."""
        ...


class SqlDirectoryResolver:
    """Reads the address from the application's own users table, cached for one run."""

    def __init__(
        self,
        engine: Engine,
        *,
        table_name: str = "users",
        key_column: str = "id",
        email_column: str = "email",
    ) -> None:
        self._engine = engine
        users = table(table_name, column(key_column), column(email_column))
        self._key = users.c[key_column]
        self._email = users.c[email_column]
        self._cache: dict[str, str | None] = {}

    def lookup(self, key: str) -> str | None:
        if key not in self._cache:
            with self._engine.connect() as connection:
                self._cache[key] = connection.execute(
                    select(self._email).where(self._key == key)
                ).scalar()
        return self._cache[key]


class NoResolver:
    """For deployments without a directory: any route that needs one fails permanently."""

    def lookup(self, key: str) -> str | None:
        return None
