"""The production stack's settings: what it refuses, and run-queue limits that never admit more
lane-worker runs than there are Celery slots for their steps."""

import json
import shlex

import pytest
import yaml

from email_platform.common import config
from email_platform.local.stack import StackError, StackSettings, _dagster_yaml, stack_env


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"name": "Email-Platform"}, "stack name"),
        ({"name": 'x"; DROP DATABASE postgres; --'}, "stack name"),
        ({"receivers": 0}, "receivers"),
        ({"celery_workers": -1}, "celery_workers"),
        ({"celery_concurrency": 0}, "celery_concurrency"),
        ({"critical_workers": 0}, "critical_workers"),
        ({"celery_workers": 1, "celery_concurrency": 1}, "at least 2"),
        ({"receiver_port": 70000}, "receiver_port"),
        ({"sandbox_port": 0}, "sandbox_port"),
        ({"sandbox_latency_ms": float("nan")}, "sandbox_latency_ms"),
        ({"sandbox_latency_ms": 1e308}, "sandbox_latency_ms"),
        ({"broker": "redis://h:6379/0'\nimport os"}, "CELERY_BROKER"),
        ({"broker": "redis://h/0\u2028x"}, "CELERY_BROKER"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(tmp_path, changes, named):
    with pytest.raises(StackError, match=named):
        StackSettings(tmp_path, **changes)


def test_a_postgres_url_that_is_not_postgresql_is_refused(tmp_path):
    with pytest.raises(StackError, match="postgresql://"):
        stack_env(StackSettings(tmp_path, postgres_url="sqlite:///x.db"))


@pytest.mark.parametrize(("workers", "slots"), [(1, 2), (2, 1), (2, 2), (4, 1), (3, 4)])
def test_run_queue_limits_fit_the_celery_slots(tmp_path, workers, slots):
    settings = StackSettings(tmp_path, celery_workers=workers, celery_concurrency=slots)
    queue = yaml.safe_load(_dagster_yaml(settings))["run_queue"]
    limits = {entry["value"]: entry["limit"] for entry in queue["tag_concurrency_limits"]}
    # Transactional and bulk steps share the workers x slots of the shared queue.
    assert limits["bulk"] + limits["transactional"] == workers * slots
    lanes = json.loads(stack_env(settings)["EMAIL_PLATFORM_LANES"])
    assert lanes["bulk"]["workers"] == limits["bulk"]
    assert lanes["transactional"]["workers"] == limits["transactional"]
    # Every lane worker, a critical successor and the warehouse refresh have a run slot.
    assert queue["max_concurrent_runs"] == sum(lane["workers"] for lane in lanes.values()) + 2


def test_the_settings_are_ones_the_code_reads_and_the_lanes_parse(tmp_path):
    settings = StackSettings(tmp_path, lanes={"bulk": {"batch_size": 50}})
    env = stack_env(settings)
    assert config.executor_settings(env).kind == "celery"
    assert config.executor_settings(env).lane_queues == {"critical": "critical"}
    assert config.database_url(env).endswith("/email_platform")
    lanes = json.loads(env["EMAIL_PLATFORM_LANES"])
    assert lanes["bulk"]["batch_size"] == 50 and lanes["bulk"]["workers"] == 3


def test_a_second_up_keeps_the_webhook_secret_of_the_first(tmp_path):
    settings = StackSettings(tmp_path)
    first = stack_env(settings)
    (tmp_path / "stack.env").write_text(
        "".join(f"export {k}={shlex.quote(v)}\n" for k, v in first.items())
    )
    again = stack_env(settings)
    secret = "EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET"
    assert again[secret] == first[secret] and again[secret].startswith("whsec_")
    assert stack_env(StackSettings(tmp_path / "other"))[secret] != first[secret]


@pytest.mark.parametrize(
    ("quoted", "password"),
    [("p%40ss%22w:rd", 'p@ss"w:rd'), ("%F0%9F%98%80%C3%A9%0A%23%20x", "\U0001f600\u00e9\n# x")],
)
def test_a_password_reaches_the_dagster_storage_as_one_yaml_value(tmp_path, quoted, password):
    settings = StackSettings(tmp_path, postgres_url=f"postgresql://app:{quoted}@db:5433/x")
    text = _dagster_yaml(settings)
    for loader in (yaml.SafeLoader, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        storage = yaml.load(text, Loader=loader)["storage"]["custom"]["config"]["postgres_db"]
        assert storage["password"] == password
    assert (storage["hostname"], storage["port"], storage["username"]) == ("db", 5433, "app")
    assert storage["db_name"] == "email_platform_dagster"
