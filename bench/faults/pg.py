"""A PostgreSQL cluster the fault harness owns, so it may stop, restart and lock it at will.

The machine's shared server is never restarted: the harness runs ``initdb`` into its work
directory and ``pg_ctl`` on a free loopback port, with the binaries of the machine's PostgreSQL
(``/usr/lib/postgresql/*/bin``, or on ``PATH``) or, on a machine with only Python, those the
``pgserver`` package ships. As root the commands run as the ``postgres`` user, since
PostgreSQL refuses to run as root.
"""

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from sqlalchemy import create_engine, text


def _bin_dir() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if versions:
        return Path(versions[-1]).parent
    import pgserver  # a PostgreSQL shipped on PyPI (a dev dependency)

    return Path(pgserver.__file__).parent / "pginstall" / "bin"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PgCluster:
    """``initdb`` + ``pg_ctl`` on a free port under ``root``; trust auth for ``postgres``."""

    def __init__(self, root: Path) -> None:
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            # The postgres user may not be able to reach ``root`` (pytest's tmp_path is private
            # to root): the cluster lives in a directory of its own under the system temp dir.
            root = Path(tempfile.mkdtemp(prefix=f"faults_{root.name}_"))
        self.root = root
        self.data = root / "data"
        self.port = _free_port()
        self.bin = _bin_dir()

    @property
    def server_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bin / args[0]), *args[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def init(self) -> "PgCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        if self._as_postgres:
            shutil.chown(self.root, "postgres")
            os.chmod(self.root, 0o755)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\nmax_connections = 200\n"
                "fsync = on\nshared_buffers = 64MB\n"
            )
        return self

    def start(self) -> None:
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def restart(self, down_s: float = 0.0, mode: str = "immediate") -> None:
        """Stop (``immediate``: as a crash would, no checkpoint), stay down, start again."""
        self.stop(mode)
        time.sleep(down_s)
        self.start()

    def create_database(self, name: str) -> str:
        engine = create_engine(f"{self.server_url}/postgres", isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return f"{self.server_url}/{name}"

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
