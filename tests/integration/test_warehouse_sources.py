"""Attaching the operational database to DuckDB: connection strings and clear refusals."""

import re

import duckdb
import pytest
from sqlalchemy import create_engine, make_url

from email_platform.warehouse import scanners
from email_platform.warehouse.scanners import SourceUnavailableError, attach, libpq_dsn


def test_libpq_dsn_quotes_values_and_keeps_socket_and_ssl_options():
    url = make_url("postgresql+psycopg://app:p%27w%5Cd@db.internal:6432/mail?sslmode=require")
    assert libpq_dsn(url) == (
        "host='db.internal' port='6432' dbname='mail' user='app' password='p\\'w\\\\d' "
        "sslmode='require'"
    )
    socket = make_url("postgresql://postgres:@/postgres?host=/tmp/pg%20dir")
    assert libpq_dsn(socket) == "host='/tmp/pg dir' dbname='postgres' user='postgres' password=''"


def test_in_memory_sqlite_is_refused_with_the_reason():
    connection = duckdb.connect()
    with pytest.raises(SourceUnavailableError, match="in-memory"):
        attach(connection, create_engine("sqlite://"))


def test_a_missing_extension_names_the_package_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(duckdb, "__version__", "0.0.1")
    with pytest.raises(
        SourceUnavailableError, match=re.escape("duckdb-extension-sqlite-scanner==0.0.1")
    ):
        scanners.extension_file("sqlite_scanner", "duckdb_extension_sqlite_scanner")
    with pytest.raises(
        SourceUnavailableError, match=re.escape("pip install no-such-package==0.0.1")
    ):
        scanners.extension_file("x", "no_such_package")


def test_attached_sqlite_is_read_only(tmp_path):
    path = tmp_path / "app.sqlite3"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, at DATETIME)")
        connection.exec_driver_sql("INSERT INTO t VALUES (1, '2026-11-29 10:00:00.000000')")
    duck = duckdb.connect()
    source = attach(duck, engine)
    assert duck.execute(f"SELECT id FROM {source.table('t')}").fetchall() == [(1,)]
    query = source.native_query("SELECT id FROM t WHERE at >= '2026-11-29 09:00:00.000000'")
    assert duck.execute(f"SELECT CAST(id AS BIGINT) FROM {query}").fetchall() == [(1,)]
    with pytest.raises(duckdb.Error, match=r"read-only|read only"):
        duck.execute(f"INSERT INTO {source.table('t')} VALUES (2, NULL)")


def test_attached_sqlite_keeps_one_scanner_connection_open_without_blocking_writers(tmp_path):
    """While attached, one scanner connection stays open (so concurrent readers never wait a
    whole second for a WAL index rebuild): the application still commits meanwhile, readers
    see the commit, and detach lets it go."""
    from email_platform.db.engine import make_engine

    path = tmp_path / "app.sqlite3"
    engine = make_engine(f"sqlite:///{path}")  # the application's settings: WAL
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        connection.exec_driver_sql("INSERT INTO t VALUES (1)")
    duck = duckdb.connect()
    source = attach(duck, engine)
    assert source.keeper is not None
    with engine.begin() as connection:  # BEGIN IMMEDIATE: a writer gets through
        connection.exec_driver_sql("INSERT INTO t VALUES (2)")
    assert duck.execute(f"SELECT count(*) FROM {source.table('t')}").fetchone() == (2,)
    scanners.detach(duck, source)
    with pytest.raises(duckdb.Error):
        source.keeper.execute("SELECT 1")  # closed with the source
    engine.dispose()


def test_only_the_refresh_connection_skips_the_signature_check_and_it_fetches_nothing(tmp_path):
    """The refresh's writer connection loads the scanner without hashing it (70-100 ms of every
    refresh), which is only sound because it can load nothing else: no extension is installed
    or autoloaded on demand there. An analyst's read-only connection keeps DuckDB's checks."""
    from email_platform import warehouse
    from email_platform.warehouse import files

    settings = (
        "SELECT current_setting('allow_unsigned_extensions'), "
        "current_setting('autoinstall_known_extensions'), "
        "current_setting('autoload_known_extensions')"
    )
    writer = files.connect(tmp_path / "w.duckdb", read_only=False)
    try:
        assert writer.execute(settings).fetchone() == (True, False, False)
        engine = create_engine(f"sqlite:///{tmp_path / 'app.sqlite3'}")
        with engine.begin() as connection:
            connection.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        source = attach(writer, engine)
        loaded = writer.execute(
            "SELECT extension_name FROM duckdb_extensions() "
            "WHERE loaded AND install_mode <> 'STATICALLY_LINKED'"
        ).fetchall()
        assert loaded == [("sqlite_scanner",)]
        scanners.detach(writer, source)
    finally:
        writer.close()
    reader = warehouse.connect_read_only(tmp_path / "w.duckdb")
    try:
        assert reader.execute(settings).fetchone() == (False, True, True)
    finally:
        reader.close()


def test_every_change_marker_the_warehouse_reads_by_is_indexed(engine):
    """Each refresh reads only rows whose change marker moved since the last one, by a query
    the source database runs itself: without an index on a marker, that read scans the whole
    table on every refresh, on both backends."""
    from sqlalchemy import inspect

    from email_platform.warehouse import DELETIONS, SOURCES

    markers = {(source.name, marker) for source in SOURCES for marker in source.markers}
    markers.add((DELETIONS, "deleted_at"))
    inspector = inspect(engine)
    leading = {
        (table, index["column_names"][0])
        for table in {table for table, _ in markers}
        for index in inspector.get_indexes(table)
    }
    assert markers - leading == set()
