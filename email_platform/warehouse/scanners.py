"""The operational database attached to a DuckDB connection, read by DuckDB's own scanners.

DuckDB's ``sqlite_scanner`` reads the SQLite file directly and ``postgres_scanner`` reads
PostgreSQL over binary COPY, in parallel, straight into columns: an order of magnitude faster
than rows through a Python driver (measured in ``bench/analytics.py``), and nothing is held in
Python memory. DuckDB would download these extensions from its own site at first use, which many
production hosts (and CI here) cannot reach, so they come from the PyPI wheels
``duckdb-extension-sqlite-scanner`` / ``duckdb-extension-postgres-scanner``, pinned to the
DuckDB version in ``pyproject.toml``: the binaries DuckDB itself publishes, installed next to
DuckDB's own library.

A connection made with ``SCANNER_HOST_CONFIG`` (the warehouse refresh's) loads them without
checking DuckDB's signature. That check hashes the 35 MB binary on every ``LOAD``: 70-100 ms of
each refresh, which is a fresh process. It guards a binary downloaded from an extension
repository; this one is a file of an installed, pinned wheel in the same site-packages as
DuckDB's library and this package's code, which load unchecked (whoever can change one can
change the others). The same config turns off installing and loading extensions on demand,
so such a connection loads no binary but the wheel's, by absolute path. Any other connection
(tests, tools) keeps DuckDB's defaults and checks the signature.
"""

import importlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import duckdb
from sqlalchemy import URL, Engine

# (extension, the PyPI package that ships it, DuckDB's ATTACH type, its native query function)
_SQLITE = ("sqlite_scanner", "duckdb_extension_sqlite_scanner", "sqlite", "sqlite_query")
_POSTGRES = ("postgres_scanner", "duckdb_extension_postgres_scanner", "postgres", "postgres_query")


# For the connection that attaches a source (see the module docstring): settings DuckDB only
# takes when a database is opened.
SCANNER_HOST_CONFIG = {
    "allow_unsigned_extensions": "true",
    "autoinstall_known_extensions": "false",
    "autoload_known_extensions": "false",
}


class SourceUnavailableError(RuntimeError):
    """The operational database cannot be attached (extension missing, in-memory SQLite...)."""


