"""One dagster.yaml for every local instance: ``render_dagster_yaml()`` renders the demo's (its
default, byte-for-byte what the demo wrote before the bench shared it) and the send benchmark's
(PostgreSQL storage, the same settings the bench wrote for itself). Both must parse as YAML and
pass Dagster's own instance-config validation, without a daemon or a database.
"""

from pathlib import Path

import yaml

# Private, but it is what DagsterInstance.from_config() validates with; Dagster is pinned.
from dagster._core.instance.config import dagster_instance_config

from email_platform.local.dagster_home import PostgresStorage, prepare_home, render_dagster_yaml

# What prepare_home() wrote before the template was shared (max_runs=6).
DEMO_YAML_BEFORE = """\
# Written by email-platform for local runs. Production: see deploy/dagster.yaml.
run_queue:
  max_concurrent_runs: 6
  dequeue_interval_seconds: 1
  dequeue_use_threads: true
  tag_concurrency_limits:
    # Bulk and transactional never take every slot: critical always has room.
    - key: email/lane
      value: bulk
      limit: 2
    - key: email/lane
      value: transactional
      limit: 3
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: 120
sensors:
  use_threads: true
  num_workers: 4
telemetry:
  enabled: false
"""

# What bench/send.py wrote for itself before, at its default --bulk-runs 2.
BENCH_YAML_BEFORE = """\
storage:
  custom:
    module: email_platform.jobs.storage
    class: HeldPostgresStorage
    config:
      postgres_db:
        hostname: 127.0.0.1
        port: 5432
        username: postgres
        password: ""
        db_name: bench_dagster_1
        scheme: postgresql+psycopg2
run_queue:
  max_concurrent_runs: 4
  dequeue_interval_seconds: 1
  dequeue_use_threads: true
  tag_concurrency_limits:
    - key: email/lane
      value: bulk
      limit: 2
    - key: email/lane
      value: transactional
      limit: 2
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  start_timeout_seconds: 180
sensors:
  use_threads: true
  num_workers: 4
telemetry:
  enabled: false
"""


def _bench_yaml() -> str:
    # The call bench/systems.py makes, at --bulk-runs 2.
    return render_dagster_yaml(
        max_runs=4,
        bulk_runs=2,
        transactional_runs=2,
        start_timeout_s=180,
        postgres=PostgresStorage(hostname="127.0.0.1", port=5432, db_name="bench_dagster_1"),
    )


def _validated(rendered: str, tmp_path: Path) -> dict:
    (tmp_path / "dagster.yaml").write_text(rendered)
    config, _instance_class = dagster_instance_config(str(tmp_path))
    return dict(config)


def test_the_default_is_the_demo_file_byte_for_byte(tmp_path):
    assert render_dagster_yaml() == DEMO_YAML_BEFORE
    prepare_home(tmp_path / "home")
    assert (tmp_path / "home" / "dagster.yaml").read_bytes() == DEMO_YAML_BEFORE.encode()


def test_the_default_keeps_storage_in_local_files(tmp_path):
    config = yaml.safe_load(render_dagster_yaml())
    assert set(config) == {"run_queue", "run_monitoring", "sensors", "telemetry"}
    queue = config["run_queue"]
    assert queue["max_concurrent_runs"] == 6
    limits = {limit["value"]: limit["limit"] for limit in queue["tag_concurrency_limits"]}
    assert limits == {"bulk": 2, "transactional": 3}
    assert config["run_monitoring"]["start_timeout_seconds"] == 120
    assert "storage" not in _validated(render_dagster_yaml(), tmp_path)


def test_the_bench_variant_is_what_the_bench_wrote_with_postgres_storage(tmp_path):
    rendered = _bench_yaml()
    config = yaml.safe_load(rendered)
    assert config == yaml.safe_load(BENCH_YAML_BEFORE)
    assert set(config) == {"storage", "run_queue", "run_monitoring", "sensors", "telemetry"}
    storage = config["storage"]["custom"]
    assert (storage["module"], storage["class"]) == (
        "email_platform.jobs.storage",
        "HeldPostgresStorage",
    )
    db = storage["config"]["postgres_db"]
    assert db["scheme"] == "postgresql+psycopg2" and db["db_name"] == "bench_dagster_1"
    # 2 + 2 of 4 slots leave critical no reserve, so the file must not claim one.
    assert "critical always has room" not in rendered
    assert _validated(rendered, tmp_path)["storage"]["custom"]["config"]["postgres_db"] == db
