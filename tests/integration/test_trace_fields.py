"""``trace_id``, ``correlation_id`` and ``producer``: first-class envelope fields, with or without
OpenTelemetry.

* Validated at ``publish()`` with a ``PublishError`` naming the field (generated values): a W3C
  trace id (stored lowercase, never all zeros) or another tracer's opaque id; a correlation id
  of visible ASCII; a producer name of printable text; each within its column, no line breaks.
* Stored on the outbox row, carried to every provider's metadata field (SMTP: headers), put on
  the log lines that name the event, loaded into the warehouse (``stg_events``,
  ``email_funnel``), and searchable: ``email-platform trace --trace-id`` / ``--correlation-id``.
On SQLite and PostgreSQL where a database is involved.
"""

import json
import logging
import re
import string

import duckdb
import httpx
import pytest
from botocore.credentials import Credentials
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from email_platform import publish_many, warehouse
from email_platform.cli import main
from email_platform.common.errors import HeaderInjectionError, PermanentError, PublishError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.providers.ses import SesProvider
from email_platform.providers.smtp import SmtpProvider
from email_platform.publishing.validation import (
    check_correlation_id,
    check_producer,
    check_trace_id,
)
from email_platform.warehouse.files import writer_path
from tests.hostile_support import hostile_settings
from tests.support import batch_sender, event, run_send, sandbox_messages, signup

W3C = "4bf92f3577b34da6a3ce929d0e0e4736"
XRAY = "1-5759e988-bd862e3fe1be46a994272793"
_OPAQUE = string.ascii_letters + string.digits + "._:-"


# ---- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_id", "stored"),
    [
        (W3C, W3C),
        (W3C.upper(), W3C),  # the form OpenTelemetry reports, so a search finds it
        (XRAY, XRAY),
        ("463ac35c9f6413ad", "463ac35c9f6413ad"),  # B3, 64-bit
        ("12345678901234567890", "12345678901234567890"),  # Datadog, decimal
        ("x" * 64, "x" * 64),
    ],
)
def test_trace_ids_accepted(given_id: str, stored: str) -> None:
    assert check_trace_id(given_id) == stored


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("0" * 32, PublishError),
        ("x" * 65, PublishError),
        ("", PublishError),
        ("abc def", PublishError),
        ("abc/def", PublishError),
        ("abc\r\nX-Injected: 1", PublishError),
        (12345, PublishError),
    ],
)
def test_trace_ids_refused(value: object, error: type) -> None:
    with pytest.raises(error) as raised:
        check_trace_id(value)
    assert raised.value.field == "trace_id"


@hostile_settings(200)
@given(st.text(alphabet=_OPAQUE, min_size=1, max_size=64))
def test_any_id_of_the_opaque_alphabet_is_a_trace_id(value: str) -> None:
    stored = check_trace_id(value)
    if re.fullmatch(r"[0-9a-fA-F]{32}", value) and value.strip("0"):
        assert stored == value.lower()
    elif not re.fullmatch(r"0{32}", value):
        assert stored == value


@hostile_settings(300)
@given(st.text(min_size=1, max_size=80).filter(lambda v: not set(v) <= set(_OPAQUE)))
def test_any_other_text_is_refused_as_a_trace_id(value: str) -> None:
    with pytest.raises(PublishError) as raised:
        check_trace_id(value)
    assert raised.value.field == "trace_id"


@hostile_settings(300)
@given(st.text(min_size=1, max_size=250))
def test_correlation_ids_are_visible_ascii_within_the_column(value: str) -> None:
    visible = all("!" <= c <= "~" for c in value)
    encoded_break = re.search(r"=\?.*\?=", value) is not None
    try:
        assert check_correlation_id(value) == value
    except HeaderInjectionError as error:
        assert error.field == "correlation_id"
        assert not visible or encoded_break
    except PublishError as error:
        assert error.field == "correlation_id"
        assert not visible or len(value) > 200
    else:
        assert visible and len(value) <= 200


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("req 42", PublishError),
        ("req-42\r\nBcc: victim@example.net", HeaderInjectionError),
        ("=?utf-8?q?req=0D=0ABcc:_victim@example.net?=", HeaderInjectionError),
        ("r" * 201, PublishError),
        ("réq-42", PublishError),
    ],
)
def test_correlation_ids_refused(value: str, error: type) -> None:
    with pytest.raises(error) as raised:
        check_correlation_id(value)
    assert raised.value.field == "correlation_id"


@hostile_settings(300)
@given(st.text(min_size=1, max_size=250))
def test_producers_are_printable_text_within_the_column(value: str) -> None:
    try:
        assert check_producer(value) == value
    except PublishError as error:
        assert error.field == "producer"
        assert not value.isprintable() or len(value) > 200 or "=?" in value
    else:
        assert value.isprintable() and len(value) <= 200