def extension_file(extension: str, package: str) -> Path:
    """The extension binary for the running DuckDB, from its PyPI wheel."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise SourceUnavailableError(
            f"DuckDB's {extension} extension is not installed: "
            f"pip install {package.replace('_', '-')}=={duckdb.__version__}"
        ) from None
    path = Path(module.__file__ or "").parent / "extensions" / f"v{duckdb.__version__}"
    path = path / f"{extension}.duckdb_extension"
    if not path.is_file():
        raise SourceUnavailableError(
            f"{package.replace('_', '-')} does not ship {extension} for DuckDB "
            f"{duckdb.__version__}; install the version matching DuckDB "
            f"(pip install {package.replace('_', '-')}=={duckdb.__version__})"
        )
    return path


def libpq_dsn(url: URL) -> str:
    """A libpq connection string for a SQLAlchemy PostgreSQL URL (query options kept)."""
    parts = {
        "host": url.host,
        "port": url.port,
        "dbname": url.database,
        "user": url.username,
        "password": url.password,
    }
    for key, value in url.query.items():
        parts[key] = value[-1] if isinstance(value, tuple) else value
    return " ".join(
        f"{key}={_libpq_quote(str(value))}" for key, value in parts.items() if value is not None
    )


def _libpq_quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def sql_string(value: str) -> str:
    """``value`` as a DuckDB string literal."""
    return "'" + value.replace("'", "''") + "'"


@dataclass(frozen=True)
class AttachedSource:
    """The operational database as catalog ``alias`` of a DuckDB connection (read-only)."""

    alias: str
    dialect: str  # "sqlite" | "postgresql"
    query_function: str
    # SQLite: a cursor whose open transaction keeps one scanner connection open (see attach).
    keeper: duckdb.DuckDBPyConnection | None = field(default=None, compare=False)

    def table(self, name: str) -> str:
        """A whole table, scanned by DuckDB in parallel (full loads)."""
        return (
            f'{self.alias}."{name}"'
            if self.dialect == "sqlite"
            else f'{self.alias}.public."{name}"'
        )

    def native_query(self, sql: str) -> str:
        """A FROM item that runs ``sql`` in the source database itself, so its indexes serve
        the WHERE clause (incremental loads read a few rows out of millions)."""
        return f"{self.query_function}({sql_string(self.alias)}, {sql_string(sql)})"

    def timestamp_literal(self, value: datetime) -> str:
        """``value`` as the source compares its timestamp columns: SQLAlchemy stores UTC text
        in SQLite (text order is time order) and ``timestamptz`` in PostgreSQL."""
        utc = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        if self.dialect == "sqlite":
            return "'" + utc.strftime("%Y-%m-%d %H:%M:%S.%f") + "'"
        return "'" + utc.isoformat() + "'::timestamptz"


def attach(
    connection: duckdb.DuckDBPyConnection, database: URL | Engine, alias: str = "source"
) -> AttachedSource:
    """Attach the database (its URL, or an engine's) read-only to ``connection`` as ``alias``."""
    url = database.url if isinstance(database, Engine) else database
    if url.get_backend_name() == "sqlite":
        extension, package, kind, function = _SQLITE
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            raise SourceUnavailableError(
                "the warehouse reads the SQLite database file directly; an in-memory or URI "
                f"database ({url.render_as_string(hide_password=True)}) cannot be read"
            )
        target = str(Path(database).resolve())
        dialect = "sqlite"
    elif url.get_backend_name() == "postgresql":
        extension, package, kind, function = _POSTGRES
        target = libpq_dsn(url)
        dialect = "postgresql"
    else:
        raise SourceUnavailableError(f"no DuckDB scanner for {url.get_backend_name()}")
    connection.execute(f"LOAD {sql_string(str(extension_file(extension, package)))}")
    connection.execute(f"ATTACH {sql_string(target)} AS {alias} (TYPE {kind}, READ_ONLY)")
    keeper = _keep_open(connection, alias) if dialect == "sqlite" else None
    return AttachedSource(alias=alias, dialect=dialect, query_function=function, keeper=keeper)


def _keep_open(connection: duckdb.DuckDBPyConnection, alias: str) -> duckdb.DuckDBPyConnection:
    """Hold one SQLite connection of the scanner open until ``detach``.

    The scanner opens a SQLite connection per DuckDB transaction, and a refresh reads on two
    threads at once. When none of them has the file open, the first to read rebuilds the WAL
    index while holding its lock, and a second reading meanwhile backs off by sleeping: the
    scanner's SQLite sleeps a whole second (seen with strace: one refresh in three took 1 s
    longer). A connection that has read the file keeps the index mapped in this process, so
    later readers never wait for a rebuild. It holds no snapshot between statements (it sees
    later commits, and does not keep a checkpoint from resetting the log), and it blocks no
    writer: the application database is in WAL mode (db.engine sets it).
    """
    keeper = connection.cursor()
    try:
        keeper.execute("BEGIN TRANSACTION")
        # Binding a table of the source makes the keeper's connection read the file (one that
        # only prepared a statement never touched the WAL index, and the sleeps went on). Only
        # the source: a transaction open on the warehouse would keep its commit from
        # checkpointing.
        table = connection.execute(
            f"SELECT table_name FROM duckdb_tables() WHERE database_name = {sql_string(alias)} "
            "LIMIT 1"
        ).fetchone()
        if table:
            keeper.execute(f'SELECT 1 FROM {alias}."{table[0]}" LIMIT 0').fetchall()
    except BaseException:
        keeper.close()
        raise
    return keeper


def detach(connection: duckdb.DuckDBPyConnection, source: AttachedSource) -> None:
    if source.keeper is not None:
        source.keeper.close()  # rolls its transaction back
    connection.execute(f"DETACH {source.alias}")
