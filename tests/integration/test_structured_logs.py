"""Every log line is one JSON object carrying the ids of what it is about.

A message's story is found with one search: the worker run's lines (Dagster's console logger
replaced by ``email_platform.jobs.loggers``) and its per-message lines carry ``event_id``,
``message_id``, ``idempotency_key``, ``provider_message_id``, ``run_id`` and ``lane``; the
receiver's lines (``webhooks serve``, uvicorn's included) and the ingestion's per-event lines
carry the same ids read back from the provider's webhook. No value, however hostile, breaks a
line in two or forges another.
"""

import io
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from select import PIPE_BUF

import httpx
from dagster import DagsterInstance, execute_job, reconstructable
from hypothesis import given
from hypothesis import strategies as st

from email_platform.jobs import lane_worker_run_config
from email_platform.observability import logs
from email_platform.store import inbox
from tests.support import messages_of, signup
from tests.webhook_support import SECRET, inbox_rows, sandbox_event, seed_sent_message, signed

VENV_BIN = Path(sys.executable).parent
_SERVE = [str(VENV_BIN / "email-platform"), "webhooks", "serve"]
IDS = ("event_id", "message_id", "idempotency_key", "provider_message_id", "run_id", "lane")


def _record(msg: str, **extra) -> logging.LogRecord:  # type: ignore[no-untyped-def]
    record = logging.LogRecord("email_platform.test", logging.INFO, __file__, 1, msg, (), None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


@given(
    msg=st.text(),
    value=st.text(),
    number=st.integers(),
)
def test_any_text_stays_one_line_and_reads_back_exactly(msg, value, number):
    record = _record(msg, **{logs.ATTRIBUTE: {"event_id": value, "message_id": number}})
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line and "\r" not in line
    assert line.isascii()
    parsed = json.loads(line)
    assert parsed["msg"] == msg
    assert parsed["event_id"] == value and parsed["message_id"] == number
    assert parsed["level"] == "info" and parsed["logger"] == "email_platform.test"


def test_a_dagster_record_keeps_the_logged_sentence_and_names_the_run():
    meta = {
        "orig_message": "batch 1: claimed 3",
        "run_id": "r-1",
        "job_name": "lane_worker_job",
        "step_key": "run_lane_worker",
    }
    record = _record("lane_worker_job - r-1 - run_lane_worker - batch 1: claimed 3")
    record.dagster_meta = meta
    setattr(record, logs.ATTRIBUTE, {"lane": "bulk"})
    parsed = json.loads(logs.JsonFormatter().format(record))
    assert parsed["msg"] == "batch 1: claimed 3"
    assert (parsed["run_id"], parsed["job"], parsed["step"], parsed["lane"]) == (
        "r-1",
        "lane_worker_job",
        "run_lane_worker",
        "bulk",
    )


def test_a_bound_logger_adds_its_fields_and_the_call_wins(caplog):
    log = logs.bind(logging.getLogger("email_platform.test"), lane="bulk", run_id="r-1")
    with caplog.at_level(logging.INFO, logger="email_platform.test"):
        log.info("one", **logs.fields(event_id="e1", run_id="r-2"))
        log.bind(message_id=7).warning("two")
    one, two = caplog.records
    assert logs.fields_of(one) == {"lane": "bulk", "run_id": "r-2", "event_id": "e1"}
    assert logs.fields_of(two) == {"lane": "bulk", "run_id": "r-1", "message_id": 7}


def test_lines_written_each_in_a_loop_read_as_one_call_each_would_write_them():
    """``info_each`` (per-message lines of a group) against ``info(**fields(...))``: the same
    JSON but the timestamp, the same source, and the logger's level and filters still apply."""
    stream_each, stream_one = io.StringIO(), io.StringIO()
    logger = logging.getLogger("email_platform.test.each")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.handlers = [logs.json_handler(stream_each)]
    records: list[logging.LogRecord] = []
    keep = logging.Handler()
    keep.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(keep)
    log = logs.bind(logger, lane="bulk", provider="sandbox")
    rows = [
        {"event_id": "e1", "message_id": 1, "provider_message_id": None, "provider": "ses"},
        {"event_id": 'e2\n{"forged": 1}', "message_id": 2, "trace_id": "t2"},
    ]
    log.info_each("accepted by the provider", rows)
    where = sys._getframe().f_code
    logger.handlers = [logs.json_handler(stream_one)]
    for row in rows:
        log.info("accepted by the provider", **logs.fields(**row))
    each = [json.loads(line) for line in stream_each.getvalue().splitlines()]
    one = [json.loads(line) for line in stream_one.getvalue().splitlines()]
    assert len(each) == 2 and [{**e, "ts": 0} for e in each] == [{**o, "ts": 0} for o in one]
    assert each[0]["provider"] == "ses" and "provider_message_id" not in each[0]
    assert each[1]["event_id"] == rows[1]["event_id"] and each[1]["provider"] == "sandbox"
    assert [(r.pathname, r.funcName) for r in records] == [(where.co_filename, where.co_name)] * 2

    logger.handlers = [keep]
    records.clear()
    logger.addFilter(lambda record: logs.fields_of(record)["message_id"] != 1)
    log.info_each("accepted by the provider", rows)
    assert [logs.fields_of(r)["message_id"] for r in records] == [2]
    logger.setLevel(logging.WARNING)
    log.info_each("accepted by the provider", rows)
    assert len(records) == 1
    logger.handlers, logger.filters, logger.propagate = [], [], True


class _Writes(io.StringIO):
    """A stream that keeps each write."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[str] = []

    @property
    def writes(self) -> int:
        return len(self.chunks)

    def write(self, text: str) -> int:
        self.chunks.append(text)
        return super().write(text)


def test_lines_that_reach_only_json_handlers_are_written_in_whole_lines_and_read_the_same(
    monkeypatch,
):
    """A run process's per-message lines reach only the JSON handlers: ``info_each`` then
    formats them itself and writes the group in whole lines of at most PIPE_BUF bytes a write
    (atomic on a pipe). The lines read as ``info(**fields(...))`` writes them (but the
    timestamp); a handler above INFO gets none, a disabled logger writes none, a value that
    cannot be encoded is reported as the per-record path reports it (the other lines written),
    and a handler or filter of anyone else's on the way up gets every record."""
    parent = logging.getLogger("email_platform.test.group")
    logger = logging.getLogger("email_platform.test.group.messages")
    grouped, quiet, single = _Writes(), _Writes(), io.StringIO()
    above_info = logs.json_handler(quiet)
    above_info.setLevel(logging.WARNING)
    parent.handlers, parent.propagate = [logs.json_handler(grouped), above_info], False
    parent.setLevel(logging.INFO)
    log = logs.bind(logger, lane="bulk", provider="sandbox")
    rows = [
        {"event_id": f"e{n}", "message_id": n, "provider_message_id": None} for n in range(50)
    ] + [{"event_id": 'e\n{"forged": 1}', "msg": "replaced", "trace_id": "t"}, {}]
    try:
        log.info_each("accepted by the provider", rows)
        assert 1 < grouped.writes < len(rows) / 5 and quiet.getvalue() == ""
        assert all(c.endswith("\n") and len(c.encode()) <= PIPE_BUF for c in grouped.chunks)
        parent.handlers = [logs.json_handler(single)]
        for row in rows:
            log.info("accepted by the provider", **logs.fields(**row))
        each = [json.loads(line) for line in grouped.getvalue().splitlines()]
        one = [json.loads(line) for line in single.getvalue().splitlines()]
        assert len(each) == len(rows) == len(one)
        assert [list({**e, "ts": 0}.items()) for e in each] == [
            list({**o, "ts": 0}.items()) for o in one
        ]
        assert each[50]["msg"] == "replaced" and each[50]["event_id"] == rows[50]["event_id"]

        logger.disabled = True
        log.info_each("accepted by the provider", rows)
        assert len(single.getvalue().splitlines()) == len(rows)
        logger.disabled = False

        parent.handlers = [logs.json_handler(grouped := _Writes())]
        monkeypatch.setattr(logging, "raiseExceptions", False)  # handleError stays quiet
        log.info_each("accepted by the provider", [rows[0], {"odd": {(1, 2): 3}}, rows[1]])
        assert [json.loads(c)["message_id"] for c in grouped.chunks] == [0, 1]

        records: list[logging.LogRecord] = []
        keep = logging.Handler()
        keep.emit = records.append  # type: ignore[method-assign]
        parent.handlers = [logs.json_handler(grouped := _Writes()), keep]
        log.info_each("accepted by the provider", rows)
        assert len(records) == len(rows) == grouped.writes
        parent.handlers = [logs.json_handler(grouped := _Writes())]
        logger.addFilter(lambda record: logs.fields_of(record).get("message_id") != 1)
        log.info_each("accepted by the provider", rows)
        assert len(grouped.getvalue().splitlines()) == len(rows) - 1
    finally:
        parent.handlers, parent.propagate, logger.filters = [], True, []
        parent.setLevel(logging.NOTSET)


def _drop_json_handlers() -> None:
    logger = logging.getLogger("email_platform")
    logger.handlers = [h for h in logger.handlers if not isinstance(h, logging.StreamHandler)]


def test_configure_writes_each_line_once_however_often_it_is_called(capsys):
    _drop_json_handlers()  # an earlier test's run may have configured it on another stream
    logs.configure("INFO")
    logs.configure("INFO")
    logging.getLogger("email_platform.test").info("once", **logs.fields(event_id="e1"))
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["msg"], line["event_id"]) for line in lines] == [("once", "e1")]
    _drop_json_handlers()