def test_publish_names_the_field_and_publish_many_the_event(engine) -> None:
    with pytest.raises(HeaderInjectionError, match=r"^producer: "):
        signup(engine, "u1", producer="accounts\nX-Injected: yes")
    with pytest.raises(PublishError, match=r"^events\[1\]\.trace_id: "), engine.begin() as c:
        publish_many(
            c,
            [
                {
                    "event_type": "user.signed_up",
                    "aggregate_id": f"u{i}",
                    "payload": {"user_id": f"u{i}", "email": f"u{i}@example.com"},
                    "trace_id": trace_id,
                }
                for i, trace_id in enumerate([W3C, "not a trace id"])
            ],
        )
    event_id = signup(
        engine, "u2", trace_id=W3C.upper(), correlation_id="req-42", producer="Zahlungsdienst ü"
    )
    row = event(engine, event_id)
    assert (row.trace_id, row.correlation_id, row.producer) == (
        W3C,
        "req-42",
        "Zahlungsdienst ü",
    )
    assert row.trace_context is None  # no span current (and no OpenTelemetry provider)


# ---- provider metadata --------------------------------------------------------------------


def test_the_sandbox_provider_receives_the_trace_fields_as_metadata(engine, sandbox) -> None:
    traced = signup(engine, "u1", trace_id=W3C, correlation_id="req-42")
    plain = signup(engine, "u2")
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    batch_sender(engine, SandboxProvider(sandbox.base_url, timeout_s=5), lane).run(
        [traced, plain], run_id="r1"
    )
    seen = sandbox_messages(sandbox.base_url)
    metadata = {m["metadata"]["event_id"]: m["metadata"] for m in seen}
    assert metadata[traced]["trace_id"] == W3C
    assert metadata[traced]["correlation_id"] == "req-42"
    assert "trace_id" not in metadata[plain] and "correlation_id" not in metadata[plain]


def _email(**overrides: object) -> OutgoingEmail:
    values: dict = {
        "message_id": 1,
        "event_id": "01JDZ8V6Y3Q4W5E6R7T8Y9U0IA",
        "idempotency_key": "01JDZ8V6Y3Q4W5E6R7T8Y9U0IA:welcome",
        "sender": "Example <no-reply@example.com>",
        "to": "jane@example.com",
        "subject": "Welcome",
        "text": "Hi",
        "html": None,
        "template": "welcome",
        "lane": "transactional",
        "trace_id": XRAY,
        "correlation_id": "req-42",
    }
    values.update(overrides)
    return OutgoingEmail(**values)


def _never(request: httpx.Request) -> httpx.Response:
    raise AssertionError("no request is sent")


def test_each_adapter_carries_the_trace_fields_in_its_metadata_field() -> None:
    transport = httpx.MockTransport(_never)
    email = _email()
    postmark = PostmarkProvider(server_token="t", transport=transport).build_request(email)
    assert postmark.json["Metadata"]["trace_id"] == XRAY
    assert postmark.json["Metadata"]["correlation_id"] == "req-42"
    sendgrid = SendGridProvider(api_key="k", transport=transport).build_request(email)
    custom_args = sendgrid.json["custom_args"]
    assert (custom_args["trace_id"], custom_args["correlation_id"]) == (XRAY, "req-42")
    mailgun = MailgunProvider(api_key="k", domain="mg.example.com", transport=transport)
    fields = mailgun.build_request(email).data
    assert (fields["v:trace_id"], fields["v:correlation_id"]) == (XRAY, "req-42")
    resend = ResendProvider(api_key="k", transport=transport).build_request(email)
    tags = {tag["name"]: tag["value"] for tag in resend.json["tags"]}
    assert (tags["trace_id"], tags["correlation_id"]) == (XRAY, "req-42")
    ses = SesProvider(credentials=Credentials("AKID", "SECRET"), transport=transport)
    tags = {tag["Name"]: tag["Value"] for tag in ses.body(email)["EmailTags"]}
    assert (tags["trace_id"], tags["correlation_id"]) == (XRAY, "req-42")
    message, _ = SmtpProvider().build_message(email)
    assert (message["X-Email-Trace-Id"], message["X-Email-Correlation-Id"]) == (XRAY, "req-42")


def test_adapters_keep_within_their_limits_and_send_nothing_unset() -> None:
    transport = httpx.MockTransport(_never)
    long_id = _email(correlation_id="c" * 81, trace_id=None)
    metadata = PostmarkProvider(server_token="t", transport=transport).build_request(long_id)
    # Postmark caps a metadata value at 80 characters: left out, the message still goes.
    assert "correlation_id" not in metadata.json["Metadata"]
    assert "trace_id" not in metadata.json["Metadata"]
    odd = _email(correlation_id="order/42:line=3")
    ses = SesProvider(credentials=Credentials("AKID", "SECRET"), transport=transport)
    tags = {tag["Name"]: tag["Value"] for tag in ses.body(odd)["EmailTags"]}
    assert tags["correlation_id"] == "order_42_line_3"  # SES's tag alphabet
    plain, _ = SmtpProvider().build_message(_email(trace_id=None, correlation_id=None))
    assert "X-Email-Trace-Id" not in plain and "X-Email-Correlation-Id" not in plain


