"""An analyst's read-only connection in another process never blocks or breaks a refresh and
never sees a half-built table: the funnel, the daily table and the messages always agree.
"""

import json
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta

from bench.generate import generate
from email_platform import warehouse

READER = textwrap.dedent(
    """
    import json, sys, time
    import duckdb

    path, mode, stop_file = sys.argv[1], sys.argv[2], sys.argv[3]
    import os
    CONSISTENT = (
        "SELECT (SELECT count(*) FROM email_funnel), "
        "(SELECT coalesce(sum(messages), 0) FROM email_funnel_daily), "
        "(SELECT count(*) FROM stg_sends)"
    )
    # hold: one connection open across every refresh. reopen: a new connection per read.
    # (Two connections in one process share DuckDB's cached instance, hence two processes.)
    held = duckdb.connect(path, read_only=True) if mode == "hold" else None
    reads, errors, seen = 0, [], set()
    deadline = time.monotonic() + 120
    print("ready", flush=True)
    while time.monotonic() < deadline and not os.path.exists(stop_file):
        try:
            connection = held or duckdb.connect(path, read_only=True)
            funnel, daily, sends = connection.execute(CONSISTENT).fetchone()
            if held is None:
                connection.close()
            if not funnel == daily == sends:
                errors.append(f"inconsistent snapshot: {funnel} {daily} {sends}")
            seen.add(funnel)
            reads += 1
        except Exception as exc:
            errors.append(repr(exc))
        time.sleep(0.01)
    print(json.dumps({"reads": reads, "errors": errors[:5], "seen": sorted(seen)}), flush=True)
    """
)


def test_reader_in_another_process_never_blocks_or_sees_a_partial_build(tmp_path):
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    path = tmp_path / "warehouse.duckdb"
    stop = tmp_path / "stop"
    now = datetime.now(UTC)
    generate(url, messages=2_000, days=3, end=now, seed=1)
    warehouse.refresh(url, path)
    readers = {
        mode: subprocess.Popen(
            [sys.executable, "-c", READER, str(path), mode, str(stop)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for mode in ("hold", "reopen")
    }
    try:
        for reader in readers.values():
            assert reader.stdout.readline().strip() == "ready"
        started = time.monotonic()
        for round_ in range(6):
            # New rows carry newer timestamps than anything loaded, as in the real system.
            end = now + timedelta(hours=round_ + 1)
            generate(url, messages=1_000, days=0.02, end=end, seed=10 + round_,
                     late_events_for_existing=200)  # fmt: skip
            summary = warehouse.refresh(url, path)
            assert summary.total_loaded > 0
        assert time.monotonic() - started < 60  # never waited on a reader
        time.sleep(0.5)
        stop.touch()
        reports = {
            mode: json.loads(reader.communicate(timeout=60)[0].strip().splitlines()[-1])
            for mode, reader in readers.items()
        }
    finally:
        for reader in readers.values():
            reader.kill()
    for report in reports.values():
        assert report["errors"] == []
        assert report["reads"] > 10
    # The held connection kept its consistent snapshot; new connections saw new snapshots.
    assert reports["hold"]["seen"] == [2_000]
    assert len(reports["reopen"]["seen"]) >= 2
    assert reports["reopen"]["seen"][-1] == 8_000
