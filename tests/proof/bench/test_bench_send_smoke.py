"""The send benchmark keeps working: at its smallest size it runs every setting of the matrix
(an instant and a slow sandbox, one message a call and batch calls) through the Celery
configurations it sweeps (prefork, and gevent in two worker processes), and one setting through
the Dagster system, the best Celery and the ceiling, each run ending with every event sent once,
and writes the per-setting figures. No timing is asserted here; benchmarks are measured with
``python -m bench.send``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

# The bench flushes its Redis database: never the one the Celery end-to-end tests use.
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")

PER_SETTING_KEYS = (
    "emails_per_s",
    "baseline_emails_per_s",
    "ceiling_emails_per_s",
    "critical_p50_s",
    "critical_p99_s",
    "event_log_bytes_per_email",
    "cpu_s_per_1k",
    "provider_latency_ms",
    "provider_batch",
)


@pytest.fixture
def bench_env(postgres_admin_url) -> dict[str, str]:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
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
    return {**os.environ, "BENCH_POSTGRES": server.rstrip("/"), "BENCH_REDIS_URL": REDIS_URL}


def _bench(env: dict[str, str], out: Path, *args: str) -> dict:
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "bench.send", "--events", "40", "--critical-per-s", "1"),
            *("--json", str(out), *args),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_all_sent(system: str, result: dict) -> None:
    assert result["drained"] and result["not_done"] == 0, system
    # Every bulk event and every critical event published was accepted by the provider once.
    sent = result["sent"] + result["warmup_sent"]
    assert sent == result["events"] + result["critical_published"], system
    assert result["provider_accepted"] == sent, system


@pytest.mark.timeout(480)
def test_bench_matrix_runs_every_celery_configuration_to_the_end(tmp_path, bench_env):
    report = _bench(
        bench_env,
        tmp_path / "matrix.json",
        *("--systems", "celery", "--provider-latency-ms", "0,20"),
        *("--provider-batch", "1,10", "--celery-instant", "prefork-2"),
        *("--celery-latency", "gevent-2x10", "--bulk-runs", "1", "--concurrency", "4"),
    )
    settings = report["settings"]
    assert [(s["provider_latency_ms"], s["provider_batch"]) for s in settings] == [
        (0, 1),
        (0, 10),
        (20, 1),
        (20, 10),
    ]
    for setting in settings:
        assert setting["provider"] == "sandbox"
        expected = "prefork-2" if setting["provider_latency_ms"] == 0 else "gevent-2x10"
        assert set(setting["systems"]) == {f"celery {expected}"}
        # The best (here the only) Celery configuration is the baseline.
        assert setting["baseline_config"] == expected
        celery = setting["systems"][f"celery {expected}"]
        assert setting["baseline_emails_per_s"] == celery["emails_per_s"] > 0
        assert celery["in_flight"] == (2 if expected == "prefork-2" else 20)
        for system, result in setting["systems"].items():
            _assert_all_sent(system, result)
            # Batch calls really were batched: fewer calls than messages.
            calls, accepted = result["provider_requests"], result["provider_accepted"]
            if setting["provider_batch"] == 1:
                assert calls == accepted, system
            else:
                assert calls < accepted, system


@pytest.mark.timeout(480)
def test_bench_setting_with_dagster_carries_every_figure(tmp_path, bench_env):
    report = _bench(
        bench_env,
        tmp_path / "one.json",
        *("--systems", "dagster,celery,ceiling", "--provider-latency-ms", "20"),
        *("--provider-batch", "1", "--celery-latency", "gevent-10"),
        *("--bulk-runs", "1", "--concurrency", "4"),
    )
    assert report["events"] == 40
    (setting,) = report["settings"]
    for key in PER_SETTING_KEYS:
        assert isinstance(setting[key], int | float), key
    assert setting["provider_latency_ms"] == 20 and setting["provider_batch"] == 1
    assert setting["x_baseline"] == pytest.approx(
        setting["emails_per_s"] / setting["baseline_emails_per_s"]
    )
    # The ceiling keeps as many calls in flight as the Dagster system (1 worker x 4).
    assert setting["dagster_in_flight"] == setting["ceiling_in_flight"] == 4
    assert setting["systems"]["ceiling"]["in_flight"] == 4
    assert setting["systems"]["ceiling"]["client"] == "loop"
    # PostgreSQL's CPU is read only from a server on this machine (the process on its port).
    local = bench_env["BENCH_POSTGRES"].split("@")[-1].split(":")[0] in ("127.0.0.1", "localhost")
    for system, result in setting["systems"].items():
        _assert_all_sent(system, result)
        # The sandbox's and PostgreSQL's CPU in the same window, for every system.
        assert result["sandbox_cpu_s_per_1k"] >= 0, system
        if local:
            assert result["database_cpu_s_per_1k"] >= 0, system
        else:
            assert result["database_cpu_s_per_1k"] is None, system
    for prefix in ("", "baseline_", "ceiling_"):
        own, machine = setting[f"{prefix}cpu_s_per_1k"], setting[f"{prefix}machine_cpu_s_per_1k"]
        assert own > 0, prefix
        assert machine >= own if local else machine is None, prefix


@pytest.mark.timeout(300)
def test_bench_celery_runs_on_rabbitmq_when_its_configuration_says_so(tmp_path, bench_env):
    import kombu

    from bench.baseline_celery import AMQP_URL

    try:
        with kombu.Connection(AMQP_URL, connect_timeout=3) as amqp:
            amqp.connect()
    except Exception as exc:  # refused, or its credentials: either way no broker for the bench
        pytest.skip(f"the RabbitMQ row needs RabbitMQ at {AMQP_URL} ({type(exc).__name__})")
    redis.Redis.from_url(REDIS_URL).flushdb()  # the bench's own database (see above)
    report = _bench(
        bench_env,
        tmp_path / "rabbitmq.json",
        *("--systems", "celery", "--provider-latency-ms", "0", "--provider-batch", "1"),
        *("--celery-instant", "prefork-2@rabbitmq", "--bulk-runs", "1", "--concurrency", "4"),
    )
    (setting,) = report["settings"]
    assert setting["baseline_config"] == "prefork-2@rabbitmq"
    result = setting["systems"]["celery prefork-2@rabbitmq"]
    assert result["broker"] == "rabbitmq"
    _assert_all_sent("celery prefork-2@rabbitmq", result)
    # Nothing went through Redis: a Redis run leaves kombu's bindings (``_kombu.binding.*``),
    # and a RabbitMQ run no longer flushes Redis.
    assert not redis.Redis.from_url(REDIS_URL).keys("_kombu*")
