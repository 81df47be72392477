"""What an operator reads, on SQLite and PostgreSQL: ``status`` counts due work as backlog and
scheduled work beside it, and says whether workers and a daemon are alive; ``lanes status``
says "not paused", not "running"; ``trace`` in text has what ``--json`` has; ``dlq replay``
says what its ids are and warns when nothing will send; ``dlq list`` tells recipients apart."""

import json
import re
import time
from datetime import timedelta
from pathlib import Path

from click.testing import CliRunner, Result
from dagster import DagsterInstance
from dagster._daemon.types import DaemonHeartbeat
from sqlalchemy import Engine, select
from starlette.testclient import TestClient

from email_platform.cli import main
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import webhook_inbox
from email_platform.observability.metrics import create_metrics_app
from email_platform.store import lane_workers
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from tests.support import publish_one, run_send, sandbox_messages, signup
from tests.webhook_support import SETTINGS, sandbox_event, signed


def _cli(database_url: str, *args: str, home: Path | None = None) -> Result:
    env = {"EMAIL_PLATFORM_DATABASE_URL": database_url}
    if home is not None:
        env["DAGSTER_HOME"] = str(home)
    return CliRunner().invoke(main, list(args), env=env)


def _digest(engine: Engine, n: int, **kwargs) -> str:  # type: ignore[no-untyped-def]
    return publish_one(
        engine,
        event_type="digest.ready",
        aggregate_id=f"d{n}",
        payload={"email": f"d{n}@example.org", "first_name": "Dee", "highlights": ["a"]},
        **kwargs,
    )


def _metric(text: str, name: str, lane: str) -> float:
    (value,) = re.findall(rf'^email_platform_{name}{{lane="{lane}"}} (\S+)$', text, re.M)
    return float(value)


def test_status_counts_due_work_as_backlog_and_scheduled_work_beside_it(engine, database_url):
    _digest(engine, 1, send_after=utcnow() + timedelta(hours=1))
    report = json.loads(_cli(database_url, "status", "--json").output)["lanes"]["bulk"]
    # Only a send an hour ahead: no backlog, no age, one scheduled.
    assert (report["depth"], report["oldest_age_s"], report["scheduled"]) == (0, None, 1)

    _digest(engine, 2)
    _digest(engine, 3, send_after=utcnow() + timedelta(days=2))
    result = _cli(database_url, "status", "--json")
    assert result.exit_code == 0, result.output
    bulk = json.loads(result.output)["lanes"]["bulk"]
    assert (bulk["depth"], bulk["scheduled"], bulk["in_flight"]) == (1, 2, 0)
    assert 0 <= bulk["oldest_age_s"] < 60
    # The same numbers as /metrics: one definition of backlog.
    with TestClient(create_metrics_app(engine)) as client:
        scraped = client.get("/metrics").text
    assert _metric(scraped, "queue_depth", "bulk") == bulk["depth"]
    assert _metric(scraped, "queue_scheduled", "bulk") == bulk["scheduled"]

    text = _cli(database_url, "status").output
    (line,) = [line for line in text.splitlines() if line.startswith("lane bulk ")]
    assert "due=1 " in line and "scheduled=2" in line and "in_flight=0" in line
    assert re.search(r"oldest_due_age=\d+\.\ds", line), line
    (critical,) = [line for line in text.splitlines() if line.startswith("lane critical ")]
    assert "due=0 " in critical and "oldest_due_age=-" in critical


def test_status_and_latencies_carry_their_unit(engine, database_url, sandbox):
    sent = signup(engine, "u1")
    assert run_send(database_url, sandbox.base_url, "transactional", [sent]).success
    text = _cli(database_url, "status").output
    (line,) = [line for line in text.splitlines() if line.startswith("latency transactional")]
    assert re.search(r"p50=\d+\.\d\ds +p95=\d+\.\d\ds +p99=\d+\.\d\ds", line), line
    (idle,) = [line for line in text.splitlines() if line.startswith("latency bulk")]
    assert "p50=-" in idle


def _daemon_beat(home: Path, age_s: float) -> None:
    with DagsterInstance.from_config(str(home)) as instance:
        instance.add_daemon_heartbeat(
            DaemonHeartbeat(time.time() - age_s, "SENSOR", "daemon-1", errors=[])
        )