def test_a_line_break_in_a_trace_field_never_reaches_a_request() -> None:
    """``publish()`` refuses it; a row written by hand is refused by every adapter too."""
    transport = httpx.MockTransport(_never)
    hostile = _email(correlation_id="req-42\r\nBcc: victim@example.net")
    ses = SesProvider(credentials=Credentials("AKID", "SECRET"), transport=transport)
    for build in (
        SmtpProvider().build_message,
        ses.body,
        PostmarkProvider(server_token="t", transport=transport).send,
        SendGridProvider(api_key="k", transport=transport).send,
    ):
        with pytest.raises(PermanentError, match=r"^correlation_id contains CR") as raised:
            build(hostile)
        assert raised.value.code == "header_injection"


# ---- log lines ----------------------------------------------------------------------------


def test_log_lines_naming_the_event_carry_its_trace_fields(engine, sandbox, caplog) -> None:
    event_id = signup(
        engine, "u1", email="u1+reject@example.com", trace_id=W3C, correlation_id="req-42"
    )
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    with caplog.at_level(logging.WARNING):
        batch_sender(engine, SandboxProvider(sandbox.base_url, timeout_s=5), lane).run(
            [event_id], run_id="r1"
        )
    (line,) = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert line.startswith(f"event_id={event_id} trace_id={W3C} correlation_id=req-42 message=")


# ---- searchable ---------------------------------------------------------------------------


def _cli(database_url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env={"EMAIL_PLATFORM_DATABASE_URL": database_url})
    return result.exit_code, result.output


def test_trace_lists_the_events_of_one_request(engine, database_url, sandbox) -> None:
    first = signup(engine, "u1", trace_id=W3C, correlation_id="req-42", producer="accounts")
    second = signup(engine, "u2", trace_id=W3C, correlation_id="req-43")
    other = signup(engine, "u3", trace_id=XRAY, correlation_id="req-42")
    assert run_send(database_url, sandbox.base_url, "transactional", [first, second]).success

    code, output = _cli(database_url, "trace", "--trace-id", W3C, "--json")
    assert code == 0, output
    found = json.loads(output)
    assert [e["event_id"] for e in found["events"]] == [first, second]
    assert found["events"][0]["producer"] == "accounts"
    (message,) = found["events"][0]["messages"]
    assert (message["route"], message["status"]) == ("welcome", "sent")

    code, output = _cli(database_url, "trace", "--correlation-id", "req-42", "--json")
    assert [e["event_id"] for e in json.loads(output)["events"]] == [first, other]
    code, output = _cli(
        database_url, "trace", "--trace-id", W3C, "--correlation-id", "req-42", "--json"
    )
    assert [e["event_id"] for e in json.loads(output)["events"]] == [first]

    code, text = _cli(database_url, "trace", "--trace-id", W3C)
    assert code == 0 and f"trace_id={W3C}: 2 event(s)" in text
    assert f"event {first} user.signed_up" in text and "-> sent" in text
    code, text = _cli(database_url, "trace", "--trace-id", "no-such-trace")
    assert code != 0 and "no events with trace_id=no-such-trace" in text
    # The event's own trace keeps working, and names its request.
    code, text = _cli(database_url, "trace", first)
    assert code == 0 and f"trace_id={W3C} correlation_id=req-42 producer=accounts" in text
    code, text = _cli(database_url, "trace", first, "--trace-id", W3C)
    assert code != 0 and "not both" in text
    code, text = _cli(database_url, "trace")
    assert code != 0 and "EVENT_ID" in text


# ---- warehouse ----------------------------------------------------------------------------


def test_the_warehouse_carries_the_trace_fields(engine, database_url, sandbox, tmp_path) -> None:
    event_id = signup(engine, "u1", trace_id=W3C, correlation_id="req-42", producer="accounts")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(database_url, path)
    with duckdb.connect(str(path), read_only=True) as connection:
        staged = connection.execute(
            "SELECT trace_id, correlation_id, producer FROM stg_events WHERE event_id = ?",
            [event_id],
        ).fetchall()
        funnel = connection.execute(
            "SELECT trace_id, correlation_id, producer FROM email_funnel WHERE event_id = ?",
            [event_id],
        ).fetchall()
    assert staged == funnel == [(W3C, "req-42", "accounts")]


def test_a_warehouse_file_from_before_the_trace_fields_is_upgraded(
    engine, database_url, sandbox, tmp_path
) -> None:
    before = signup(engine, "u1")
    assert run_send(database_url, sandbox.base_url, "transactional", [before]).success
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(database_url, path)
    # As an older version left it: no trace columns, built from other models.
    for file in (path, writer_path(path)):
        if file.exists():
            with duckdb.connect(str(file)) as connection:
                for column in ("trace_id", "correlation_id", "producer"):
                    connection.execute(f"ALTER TABLE raw_email_outbox DROP COLUMN {column}")
                connection.execute("UPDATE warehouse_state SET value = 'old' WHERE name = 'models'")
    after = signup(engine, "u2", trace_id=W3C)
    assert run_send(database_url, sandbox.base_url, "transactional", [after]).success
    warehouse.refresh(database_url, path)
    with duckdb.connect(str(path), read_only=True) as connection:
        rows = dict(connection.execute("SELECT event_id, trace_id FROM email_funnel").fetchall())
    assert rows == {before: None, after: W3C}
