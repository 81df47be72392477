"""The fault harness (``python -m bench.faults``) at its small size, through the real stack.

The drain runs the real stack (daemon, code server, launched runs, receiver, sandbox) while
processes are killed with SIGKILL, the provider has an outage longer than the retry budget,
answers 429 with every kind of Retry-After and cuts connections mid-answer, the outbox is
locked, PostgreSQL is restarted and then absent, events commit out of id order, an extra
batch run sends events the lanes are sending, and two operators replay the same dead letters
at once; then hostile webhooks arrive while the receiver is killed. Every event's and
webhook's fate is then counted; the run passes only with nothing lost, doubled or wrong.
The checker's own tests (that it can fail) are in ``tests/integration/test_fault_checker.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT


def _drain(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    process = subprocess.run(
        [sys.executable, "-m", "bench.faults", "--workdir", str(tmp_path / "work"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = process.stdout.strip().splitlines()
    assert lines, process.stderr[-3000:]
    return process.returncode, lines


def _figures(lines: list[str], prefix: str) -> dict[str, str]:
    line = next(line for line in lines if line.startswith(prefix))
    return dict(part.split("=", 1) for part in line[len(prefix) :].split())


@pytest.mark.timeout(960)
@pytest.mark.parametrize(
    ("database", "mode"),
    [("sqlite", "workers"), ("postgres", "workers"), ("sqlite", "batch"), ("postgres", "batch")],
)
def test_a_drain_under_faults_loses_doubles_and_misroutes_nothing(tmp_path, database, mode):
    code, lines = _drain(
        tmp_path,
        *("--events", "300", "--database", database, "--mode", mode),
        *("--kill-every-s", "3", "--kill-tail-s", "30"),
    )
    report = "\n".join(lines)
    assert lines[-1] == "lost=0 doubled=0 wrong=0", report
    assert code == 0, report
    kills = _figures(lines, "kills:")
    assert int(kills["total"]) >= 5, report
    assert int(kills.get("run", 0)) + int(kills.get("step", 0)) >= 1, report
    faults = _figures(lines, "faults:")
    expected = {"provider_outage", "outbox_locked", "late_commit", "replay_twice_at_once"}
    expected |= {"hostile_webhooks"}
    if database == "postgres":
        expected |= {"database_restart", "database_unreachable"}
    assert expected <= set(faults), report
    published = _figures(lines, "published:")
    assert any(kind.startswith("poison:") for kind in published), report
    fates = _figures(lines, "fates:")
    assert int(fates["sent"]) > 200, report
    hooks = _figures(lines, "webhooks:")
    assert int(hooks["planned"]) == int(hooks["applied"]) > 200, report
    assert int(hooks["receiver_kills"]) >= 1 and hooks["inbox_settled"] == "True", report
    assert int(hooks["forged"]) >= 6 and int(hooks["flood"]) >= 100, report
