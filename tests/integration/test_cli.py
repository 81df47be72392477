"""The operator's CLI against a real database: status, trace and the dead-letter commands."""

import json

from click.testing import CliRunner

from email_platform.cli import main
from email_platform.store import dead_letters
from tests.support import event, messages_of, run_send, sandbox_messages, signup


def _cli(database_url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env={"EMAIL_PLATFORM_DATABASE_URL": database_url})
    return result.exit_code, result.output


def test_status_json_has_the_documented_shape_and_counts(engine, database_url, sandbox):
    sent = signup(engine, "u1")
    dead = signup(engine, "u2", email="u2+reject@example.com")
    signup(engine, "u3")  # still pending
    run_send(database_url, sandbox.base_url, "transactional", [sent, dead])
    code, output = _cli(database_url, "status", "--json")
    assert code == 0, output
    report = json.loads(output)
    assert report["events"] == {"pending": 1, "in_flight": 0, "done": 1, "dead": 1}
    assert report["messages"] == {
        "pending": 0,
        "sent": 1,
        "suppressed": 0,
        "expired": 0,
        "duplicate": 0,
        "dead": 1,
    }
    assert set(report["lanes"]) == {"critical", "transactional", "bulk"}
    assert report["lanes"]["transactional"]["depth"] == 1
    assert report["lanes"]["transactional"]["oldest_age_s"] >= 0
    assert report["lanes"]["bulk"] == {
        "depth": 0,
        "oldest_age_s": None,
        "scheduled": 0,
        "in_flight": 0,
        "workers_alive": 0,
        "paused": None,
    }
    assert report["dead_letters"] == {"open": 1, "by_reason": {"provider_rejected": 1}}


def test_trace_shows_the_whole_chain(engine, database_url, sandbox):
    event_id = signup(engine, "u1", email="u1+429x1@example.com")
    result = run_send(database_url, sandbox.base_url, "transactional", [event_id])
    code, output = _cli(database_url, "trace", event_id, "--json")
    assert code == 0, output
    chain = json.loads(output)
    assert chain["event"]["event_id"] == event_id and chain["event"]["status"] == "done"
    (message,) = chain["messages"]
    assert message["status"] == "sent"
    assert [a["outcome"] for a in message["attempts"]] == ["transient", "accepted"]
    assert [a["http_status"] for a in message["attempts"]] == [429, 200]
    assert {a["run_id"] for a in message["attempts"]} == {result.run_id}
    (seen,) = sandbox_messages(sandbox.base_url)
    assert message["attempts"][1]["provider_message_id"] == seen["id"]
    assert chain["dead_letters"] == []
    code, text = _cli(database_url, "trace", event_id)
    assert code == 0 and "attempt 1" in text and "transient" in text
    code, missing = _cli(database_url, "trace", "01NOSUCHEVENT0000000000000")
    assert code != 0 and "no event" in missing


def test_dlq_list_replay_and_discard(engine, database_url, sandbox):
    # One message dead because the provider was down for longer than the retries lasted.
    flaky = signup(engine, "u1", email="u1+503x2@example.com")
    rejected = signup(engine, "u2", email="u2+reject@example.com")
    lanes = {"transactional": {"retry_delay_s": 0.01, "max_retries": 1}}
    assert not run_send(
        database_url, sandbox.base_url, "transactional", [flaky, rejected], lanes=lanes
    ).success
    code, output = _cli(database_url, "dlq", "list", "--json")
    assert code == 0
    letters = {row["event_id"]: row for row in json.loads(output)}
    assert letters[flaky]["reason"] == "retries_exhausted"
    assert letters[rejected]["reason"] == "provider_rejected"

    code, output = _cli(database_url, "dlq", "replay")
    assert code != 0 and "say which dead letters" in output  # no accidental replay-all

    code, output = _cli(database_url, "dlq", "replay", "--reason", "retries_exhausted")
    assert code == 0 and "requeued 1 event" in output, output
    assert event(engine, flaky).status == "pending"
    assert event(engine, rejected).status == "dead"  # not selected, left alone
    # The provider recovered (its 2 failures are used up); the lane's next run sends it.
    assert run_send(database_url, sandbox.base_url, "transactional", [flaky], lanes=lanes).success
    assert messages_of(engine, flaky)[0].status == "sent"
    code, output = _cli(database_url, "dlq", "list", "--status", "replayed", "--json")
    assert [row["event_id"] for row in json.loads(output)] == [flaky]

    code, output = _cli(database_url, "dlq", "discard", str(letters[rejected]["dead_letter_id"]))
    assert code == 0 and "discarded 1" in output
    with engine.connect() as connection:
        assert dead_letters.list_letters(connection) == []
    code, output = _cli(database_url, "status", "--json")
    assert json.loads(output)["dead_letters"]["open"] == 0
    assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [flaky]


