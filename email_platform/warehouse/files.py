"""The warehouse's files: the published snapshot, the private writer file, the lock.

DuckDB allows one writing process per file, and a read-only connection in another process holds
a lock that stops any writer from opening the file. So the assets never write a file analysts
can open. They load and build in a private writer file (``<warehouse>.writer``), checkpoint and
close it, and ``os.replace`` it over ``<warehouse>``: the writer file itself becomes the
snapshot, and is not written while it is one. A reader that already has the old file open keeps
a consistent view of it (the old inode lives until it closes); a new reader sees the new
snapshot. Nobody ever sees a half-built table, and no reader can block or break a
materialization. The next refresh needs a private file again, equal to the new snapshot. Right
after publishing, the snapshot just replaced is patched into it: the two differ only in the
blocks this refresh's checkpoint wrote, so only those are written and flushed (about a tenth of
the file at 1M messages; copying the whole file cost 0.22 s for 320 MB and grew with the
warehouse). An analyst may still have the replaced snapshot open, and their view must never
change: it is then left alone and the new snapshot is copied instead. Whether anyone has it open
is read from the locks DuckDB holds on it and from this process's open files (``held_open``),
and the patch takes the writer's lock itself, so a reader that opens the file in between gets a
lock error, never a changing file. Building in place would be cheaper but is not correct with
readers around. Refreshes are serialized by an ``flock`` on ``<warehouse>.lock``.

Also here: the connections to those files (the writer's settings, the read-only reader's) and
``literal``, the SQL literal the refresh's own statements use instead of bound parameters.
"""

import fcntl
import glob
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

import duckdb

from email_platform.warehouse.scanners import SCANNER_HOST_CONFIG, sql_string

LOCK_TIMEOUT_S = 600.0
WRITER_CATALOG = "warehouse"
ROW_GROUP_ROWS = 16_384


def writer_path(warehouse_path: str | os.PathLike[str]) -> Path:
    """The private file the assets build in; analysts never open it."""
    return Path(f"{os.fspath(warehouse_path)}.writer")


def lock_path(warehouse_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(warehouse_path)}.lock")


@contextmanager
def writer_lock(
    warehouse_path: str | os.PathLike[str], timeout_s: float = LOCK_TIMEOUT_S
) -> Iterator[None]:
    """One refresh at a time per warehouse, across processes; waits up to ``timeout_s``."""
    path = lock_path(warehouse_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another refresh of {warehouse_path} held the lock for {timeout_s}s"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def connect(
    path: str | os.PathLike[str], *, read_only: bool, whole: bool = False
) -> duckdb.DuckDBPyConnection:
    """Open a warehouse file. A writer appends in small row groups, unless it writes the
    tables ``whole`` (a full build, a compaction): those keep DuckDB's own size."""
    if read_only:
        connection = duckdb.connect(os.fspath(path), read_only=True)
    else:
        # The writer file is attached to an in-memory host so it can take a row group size:
        # a checkpoint rewrites the row group each table's new rows were appended to, so small
        # row groups make a refresh's checkpoint small (measured at 1M messages: 0.13-0.22 s
        # instead of 0.15-0.9 s with DuckDB's 122,880 rows). But a checkpoint also rewrites
        # the list of every row group of each table it writes, so the history itself is kept
        # in DuckDB's large ones: a full build or a compaction (which merges the small ones)
        # writes them (at 10M messages, 0.4 s of each refresh's checkpoint was that list).
        # Loads the source's scanner without hashing it first (see SCANNER_HOST_CONFIG).
        connection = duckdb.connect(config=SCANNER_HOST_CONFIG)
        options = "" if whole else f" (ROW_GROUP_SIZE {ROW_GROUP_ROWS})"
        connection.execute(f"ATTACH {sql_string(os.fspath(path))} AS {WRITER_CATALOG}{options}")
        # Loads may write rows in any order (every model query says ORDER BY where it matters):
        # measured 1.8x faster bulk loads on two cores.
        connection.execute("SET preserve_insertion_order = false")
        # Every refresh ends in a checkpoint anyway. With a zero threshold the commit itself
        # checkpoints and skips the write-ahead log: each change is written to disk once, not
        # to the log and then again to the file (measured: the commit no longer writes 3.3 MB
        # of log before a 2.6 MB checkpoint). A crash mid-checkpoint leaves the file as the
        # last checkpoint left it, as a crash before the commit would.
        connection.execute("SET checkpoint_threshold = '0b'")
        # No FSST for strings: analysing and compressing with it was about a quarter of what
        # inserting new rows cost, and the warehouse's strings are mostly unique ids (ULIDs,
        # provider ids) it shrinks by a third at best. Measured at 1M messages: file 419 ->
        # 561 MB, full build 17.6 -> 14.7 s, an incremental refresh ~10% faster (median of
        # five pairs 1.29 -> 1.13 s), analyst questions as fast or faster (no decompression).
        # Dictionary compression still serves repeated strings (templates, lanes, statuses).
        connection.execute("SET disabled_compression_methods = 'fsst'")
    configure_session(connection)
    return connection


