"""What the three users see, through a running webserver's GraphQL API on a real demo's data.

One ``email-platform demo`` run (a real daemon, lane workers, webhooks, the analytics assets),
then ``dagster-webserver`` on its instance: the data engineer's runs, the operator's dead-letter
tag, and the analyst's welcome open rate, the same in the UI, in SQL and in the demo's output.
"""

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from email_platform.local.webserver import WebserverProcess
from tests.paths import ROOT

# The analyst's question and where the UI plots its answer (warehouse.template_rates).
WELCOME_QUESTION = "welcome_open_rate_last_7_days.sql"
WELCOME_SQL_COLUMN = "open_rate"
WELCOME_RATE_ASSET = "email_platform/email_funnel_daily"
WELCOME_RATE_KEY = "2 open rate, welcome, 7d (%)"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    home = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMAIL_PLATFORM_", "DAGSTER_"))}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("email-platform")), "demo", "--home", str(home)],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return home, done.stdout


@pytest.fixture(scope="module")
def webserver(demo: tuple[Path, str]) -> Iterator[WebserverProcess]:
    home, _ = demo
    with WebserverProcess(home / "dagster", env={"EMAIL_PLATFORM_HOME": str(home)}) as server:
        assert server.wait_until_ready(180), (home / "dagster" / "webserver.log").read_text()
        yield server


def test_worker_runs_end_green_after_a_clean_stop_and_red_only_for_dead_letters(webserver):
    workers = webserver.runs(job_name="lane_worker_job")
    assert {run["tags"]["email/lane"] for run in workers} >= {"critical", "transactional", "bulk"}
    for run in workers:
        dead = int(run["tags"].get("email/dead_letters", "0"))
        # Stopped by the demo: a success, unless it left dead letters for an operator.
        assert run["status"] == ("FAILURE" if dead else "SUCCESS"), run
        assert run["tags"].get("email/stop") == "requested"
    tagged = [run for run in workers if "email/dead_letters" in run["tags"]]
    # The demo's rejected addresses (seeded) leave dead letters; the tag finds their run.
    assert sum(int(run["tags"]["email/dead_letters"]) for run in tagged) == 5


def test_the_demo_says_its_one_red_run_is_expected_and_why(demo, webserver):
    _, stdout = demo
    assert "Expected: the worker run that recorded them ends FAILED" in stdout, stdout[-3000:]
    assert "re-execute it from failure" in stdout
    # And it is the only red run: every failed run is one holding dead letters.
    failed = [run for run in webserver.runs() if run["status"] == "FAILURE"]
    assert len(failed) == 1 and "email/dead_letters" in failed[0]["tags"], failed


def test_a_worker_run_logs_each_batch_and_why_it_ended(webserver):
    critical = next(
        run
        for run in webserver.runs(job_name="lane_worker_job")
        if run["tags"]["email/lane"] == "critical"
    )
    messages = webserver.run_log_messages(critical["runId"])
    batches = [m for m in messages if re.match(r"batch \d+( \(retry \d+\))?: ", m)]
    assert batches and all("provider calls" in m for m in batches), messages
    assert re.search(r"events \w+\.\.\w+: claimed \d+, sent \d+", batches[0])
    assert any(m.startswith("lane worker ended, stopped on request") for m in messages)


def test_the_operator_finds_the_runs_holding_dead_letters_in_the_check(webserver):
    (tagged,) = [
        run
        for run in webserver.runs(job_name="lane_worker_job")
        if "email/dead_letters" in run["tags"]
    ]
    (check,) = [
        c
        for c in webserver.asset_checks("email_platform/stg_dead_letters")
        if c["name"] == "open_dead_letters"
    ]
    assert tagged["runId"] in str(check["metadata"]), check


def test_the_welcome_open_rate_is_one_number_in_the_ui_in_sql_and_in_the_demo(demo, webserver):
    home, stdout = demo
    printed = float(re.search(r"Welcome email human open rate: ([\d.]+)%", stdout).group(1))
    metadata = webserver.latest_asset_metadata(WELCOME_RATE_ASSET)
    in_ui = metadata[WELCOME_RATE_KEY]
    question = (ROOT / "analytics" / "questions" / WELCOME_QUESTION).read_text()
    connection = duckdb.connect(str(home / "warehouse.duckdb"), read_only=True)
    try:
        frame = connection.execute(question).df()
    finally:
        connection.close()
    in_sql = float(frame[WELCOME_SQL_COLUMN].iloc[0])
    assert in_ui == pytest.approx(100 * in_sql, abs=0.005)  # plotted in percent, two decimals
    assert round(100 * in_sql, 1) == printed


def test_the_analyst_sees_the_funnel_first_and_the_open_rates_first_in_the_plots(webserver):
    metadata = webserver.latest_asset_metadata(WELCOME_RATE_ASSET)
    # The UI lists entries in the order GraphQL gives them and renders Markdown inline only
    # under 1,000 characters (ui-core's MetadataEntry); it sorts plot labels as strings.
    assert next(iter(metadata)) == "funnel" and len(metadata["funnel"]) < 1000
    assert "% of delivered" in metadata["funnel"]
    plotted = sorted(key for key, value in metadata.items() if isinstance(value, float | int))
    assert plotted[0] == "1 open rate, all, 7d (%)"
    # Every template's open rate leads, before any other rate: welcome's among them.
    first = plotted[: plotted.index(WELCOME_RATE_KEY) + 1]
    assert all(label.split(",")[0] in {"1 open rate", "2 open rate"} for label in first), first