def test_status_and_lanes_status_say_whether_workers_and_a_daemon_are_alive(
    engine, database_url, tmp_path
):
    home = tmp_path / "dagster"
    home.mkdir()
    report = json.loads(_cli(database_url, "status", "--json", home=home).output)
    assert report["daemon"] == {"instance": None, "alive": None, "last_heartbeat_age_s": None}
    (home / "dagster.yaml").write_text("{}\n")

    # Nothing runs: every lane is "not paused", yet the commands say nothing is alive.
    report = json.loads(_cli(database_url, "status", "--json", home=home).output)
    assert report["daemon"]["alive"] is False and report["daemon"]["instance"] == str(home)
    assert all(lane["workers_alive"] == 0 for lane in report["lanes"].values())
    text = _cli(database_url, "status", home=home).output
    assert "daemon   NOT RUNNING" in text and "workers  none alive" in text
    lanes = _cli(database_url, "lanes", "status", home=home).output
    assert "lane critical      not paused; workers alive: none" in lanes
    assert "running" not in lanes.replace("NOT RUNNING", "")
    assert "daemon   NOT RUNNING" in lanes

    now = utcnow()
    with engine.begin() as connection:  # what a worker run writes as it beats, and as it ends
        lane_workers.beat(connection, "run-live", "critical", now)
        lane_workers.beat(connection, "run-stale", "bulk", now - timedelta(minutes=5))
        lane_workers.beat(connection, "run-ended", "transactional", now)
        lane_workers.end(connection, "run-ended", "idle", now)
    _daemon_beat(home, age_s=3)
    report = json.loads(_cli(database_url, "status", "--json", home=home).output)
    assert report["daemon"]["alive"] is True and report["daemon"]["last_heartbeat_age_s"] < 30
    assert {lane: info["workers_alive"] for lane, info in report["lanes"].items()} == {
        "critical": 1,
        "transactional": 0,
        "bulk": 0,
    }
    text = _cli(database_url, "status", home=home).output
    assert "daemon   alive: sensor daemon last beat" in text
    assert "workers  critical=1 lane-worker run(s) alive" in text
    lanes_json = json.loads(_cli(database_url, "lanes", "status", "--json", home=home).output)
    assert lanes_json["lanes"]["critical"]["workers_alive"] == 1
    assert lanes_json["daemon"]["alive"] is True
    lanes = _cli(database_url, "lanes", "status", home=home).output
    assert "lane critical      not paused; workers alive: 1" in lanes
    assert "lane bulk          not paused; workers alive: none" in lanes

    _daemon_beat(home, age_s=600)  # a daemon that stopped ten minutes ago
    report = json.loads(_cli(database_url, "status", "--json", home=home).output)
    assert report["daemon"]["alive"] is False and report["daemon"]["last_heartbeat_age_s"] >= 600


def test_dlq_replay_says_its_ids_are_dead_letter_ids_and_warns_without_a_daemon(
    engine, database_url, sandbox, tmp_path
):
    shown = _cli(database_url, "dlq", "replay", "--help").output
    assert "[DEAD_LETTER_ID]..." in shown and "dead-letter ids" in shown
    assert "not event or message ids" in shown
    assert "email-platform dlq replay 12 15" in shown and "--inline" in shown
    assert "no daemon running" in shown

    rejected = [signup(engine, f"u{n}", email=f"u{n}+reject@example.com") for n in (1, 2)]
    assert not run_send(database_url, sandbox.base_url, "transactional", rejected).success
    letters = json.loads(_cli(database_url, "dlq", "list", "--json").output)
    first, second = sorted(d["dead_letter_id"] for d in letters)
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text("{}\n")

    result = _cli(database_url, "dlq", "replay", str(first), home=home)
    assert result.exit_code == 0, result.output
    assert "requeued 1 event(s) for 1 dead letter(s)" in result.stdout
    assert "WARNING" in result.stderr and "shows no live sensor daemon" in result.stderr
    assert "--inline" in result.stderr

    _daemon_beat(home, age_s=2)
    result = _cli(database_url, "dlq", "replay", str(second), home=home)
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert "the lane sensors will send them on their next tick" in result.stdout