def test_dlq_replay_inline_sends_without_a_daemon(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    event_id = signup(engine, "u1", email="u1+503x2@example.com")
    lanes = {"transactional": {"retry_delay_s": 0.01, "max_retries": 1}}
    assert not run_send(
        database_url, sandbox.base_url, "transactional", [event_id], lanes=lanes
    ).success
    (tmp_path / "dagster").mkdir()
    result = CliRunner().invoke(
        main,
        ["dlq", "replay", "--all", "--inline"],
        env={
            "EMAIL_PLATFORM_DATABASE_URL": database_url,
            "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox.base_url,
            "DAGSTER_HOME": str(tmp_path / "dagster"),
        },
    )
    assert result.exit_code == 0, result.output
    assert "success" in result.output
    assert messages_of(engine, event_id)[0].status == "sent"
    keys = [m["idempotency_key"] for m in sandbox_messages(sandbox.base_url)]
    assert keys == [f"{event_id}:welcome"]


def test_commands_on_an_unmigrated_database_say_what_to_do(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    code, output = _cli(url, "status")
    assert code != 0 and "email-platform db upgrade" in output
    code, output = _cli(url, "db", "upgrade")
    assert code == 0 and "revision 0013" in output
    code, output = _cli(url, "status", "--json")
    assert code == 0 and json.loads(output)["events"]["pending"] == 0


def test_sandbox_webhooks_need_a_secret():
    result = CliRunner().invoke(
        main,
        ["sandbox", "serve", "--webhook-url", "http://127.0.0.1:9/webhooks/sandbox"],
        env={"EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET": ""},
    )
    assert result.exit_code == 2 and "--webhook-secret" in result.output


def test_trace_includes_the_funnel_row_once_the_warehouse_is_built(
    engine, database_url, sandbox, tmp_path
):
    from email_platform.warehouse import refresh

    event_id = signup(engine, "f1")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    warehouse = tmp_path / "warehouse.duckdb"
    env = {"EMAIL_PLATFORM_DATABASE_URL": database_url, "EMAIL_PLATFORM_WAREHOUSE": str(warehouse)}
    before = json.loads(CliRunner().invoke(main, ["trace", event_id, "--json"], env=env).output)
    assert before["funnel"] is None  # no warehouse yet
    refresh(database_url, warehouse)
    after = json.loads(CliRunner().invoke(main, ["trace", event_id, "--json"], env=env).output)
    (row,) = after["funnel"]
    assert row["event_id"] == event_id and row["template"] == "welcome"
    assert row["final_status"] == "sent"


def test_the_duckdb_command_the_demo_prints_reads_the_warehouse_format(tmp_path):
    """README's install brings the ``duckdb`` command the demo tells analysts to run, beside
    this interpreter, at the library's version: it opens a file the library wrote, read-only."""
    import subprocess
    import sys
    from pathlib import Path

    import duckdb

    path = tmp_path / "warehouse.duckdb"
    with duckdb.connect(str(path)) as connection:
        connection.execute("CREATE TABLE email_funnel AS SELECT range AS n FROM range(7)")
    command = Path(sys.executable).parent / "duckdb"
    result = subprocess.run(
        [
            str(command),
            "-readonly",
            "-csv",
            str(path),
            "-c",
            "SELECT count(*), sum(n) FROM email_funnel",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "7,21"
    version = subprocess.run(
        [str(command), "-version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    assert duckdb.__version__ in version
