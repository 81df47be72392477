"""The send benchmark keeps working: its smallest size runs every system to the end and writes
the figures. No timing is asserted here; benchmarks are measured with ``python -m bench.send``.
"""

import json
import os
import subprocess
import sys

import pytest
import redis

pytestmark = pytest.mark.e2e


# It starts five systems one after another (several daemons and their runs): near the suite's
# 300 s hang guard on a loaded host, so it gets the 900 s its own subprocess is allowed.
@pytest.mark.timeout(960)
def test_bench_send_smallest_size_drains_and_writes_json(tmp_path, postgres_admin_url):
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/15").ping()
    except redis.RedisError:
        pytest.skip("the Celery baseline needs Redis at 127.0.0.1:6379")
    if not postgres_admin_url.host:
        pytest.skip("the benchmark talks to PostgreSQL over TCP (host:port)")
    auth = postgres_admin_url.username or "postgres"
    if postgres_admin_url.password:
        auth += f":{postgres_admin_url.password}"
    server = (
        f"{postgres_admin_url.drivername}://{auth}@{postgres_admin_url.host}:"
        f"{postgres_admin_url.port or 5432}"
    )
    out = tmp_path / "bench.json"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.send",
            "--events",
            "50",
            "--critical-per-s",
            "1",
            "--per-event-events",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "BENCH_POSTGRES": server.rstrip("/")},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(out.read_text())
    for key in (
        "emails_per_s",
        "baseline_emails_per_s",
        "ceiling_emails_per_s",
        "critical_p50_s",
        "critical_p99_s",
        "event_log_bytes_per_email",
        "peak_rss_mb",
        "events",
    ):
        assert key in figures
    assert figures["events"] == 50
    for system in ("dagster", "dagster-batch", "celery", "ceiling", "dagster-per-event"):
        result = figures["systems"][system]
        assert result["drained"] and result["not_done"] == 0
        # Every bulk event and every critical event published was accepted by the provider.
        sent = result["sent"] + result["warmup_sent"]
        assert sent == result["events"] + result["critical_published"]