def _provider_events(engine: Engine, event_id: str, sent: dict, kinds: list[tuple]) -> None:
    client = TestClient(create_receiver_app(engine, settings=SETTINGS))
    for kind, data in kinds:
        body, headers = signed(
            sandbox_event(
                kind,
                message_id=sent["id"],
                to=sent["to"],
                event_id=event_id,
                idempotency_key=sent["idempotency_key"],
                **data,
            )
        )
        assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200
    with engine.connect() as connection:
        ids = list(connection.execute(select(webhook_inbox.c.inbox_id)).scalars())
    WebhookIngestor(engine).run(ids, run_id="test-webhooks")


def test_trace_in_text_shows_what_json_has(engine, database_url, sandbox, tmp_path):
    from email_platform.warehouse import refresh

    event_id = signup(engine, "t1", email="t1+429x1@example.com")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    (sent,) = sandbox_messages(sandbox.base_url)
    warehouse = tmp_path / "warehouse.duckdb"
    env = {"EMAIL_PLATFORM_DATABASE_URL": database_url, "EMAIL_PLATFORM_WAREHOUSE": str(warehouse)}
    before = CliRunner().invoke(main, ["trace", event_id], env=env).output
    assert "no provider events yet" in before and f"funnel: no warehouse at {warehouse}" in before

    _provider_events(
        engine,
        event_id,
        sent,
        [
            ("email.delivered", {}),
            ("email.opened", {"user_agent": "Mozilla/5.0"}),
            ("email.clicked", {"click": {"url": "https://x.example/a"}}),
        ],
    )
    refresh(database_url, warehouse)
    chain = json.loads(CliRunner().invoke(main, ["trace", event_id, "--json"], env=env).output)
    text = CliRunner().invoke(main, ["trace", event_id], env=env).output
    (message,) = chain["messages"]
    assert message["provider_message_id"] == sent["id"]
    assert f"provider_id={sent['id']}" in text and "provider_id=None" not in text
    assert f"delivery={message['delivery_status']}" in text
    for attempt in message["attempts"]:  # when each try happened, and how long it took
        assert re.search(
            rf"attempt {attempt['attempt_no']} at {re.escape(attempt['started_at'])} "
            rf"took \d+\.\d{{3}}s",
            text,
        ), text
    for seen in chain["provider_events"]:
        assert f"{seen['event_type']} at {seen['occurred_at']} (sandbox)" in text
    assert [e["event_type"] for e in chain["provider_events"]] == ["delivered", "opened", "clicked"]
    assert "url=https://x.example/a" in text
    (row,) = chain["funnel"]
    funnel = text.split("funnel (as of the warehouse's last refresh")[1]
    fields = dict(pair.split("=", 1) for pair in funnel.split(":", 1)[1].split())
    assert fields["message_id"] == str(row["message_id"]) and fields["final_status"] == "sent"
    assert fields["template"] == "welcome" and fields["click_count"] == "1"
    assert fields["delivered_at"] == row["delivered_at"]


def test_dlq_list_tells_apart_recipients_that_mask_alike(engine, database_url, sandbox):
    addresses = [f"d{n}+reject@example.com" for n in range(5)]
    ids = [signup(engine, f"u{n}", email=address) for n, address in enumerate(addresses)]
    again = signup(engine, "u9", email=addresses[0])  # a second letter to the first address
    assert not run_send(database_url, sandbox.base_url, "transactional", [*ids, again]).success

    listed = json.loads(_cli(database_url, "dlq", "list", "--json").output)
    by_event = {d["event_id"]: d["recipient"] for d in listed}
    shown = [by_event[event_id] for event_id in ids]
    assert all(re.fullmatch(r"d\*\*\*@example\.com #[0-9a-f]{6}", r) for r in shown), shown
    assert len(set(shown)) == 5  # five addresses, five readings
    assert by_event[again] == shown[0]  # the same address reads the same
    text = _cli(database_url, "dlq", "list").output
    for recipient in shown:
        assert f"to {recipient}" in text
    # Stable from one listing to the next (the key is kept in the database), and no address.
    assert json.loads(_cli(database_url, "dlq", "list", "--json").output) == listed
    for output in (text, json.dumps(listed)):
        assert not any(a in output or a.split("@")[0] in output for a in addresses)