# ---- a lane worker run ----------------------------------------------------------------------


def _worker_job():
    from email_platform.definitions import build_definitions

    return build_definitions().get_job_def("lane_worker_job")


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_worker_run_logs_every_line_as_json_with_each_message_ids(
    engine, database_url, sandbox, tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv("EMAIL_PLATFORM_DATABASE_URL", database_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BASE_URL", sandbox.base_url)
    monkeypatch.setenv(
        "EMAIL_PLATFORM_LANES",
        '{"transactional": {"batch_size": 3, "worker_idle_s": 1, "worker_poll_s": 0.05,'
        ' "retry_delay_s": 0.01, "max_retries": 2}}',
    )
    good = [signup(engine, f"u{i}") for i in range(3)]
    flaky = signup(engine, "flaky", email="flaky+503x1@example.com")  # fails once, then sent
    capfd.readouterr()
    with (
        DagsterInstance.local_temp(str(tmp_path)) as instance,
        execute_job(
            reconstructable(_worker_job),
            instance=instance,
            run_config=lane_worker_run_config("transactional"),
        ) as run,
    ):
        assert run.success
        run_id = run.run_id
    err = capfd.readouterr().err
    # Dagster's text console is replaced, not doubled. One line is printed by the step's
    # subprocess before the run's loggers exist: Dagster's own DEBUG "step worker started".
    text = [line for line in err.splitlines() if " - dagster - " in line]
    assert all(" - DEBUG - " in t and "STEP_WORKER_STARTED" in t for t in text), text
    lines = _json_lines(err)
    accepted = [line for line in lines if line["msg"] == "accepted by the provider"]
    for event_id in [*good, flaky]:
        (message,) = messages_of(engine, event_id)
        (line,) = [a for a in accepted if a["event_id"] == event_id]
        assert {k: line[k] for k in IDS} == {
            "event_id": event_id,
            "message_id": message.message_id,
            "idempotency_key": message.idempotency_key,
            "provider_message_id": message.provider_message_id,
            "run_id": run_id,
            "lane": "transactional",
        }
    (retry,) = [line for line in lines if "transient failure" in line["msg"]]
    (message,) = messages_of(engine, flaky)
    assert (retry["event_id"], retry["message_id"], retry["idempotency_key"]) == (
        flaky,
        message.message_id,
        message.idempotency_key,
    )
    assert (retry["run_id"], retry["lane"], retry["http_status"]) == (run_id, "transactional", 503)
    batches = [line for line in lines if line["msg"].startswith("batch ")]
    assert batches and all(
        (b["run_id"], b["lane"], b["job"]) == (run_id, "transactional", "lane_worker_job")
        for b in batches
    )
    ended = [line for line in lines if line["msg"].startswith("lane worker ended")]
    assert [(e["run_id"], e["lane"]) for e in ended] == [(run_id, "transactional")]


# ---- the receiver and the ingestion --------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post_when_up(url: str, server: subprocess.Popen, body: bytes, headers: dict) -> httpx.Response:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError("webhooks serve exited")
        try:
            return httpx.post(url, content=body, headers=headers, timeout=10)
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("webhooks serve did not come up")


def test_the_receiver_logs_every_line_as_json_naming_the_webhook_ids(engine, database_url):
    message_id = seed_sent_message(
        engine,
        provider="sandbox",
        event_id="01KDVFF0NRVB039663SGXKY95F",
        recipient="jane@example.com",
        provider_message_id="sbx_42",
    )
    port = _free_port()
    env = {**os.environ, "EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET": SECRET}
    server = subprocess.Popen(
        [*_SERVE, "--port", str(port), "--url", database_url],
        stderr=subprocess.PIPE,
        env=env,
    )
    url = f"http://127.0.0.1:{port}/webhooks/sandbox"
    try:
        body, headers = signed(
            sandbox_event(
                "email.delivered",
                message_id="sbx_42",
                to="jane@example.com",
                event_id="01KDVFF0NRVB039663SGXKY95F",
                idempotency_key="01KDVFF0NRVB039663SGXKY95F:welcome",
            )
        )
        assert _post_when_up(url, server, body, headers).status_code == 200
        forged = {**headers, "webhook-signature": "v1,AAAA"}
        assert httpx.post(url, content=body + b" ", headers=forged).status_code == 401
    finally:
        server.terminate()
        err = server.communicate(timeout=30)[1].decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), err
    parsed = [json.loads(line) for line in lines]
    (stored,) = [p for p in parsed if p["msg"] == "webhook from sandbox stored"]
    assert stored["provider"] == "sandbox" and stored["inbox_id"] >= 1
    assert stored["event_id"] == "01KDVFF0NRVB039663SGXKY95F"
    assert stored["idempotency_key"] == "01KDVFF0NRVB039663SGXKY95F:welcome"
    assert stored["provider_message_id"] == "sbx_42"
    (rejected,) = [p for p in parsed if p["msg"].startswith("webhook from sandbox rejected")]
    assert rejected["level"] == "warning" and rejected["provider"] == "sandbox"
    assert any(p["logger"].startswith("uvicorn") for p in parsed)  # uvicorn's own, as JSON

    from email_platform.webhooks.ingest import WebhookIngestor
    from email_platform.webhooks.registry import available

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    messages_logger = logging.getLogger(logs.MESSAGES_LOGGER)
    messages_logger.addHandler(handler)
    old_level = messages_logger.level
    messages_logger.setLevel(logging.INFO)
    try:
        ids = [row.inbox_id for row in inbox_rows(engine) if row.status == inbox.PENDING]
        WebhookIngestor(engine, providers=available()).run(ids, run_id="ingest-run-1")
    finally:
        messages_logger.removeHandler(handler)
        messages_logger.setLevel(old_level)
    (applied,) = [r for r in records if r.getMessage() == "provider event applied: delivered"]
    assert {k: logs.fields_of(applied).get(k) for k in IDS if k != "lane"} == {
        "event_id": "01KDVFF0NRVB039663SGXKY95F",
        "message_id": message_id,
        "idempotency_key": "01KDVFF0NRVB039663SGXKY95F:welcome",
        "provider_message_id": "sbx_42",
        "run_id": "ingest-run-1",
    }
