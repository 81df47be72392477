"""The storage benchmark measures what a real drain stores: a small drain through the daemon,
webhooks included, reported per application table. Figures are measured with ``python -m
bench.storage``; this checks the counts a bug would change, not sizes.
"""

import os
import time

import pytest

from bench.storage import StorageSettings, measure_storage
from email_platform.db.schema import metadata

EVENTS = 100


# Bounds only a hung drain reaches: the drain's time is bench.storage's figure, not asserted
# here. Each wait gets 240 s because CI runs this beside the fault drains, where a worker run's
# launch alone took most of the 60 s this once had (every event still outstanding at 60 s).
@pytest.mark.timeout(1200)
def test_storage_report_counts_every_table_of_a_small_drain(tmp_path, postgres_admin_url):
    if not postgres_admin_url.host:
        pytest.skip("the Dagster instance talks to PostgreSQL over TCP (host:port)")
    name = f"capacity_test_{os.getpid()}_{int(time.time())}"
    url = postgres_admin_url.set(database=name).render_as_string(hide_password=False)
    report = measure_storage(
        StorageSettings(
            database_url=url,
            events=EVENTS,
            # No critical trickle: the backlog alone, so every count below is exact.
            critical_per_s=0.0,
            timeout_s=240,
            workdir=tmp_path,
        )
    )

    daemon_log = tmp_path / "daemon.log"
    assert report["drained"] and report["events_not_done"] == 0, (
        daemon_log.read_text()[-4000:] if daemon_log.exists() else "no daemon log"
    )
    assert report["webhooks_posted"] and report["webhooks_ingested"]
    assert report["emails"] == report["events_published"] == EVENTS
    assert report["messages_by_status"] == {"sent": EVENTS}
    tables = report["app_tables"]
    assert set(tables) == set(metadata.tables)
    # One outbox row and one message per digest; at least one attempt each.
    assert tables["email_outbox"]["rows_per_email"] == 1.0
    assert tables["email_messages"]["rows_per_email"] == 1.0
    assert tables["email_attempts"]["rows_per_email"] >= 1.0
    # Every webhook the sandbox planned is stored once (duplicates shrugged off) and applied.
    planned = report["sandbox_stats"]["webhooks_planned"]
    assert planned >= EVENTS  # a delivered or a bounced event for every message
    assert tables["webhook_inbox"]["rows"] == planned
    assert tables["email_events"]["rows"] == planned
    for table in ("email_outbox", "email_messages", "email_attempts", "email_events"):
        figures = tables[table]
        assert figures["heap_bytes_per_email"] > 0 and figures["index_bytes_per_email"] > 0
        assert figures["total_bytes"] >= figures["heap_bytes"] + figures["index_bytes"]
        assert figures["compact"]["total_bytes"] > 0
    assert tables["dead_letters"]["rows"] == 0
    # Nothing of the product's own tables is counted as the platform's.
    assert "users" in report["other_app_tables"]
    dagster = report["dagster_tables"]
    assert dagster["event_logs"]["rows"] > 0 and dagster["runs"]["rows"] > 0
    by_job = report["dagster"]["event_log_by_job"]
    assert by_job["lane_worker_job"]["entries"] > 0
    assert by_job["ingest_webhooks_job"]["runs"] >= 1
    assert report["warehouse"]["file_bytes"] > 0
    assert report["warehouse"]["table_rows"]["email_funnel"] == EVENTS
