"""Engines and migrations for the application database (SQLite by default, PostgreSQL in prod)."""

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import make_url

if TYPE_CHECKING:  # Alembic is needed to migrate, not by every process that imports this
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

# A run of 19 digits may be an integer past 64 bits, which orjson reads as a float.
_LONG_NUMBER = re.compile("[0-9]{19}")
_LONG_NUMBER_BYTES = re.compile(b"[0-9]{19}")


def json_loads(document: str | bytes) -> Any:
    """What ``json.loads`` reads from ``document``, decoded by orjson where the two agree.

    The engines decode every JSON column with it (a batch's payloads, on the send path). Where
    orjson would read otherwise, ``json.loads`` reads: a long run of digits (orjson reads an
    integer past 64 bits as a float), and whatever orjson refuses (``NaN``, which SQLite's
    JSON text can hold; a lone surrogate escape; a number past a double's range). It reads
    more in one way: orjson takes nesting up to 1,024 levels deep, where ``json.loads`` runs
    out of Python's recursion a little sooner and raises ``RecursionError``.
    """
    pattern = _LONG_NUMBER if isinstance(document, str) else _LONG_NUMBER_BYTES
    if pattern.search(document) is None:
        try:
            return orjson.loads(document)
        except orjson.JSONDecodeError:
            pass
    return json.loads(document)


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine that behaves the same way under concurrent processes on both backends.

    ``hide_parameters``: a statement's values (addresses, payloads) stay out of error texts,
    which end up in log lines and Dagster's event log, where erasure cannot reach them.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        # The pool hands a connection to one thread at a time; sqlite3's own same-thread check
        # only misfires when a pooled connection is reset from another thread.
        engine = create_engine(
            url,
            connect_args={"timeout": 60, "check_same_thread": False},
            hide_parameters=True,
            json_deserializer=json_loads,
        )
        _configure_sqlite(engine)
        return engine
    if parsed.drivername == "postgresql":
        # SQLAlchemy 2.1 maps bare postgresql:// to psycopg 3, which we install; say so.
        parsed = parsed.set(drivername="postgresql+psycopg")
    return create_engine(
        parsed,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=5,
        hide_parameters=True,
        json_deserializer=json_loads,
    )


def _configure_sqlite(engine: Engine) -> None:
    # The daemon, run workers and the CLI write from separate processes: WAL lets readers go on
    # while one writes, and BEGIN IMMEDIATE takes the write lock up front so two writers queue on
    # busy_timeout instead of failing with "database is locked" when a read upgrades to a write.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # type: ignore[no-untyped-def]
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def is_postgresql(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def alembic_config(engine: Engine) -> "Config":
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` (``email-platform db upgrade``)."""
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        if not inspect(connection).has_table("alembic_version"):
            return None
        return connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
