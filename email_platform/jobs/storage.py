"""Dagster's PostgreSQL storage, with the daemon's connections held open.

dagster-postgres opens a database connection for every read and write of its run, event-log
and schedule storage (a pool that holds none), so that the many short-lived instances a
deployment makes (one per run process, one per sensor evaluation) hold nothing between uses.
The daemon is the exception: one instance for its whole life, used by every daemon thread and
sensor worker, and under load it opened dozens of connections a second, each a server process
started and authenticated (measured in bench/README.md). ``HeldPostgresStorage`` is
``DagsterPostgresStorage`` that, in the ``dagster-daemon`` process only, keeps up to
``DAEMON_POOL_SIZE`` connections of each storage open, as the webserver does for itself
(``optimize_for_webserver``). Every other process gets dagster-postgres's own behaviour.

Configured in ``dagster.yaml`` as custom storage with dagster-postgres's own settings::

    storage:
      custom:
        module: email_platform.jobs.storage
        class: HeldPostgresStorage
        config:
          postgres_db: {...}
"""

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster._serdes.config_class import ConfigurableClassData
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import (
    create_pg_engine,
    get_token_provider_from_config,
    pg_url_from_config,
)

#: Connections each of the three storages keeps open in the daemon; more are opened while
#: that many are in use (sensor workers, the run queue's threads) and closed when returned.
DAEMON_POOL_SIZE = 4
DAEMON_MAX_OVERFLOW = 16
#: A held connection older than this is opened anew.
POOL_RECYCLE_S = 600
DAEMON_PROGRAM = "dagster-daemon"


def in_daemon(argv: list[str] | None = None) -> bool:
    """Whether this process is ``dagster-daemon``: the one process whose single instance lives
    as long as it does (run workers, code servers and the CLI make theirs as they go)."""
    program = (sys.argv if argv is None else argv)[:1]
    if not program:
        return False
    # ``dagster-daemon run``, or ``python -m dagster._daemon run`` (argv[0] is its __main__.py).
    path = Path(program[0])
    return path.name == DAEMON_PROGRAM or path.parts[-3:] == ("dagster", "_daemon", "__main__.py")


class HeldPostgresStorage(DagsterPostgresStorage):
    """``DagsterPostgresStorage`` whose connections the daemon keeps open (module docstring)."""

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: Any = None,
    ) -> None:
        super().__init__(postgres_url, should_autocreate_tables, inst_data, token_provider)
        if in_daemon():
            for storage in (self._run_storage, self._event_log_storage, self._schedule_storage):
                # The attribute every dagster-postgres storage connects through (the webserver's
                # optimize_for_webserver swaps it the same way).
                storage._engine = create_pg_engine(
                    postgres_url,
                    token_provider,
                    isolation_level="AUTOCOMMIT",
                    pool_size=DAEMON_POOL_SIZE,
                    max_overflow=DAEMON_MAX_OVERFLOW,
                    pool_recycle=POOL_RECYCLE_S,
                    # A held connection the server dropped (a restart, a failover, an idle
                    # timeout) is replaced before use instead of failing a tick.
                    pool_pre_ping=True,
                    # Named in pg_stat_activity, so an operator sees which sessions are held.
                    connect_args={"application_name": DAEMON_PROGRAM},
                )

    @classmethod
    def from_config_value(  # type: ignore[override]
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> "HeldPostgresStorage":
        """As dagster-postgres's, which builds a ``DagsterPostgresStorage`` by name."""
        return cls(
            inst_data=inst_data,
            postgres_url=pg_url_from_config(config_value),
            should_autocreate_tables=config_value.get("should_autocreate_tables", True),
            token_provider=get_token_provider_from_config(config_value),
        )