def configure_session(connection: duckdb.DuckDBPyConnection) -> None:
    """Per-connection settings; also for the cursors a refresh opens on its writer."""
    if connection.execute("SELECT current_database()").fetchone()[0] == "memory":
        connection.execute(f"USE {WRITER_CATALOG}")
    # Every timestamp in the warehouse is naive UTC; keep functions from applying a local zone.
    connection.execute("SET TimeZone = 'UTC'")


def connect_read_only(warehouse_path: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """What an analyst opens: the published snapshot, read-only. Never blocks a refresh."""
    return connect(warehouse_path, read_only=True)


def literal(value: str | int | datetime | None) -> str:
    """A SQL literal for the refresh's own statements. They bind no parameters: DuckDB's
    Python client imports pandas on the first bound parameter, 0.18 s of every refresh run."""
    if value is None:
        return "NULL"
    if isinstance(value, datetime):
        return f"TIMESTAMP '{value.isoformat(sep=' ')}'"
    if isinstance(value, int):
        return str(int(value))
    return sql_string(str(value))


# ---------------------------------------------------------------------------------------------
# Publishing: the next writer file, patched or copied


def connect_writer(warehouse_path: Path, writer: Path, *, whole: bool) -> duckdb.DuckDBPyConnection:
    """Open the writer file read-write. If a reader in another process locked it between the
    check and here (it is a former snapshot), start over from a copy of the snapshot: DuckDB's
    lock refuses the writer, so the reader's file is never written under it."""
    try:
        return connect(writer, read_only=False, whole=whole)
    except duckdb.IOException as error:
        if whole or not warehouse_path.exists() or "lock" not in str(error).lower():
            raise
    copy_durably(warehouse_path, writer)
    return connect(writer, read_only=False)


def detach_writer(connection: duckdb.DuckDBPyConnection, writer: Path) -> None:
    """Close the writer file (and release its lock) but not the connection that held it.

    DETACH leaves the file open while another cursor of the connection is in a transaction
    that read it: then the whole connection is closed, so no file of this process's is ever
    published open (its lock would refuse readers, and closing it later could write to it).
    """
    connection.execute("USE memory")
    connection.execute(f"DETACH {WRITER_CATALOG}")
    if _open_in_this_process(os.stat(writer)):
        connection.close()


def prepare_next_writer(snapshot: Path, writer: Path, retired: Path | None) -> str:
    """Give the next refresh a private writer file equal to the new snapshot; returns how it
    was made: "patched" or "copied".

    The snapshot this refresh replaced (``retired``) differs from the new one only in the
    blocks this refresh's checkpoint wrote (about a tenth of the file at 1M messages): patching
    those into it reads both files but writes and flushes only the difference, where a copy
    writes and flushes the whole file. It is copied instead when an analyst still has the old
    snapshot open: their view must never change under them.
    """
    if retired is not None:
        try:
            if not held_open(retired):
                _patch_durably(snapshot, writer, retired)
                return "patched"
        except _HeldOpenError:
            pass  # a reader locked it after the check; the patch wrote nothing
        retired.unlink(missing_ok=True)
    # Flushed, so the next checkpoint only syncs its own writes.
    copy_durably(snapshot, writer)
    return "copied"


class _HeldOpenError(Exception):
    """A reader holds the file that was to be patched."""


PATCH_CHUNK = 256 * 1024  # DuckDB's block size: a changed block costs one chunk written


def _patch_durably(source: Path, target: Path, stale: Path) -> None:
    """Make ``stale`` byte-identical to ``source`` by writing only the chunks that differ, and
    rename it to ``target``. Like ``copy_durably``, a crash leaves no ``target`` or a whole
    one: the patch happens under a temporary name that the next refresh removes."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    os.replace(stale, temporary)
    try:
        with open(source, "rb", buffering=0) as reader, open(temporary, "r+b") as patched:
            try:
                # The same lock DuckDB's writer takes: a reader in another process that opened
                # the old snapshot just before it was replaced cannot lock it while it changes.
                fcntl.lockf(patched, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise _HeldOpenError(stale) from None
            _write_differences(reader, patched)
            os.fsync(patched.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _write_differences(source: BinaryIO, target: BinaryIO) -> None:
    """Overwrite the chunks of ``target`` that differ from ``source``; end it where it ends."""
    theirs, ours = bytearray(PATCH_CHUNK), bytearray(PATCH_CHUNK)
    descriptor = target.fileno()
    offset = 0
    while read := source.readinto(theirs):
        present = os.preadv(descriptor, [ours], offset)
        # bytearray == bytearray is one memcmp; slicing copies, so only for the last chunk.
        if read == present == PATCH_CHUNK:
            same = theirs == ours
        else:
            same = present >= read and theirs[:read] == ours[:read]
        if not same:
            os.pwrite(descriptor, memoryview(theirs)[:read], offset)
        offset += read
    os.ftruncate(descriptor, offset)


def held_open(path: Path) -> bool:
    """Whether any process (this one included) may be reading ``path``'s file: DuckDB takes a
    shared ``fcntl`` lock on the whole file for each read-only connection, for as long as it
    is open. POSIX record locks do not conflict within one process, and closing any descriptor
    of a file drops all of this process's locks on it, so this process counts as holding the
    file while it has any descriptor of it open (``/proc/self/fd``), and only otherwise is a
    probe opened to ask for another process's lock (``F_GETLK``). (Reading ``/proc/locks``
    instead waited 5-27 ms for the kernel on every refresh.) Unknown counts as held: copying
    is always safe."""
    try:
        wanted = os.stat(path)
        if _open_in_this_process(wanted):
            return True
        return _locked_by_another_process(path)
    except OSError:
        return True


def _open_in_this_process(wanted: os.stat_result) -> bool:
    for name in os.listdir("/proc/self/fd"):
        try:
            found = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or the listing's own descriptor
        if (found.st_dev, found.st_ino) == (wanted.st_dev, wanted.st_ino):
            return True
    return False


# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (padded to 32 bytes).
_FLOCK = "hhxxxxqqixxxx"


def _locked_by_another_process(path: Path) -> bool:
    if struct.calcsize(_FLOCK) != 32 or not sys.platform.startswith("linux"):
        return True
    probe = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Would a write lock on the whole file be refused? (It reports other processes' locks.)
        asked = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        answer = fcntl.fcntl(probe, fcntl.F_GETLK, asked)
    finally:
        os.close(probe)  # this process held no lock on the file: nothing of ours is dropped
    return struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK


def retire(snapshot: Path) -> Path | None:
    """Give the current snapshot a second name to unlink later."""
    if not snapshot.exists():
        return None
    retired = snapshot.with_name(f".{snapshot.name}.{os.getpid()}.retired")
    os.link(snapshot, retired)
    return retired


def remove_leftovers(warehouse_path: Path) -> None:
    """Files a killed refresh left behind: an old snapshot's second name, a half-made copy
    (as big as the warehouse), spilled data. Refreshes hold the lock, so none of these is in
    use."""
    folder, name = warehouse_path.parent, glob.escape(warehouse_path.name)
    for pattern in (f".{name}.*.retired", f".{name}.writer.*.tmp"):
        for leftover in folder.glob(pattern):
            leftover.unlink(missing_ok=True)
    shutil.rmtree(spill_path(warehouse_path), ignore_errors=True)


def spill_path(warehouse_path: Path) -> Path:
    """Where DuckDB spills what exceeds a refresh's memory bound (removed after each refresh)."""
    return warehouse_path.with_name(f".{warehouse_path.name}.spill")


def copy_durably(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through a flushed temporary file and a rename, so a crash
    leaves either no ``target`` or a whole one."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(source, temporary)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()
